"""What third-party clients (lm-eval, guidellm, the openai client) send and read: echo with
logprobs (golden against HF), prompt_logprobs, OpenAI's nulls and integral floats, vLLM's
continuous usage stats, accepted-with-a-warning fields, /v1/models/{id}, --max-logprobs, CORS,
and the serve command line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_helpers import API_KEY, ServerThread

AUTH = {"Authorization": f"Bearer {API_KEY}"}
IDS = [1, 17, 5, 233, 42, 9, 301, 77]  # a prompt as token ids (BOS first)


def _post(server: ServerThread, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=AUTH, timeout=60)


def _hf_prompt_logprobs(hf: Any, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] log-softmax of HF's logits: row i predicts token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_logprobs_are_hfs_in_openais_shape(server: ServerThread, hf_llama: Any,
                                                max_tokens: int) -> None:
    """lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 0 or 1."""
    r = _post(server, "/v1/completions", {"prompt": IDS, "echo": True, "logprobs": 1,
                                          "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    n = len(IDS) + max_tokens
    assert [len(lp[k]) for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")] == [n] * 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:len(IDS)] == [f"t{i}" for i in IDS]
    ref = _hf_prompt_logprobs(hf_llama, IDS)
    for i in range(1, len(IDS)):
        assert lp["token_logprobs"][i] == pytest.approx(ref[i - 1, IDS[i]].item(), abs=1e-4)
        assert max(lp["top_logprobs"][i].values()) == pytest.approx(ref[i - 1].max().item(), abs=1e-4)
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and all(b == a + len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"]))
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    assert choice["text"].startswith(" ".join(f"t{i}" for i in IDS))  # the ids, decoded
    if max_tokens == 0:
        assert choice["text"] == " ".join(f"t{i}" for i in IDS) and choice["finish_reason"] == "length"


def test_prompt_logprobs_through_extra_body(server: ServerThread, hf_llama: Any) -> None:
    r = _post(server, "/v1/completions", {"prompt": IDS, "max_tokens": 1, "prompt_logprobs": 2,
                                          "echo": True, "logprobs": 4})
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ref = _hf_prompt_logprobs(hf_llama, IDS)
    assert plp[0] is None and len(plp) == len(IDS)
    for i in range(1, len(IDS)):
        assert plp[i][str(IDS[i])]["logprob"] == pytest.approx(ref[i - 1, IDS[i]].item(), abs=1e-4)
        assert len(plp[i]) <= 3  # rank <= 2 and the prompt's token (the engine ran k=4)
    assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][1]) == 4


def test_max_tokens_0_needs_echo_and_no_stream(server: ServerThread) -> None:
    r = _post(server, "/v1/completions", {"prompt": "t5", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = _post(server, "/v1/completions", {"prompt": "t5", "max_tokens": 0, "echo": True,
                                          "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"


def test_openai_nulls_mean_default_and_integral_floats_are_integers(server: ServerThread) -> None:
    base = {"prompt": "t5 t6", "max_tokens": 3, "temperature": 1.0, "ignore_eos": True}
    plain = _post(server, "/v1/completions", {**base, "seed": 7}).json()
    nulls = {"n": None, "stream": None, "logprobs": None, "echo": None, "min_tokens": None,
             "stream_options": None, "skip_special_tokens": None}
    r = _post(server, "/v1/completions", {**base, **nulls, "seed": 7.0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == plain["choices"][0]["text"]  # seed 7.0 is seed 7
    chat = {"messages": [{"role": "user", "content": "t5"}], "max_tokens": 2, "n": None,
            "logprobs": None, "parallel_tool_calls": None, "stream": None}
    assert _post(server, "/v1/chat/completions", chat).status_code == 200
    for bad, param in (({"seed": 7.5}, "seed"), ({"n": 2.5}, "n"), ({"prompt": None}, "prompt"),
                       ({"max_tokens": True}, "max_tokens")):
        r = _post(server, "/v1/completions", {**base, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


def test_continuous_usage_stats_put_usage_in_every_chunk(server: ServerThread) -> None:
    body = {"prompt": "t5 t6 t7", "max_tokens": 4, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH,
                      timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    with_choices = [e for e in events if e["choices"]]
    assert [e["usage"]["completion_tokens"] for e in with_choices] == [1, 2, 3, 4]
    prompt = _post(server, "/v1/completions", {"prompt": "t5 t6 t7", "max_tokens": 1}).json()
    n_prompt = prompt["usage"]["prompt_tokens"]
    assert all(e["usage"]["prompt_tokens"] == n_prompt for e in with_choices)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["total_tokens"] == n_prompt + 4


def test_harmless_fields_are_accepted_and_result_changing_ones_refused(server: ServerThread) -> None:
    base = {"prompt": "t5", "max_tokens": 2}
    from pagedllm.server.fields import WARNED

    values = {"cache_salt": "abc", "kv_transfer_params": {"a": 1}, "mm_processor_kwargs": {"a": 1},
              "vllm_xargs": {"a": 1}, "session_id": "s1"}
    assert set(values) == set(WARNED)
    for name, value in values.items():
        assert _post(server, "/v1/completions", {**base, name: value}).status_code == 200, name
    r = _post(server, "/v1/completions", {**base, "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_one_model_by_id(server: ServerThread) -> None:
    r = httpx.get(server.base_url + "/v1/models/tiny", headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    r = httpx.get(server.base_url + "/v1/models/org/other", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert httpx.get(server.base_url + "/v1/models/tiny").status_code == 401


def test_max_logprobs_and_cors(chat_model: Path) -> None:
    from fastapi.testclient import TestClient

    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import ServerLimits, build_app

    engine = LLMEngine.from_args(model=str(chat_model), block_size=4, num_kv_blocks=64,
                                 max_model_len=128)
    app = build_app(engine, limits=ServerLimits(max_logprobs=2),
                    allowed_origins=["http://ui.example"])
    with TestClient(app) as c:
        r = c.post("/v1/completions", json={"prompt": "t5", "max_tokens": 1, "logprobs": 3})
        assert r.status_code == 400 and "--max-logprobs" in r.json()["error"]["message"]
        assert c.post("/v1/completions", json={"prompt": "t5", "max_tokens": 1,
                                               "logprobs": 2}).status_code == 200
        pre = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
        ok = c.options("/v1/completions", headers={"Origin": "http://ui.example", **pre})
        assert ok.headers["access-control-allow-origin"] == "http://ui.example"
        no = c.options("/v1/completions", headers={"Origin": "http://evil.example", **pre})
        assert "access-control-allow-origin" not in no.headers


def test_serve_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedllm.entrypoints.cli import build_parser, main
    from pagedllm.server.cli import origins

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("pagedllm ")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--no-such-flag"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: pagedllm serve") and "--no-such-flag" in err
    a = build_parser().parse_args(["serve", "--uvicorn-log-level", "debug", "--root-path", "/llm",
                                   "--max-logprobs", "5", "--allowed-origins", '["http://a"]'])
    assert (a.log_level, a.root_path, a.max_logprobs) == ("debug", "/llm", 5)
    assert origins(a.allowed_origins) == ["http://a"] and origins("http://a, http://b") == [
        "http://a", "http://b"]
    with pytest.raises(ValueError, match="--allowed-origins"):
        origins('[1, 2]')


def test_truncate_prompt_tokens_keeps_the_last_tokens(server: ServerThread) -> None:
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    cut = _post(server, "/v1/completions", {**body, "prompt": IDS, "truncate_prompt_tokens": 3,
                                            "echo": True}).json()
    last = _post(server, "/v1/completions", {**body, "prompt": IDS[-3:]}).json()
    assert cut["usage"]["prompt_tokens"] == 3
    assert cut["choices"][0]["text"] == " ".join(f"t{i}" for i in IDS[-3:]) + last["choices"][0]["text"]
    chat = {**body, "messages": [{"role": "user", "content": "t5 t6 t7 t8 t9"}]}
    r = _post(server, "/v1/chat/completions", {**chat, "truncate_prompt_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 2
    r = _post(server, "/v1/completions", {**body, "prompt": "t5", "truncate_prompt_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_request_id_names_the_response(server: ServerThread) -> None:
    for path, body in (("/v1/completions", {"prompt": "t5"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "t5"}]})):
        for _ in range(2):  # the same id twice: the engine's ids stay apart
            r = _post(server, path, {**body, "max_tokens": 2, "request_id": "mine-1"})
            assert r.status_code == 200 and r.json()["id"] == "mine-1", r.text


def test_return_tokens_as_token_ids(server: ServerThread) -> None:
    body = {"max_tokens": 3, "temperature": 0, "ignore_eos": True, "logprobs": 2,
            "return_tokens_as_token_ids": True}
    r = _post(server, "/v1/completions", {**body, "prompt": IDS, "echo": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert lp["tokens"][:len(IDS)] == [f"token_id:{i}" for i in IDS]
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"][1:] for k in top)
    words = r["choices"][0]["text"].split()[len(IDS):]  # the word tokenizer: "t17" is id 17
    assert lp["tokens"][len(IDS):] == [f"token_id:{w[1:]}" for w in words]
    chat = {**body, "logprobs": True, "top_logprobs": 1,
            "messages": [{"role": "user", "content": "t5"}]}
    content = _post(server, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(c["token"].startswith("token_id:") for c in content)
    assert all(t["token"].startswith("token_id:") for c in content for t in c["top_logprobs"])


def _output_ids(server: ServerThread, path: str, body: dict[str, Any]) -> list[int]:
    r = _post(server, path, {**body, "max_tokens": 16, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    return [int(w[1:]) for w in text.split()]  # the word tokenizer: "t17" is id 17


def test_bad_words_are_never_generated(server: ServerThread) -> None:
    """(Against HF's greedy decoding with the same ban: tests/test_bad_words.py.)"""
    def alone(t: int) -> bool:  # "t17" tokenizes to 17 alone ("t307" is "t3" + "07")
        return _post(server, "/tokenize", {"prompt": f"t{t}", "add_special_tokens": False}
                     ).json()["tokens"] == [t]

    bodies = [("/v1/completions", {"prompt": IDS})] + [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": c}]})
        for c in ("t5 t6", "t7 t44", "t9 t8 t7 t6")]
    tested = set()
    for path, body in bodies:
        plain = _output_ids(server, path, body)
        word = next((t for t in plain if alone(t)), None)
        if word is None or path in tested:
            continue
        tested.add(path)
        got = _output_ids(server, path, {**body, "bad_words": [f"t{word}"]})
        first = plain.index(word)
        assert word not in got and got[:first] == plain[:first], (path, plain, got)
    assert tested == {"/v1/completions", "/v1/chat/completions"}
    for bad in ([""], "t5", [5], ["t5"] * 257):
        r = _post(server, "/v1/completions", {"prompt": "t5", "max_tokens": 1, "bad_words": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", (bad, r.text)


def test_continue_final_message(server: ServerThread) -> None:
    """vLLM's: the last message is continued (the test template joins contents with spaces and
    adds "t4" as the generation prompt), and it needs add_generation_prompt false."""
    msgs = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7 t8"}]
    tok = _post(server, "/tokenize", {"messages": msgs, "add_generation_prompt": False,
                                      "continue_final_message": True})
    assert tok.json()["tokens"] == [5, 6, 7, 8]
    body = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    r = _post(server, "/v1/chat/completions", {**body, "messages": msgs,
                                               "add_generation_prompt": False,
                                               "continue_final_message": True})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4
    ref = _post(server, "/v1/completions", {**body, "prompt": [5, 6, 7, 8]}).json()
    assert r.json()["choices"][0]["message"]["content"] == ref["choices"][0]["text"]
    for path, extra in (("/v1/chat/completions", body), ("/tokenize", {})):
        # add_generation_prompt defaults to true
        r = _post(server, path, {**extra, "messages": msgs, "continue_final_message": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
        assert "Cannot set both" in r.json()["error"]["message"]
