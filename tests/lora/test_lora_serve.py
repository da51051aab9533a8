"""Multi-LoRA served by a real ``pagedllm serve`` process: greedy tokens per adapter equal the
offline ``LLM`` with the same ``LoRARequest`` (itself golden against HF + PEFT) for a mixed batch
of 3 adapters + the base sent concurrently; /v1/models; unknown model 404; runtime load/unload
(an unload with a request in flight lets it finish); bad adapters 400 while the server keeps
serving; every KV block back at the end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from serve_process import serve_process
from server_helpers import CHAT_TEMPLATE

from pagedllm import LLM, LoRARequest, SamplingParams
from tests.lora.conftest import edited_copy

KEY = "sk-lora"
HEADERS = {"Authorization": f"Bearer {KEY}"}
MAX_TOKENS = 8
STARTED = ("attn_r4", "all_r8_rslora", "mlp_r16_layer1")  # --lora-modules; v_down_r2 at runtime
PROMPTS = [[11, 12, 13], list(range(20, 57)), [300, 5, 77, 9, 41]]
CHAT = [{"role": "user", "content": "hello there"}]
LONG = 480  # tokens of the request in flight during an unload (the model's 512 positions, less
# the prompt: long enough to outlast the unload call and a /metrics read)


@pytest.fixture(scope="module")
def offline(lora_base: Path, adapters: dict[str, Path]) -> LLM:
    return LLM(str(lora_base), enable_lora=True, max_loras=4, max_lora_rank=16, num_kv_blocks=128,
               block_size=16, dtype="float32")


def _lora(adapters: dict[str, Path], name: str | None) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, list(adapters).index(name) + 1,
                                                 str(adapters[name]))


def offline_tokens(llm: LLM, lora: LoRARequest | None, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False, lora_request=lora)
    return list(out[0].outputs[0].token_ids)


@pytest.fixture(scope="module")
def served(lora_base: Path, adapters: dict[str, Path]) -> Iterator[str]:
    modules = [f"{n}={adapters[n]}" for n in STARTED]
    with serve_process(str(lora_base), "--served-model-name", "base", "--api-key", KEY,
                       "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
                       "--lora-modules", *modules, "--allow-runtime-lora-updating",
                       "--dtype", "float32", "--num-kv-blocks", "128", "--block-size", "16",
                       "--batch-wait-ms", "20", "--kv-inspector", "--chat-template", CHAT_TEMPLATE,
                       timeout=180) as (_, base):
        yield base


def _completion(model: str, prompt: list[int], n: int = MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True, **extra}


def _tokens(choice: dict[str, Any]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


async def _served_tokens(base: str, jobs: list[tuple[str, list[int]]]) -> list[list[int]]:
    async with httpx.AsyncClient(base_url=base, headers=HEADERS, timeout=120) as c:
        rs = await asyncio.gather(*(c.post("/v1/completions", json=_completion(m, p))
                                    for m, p in jobs))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    assert [r.json()["model"] for r in rs] == [m for m, _ in jobs]  # the adapter's name, as vLLM
    return [_tokens(r.json()["choices"][0]) for r in rs]


def test_models_list_adapters(served: str, adapters: dict[str, Path]) -> None:
    data = httpx.get(served + "/v1/models", headers=HEADERS).json()["data"]
    assert [m["id"] for m in data] == ["base", *STARTED]
    assert data[0]["parent"] is None
    for card in data[1:]:
        assert card["parent"] == "base" and card["root"] == str(adapters[card["id"]])
    one = httpx.get(served + "/v1/models/attn_r4", headers=HEADERS).json()
    assert one["parent"] == "base"


def test_mixed_concurrent_batch_matches_offline(served: str, offline: LLM,
                                                adapters: dict[str, Path]) -> None:
    models: list[str | None] = [None, *STARTED]
    jobs = [(m or "base", p) for p in PROMPTS for m in models]
    got = asyncio.run(_served_tokens(served, jobs))
    want = [offline_tokens(offline, _lora(adapters, m), p) for p in PROMPTS for m in models]
    assert got == want
    assert len({tuple(t) for t in want[:4]}) == 4, "each adapter changes the tokens"
    # chat selects the adapter too: the same tokens as the offline chat
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for m in ("base", "attn_r4"):
        r = httpx.post(served + "/v1/chat/completions", headers=HEADERS, timeout=60, json={
            "model": m, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text
        ref = offline.chat(CHAT, sp, use_tqdm=False, chat_template=CHAT_TEMPLATE,
                           lora_request=_lora(adapters, None if m == "base" else m))
        assert r.json()["choices"][0]["message"]["content"] == ref[0].outputs[0].text
        assert r.json()["model"] == m


def test_prefix_cache_never_crosses_adapters(served: str) -> None:
    """A prompt of 4 full blocks: cached under the adapter that ran it, missed by another."""
    prompt = list(range(100, 164))
    hits = "pagedllm:prefix_cache_hits_total"
    asyncio.run(_served_tokens(served, [("attn_r4", prompt)]))
    before = _metric(served, hits)
    asyncio.run(_served_tokens(served, [("all_r8_rslora", prompt)]))
    asyncio.run(_served_tokens(served, [("base", prompt)]))
    assert _metric(served, hits) == before
    asyncio.run(_served_tokens(served, [("attn_r4", prompt)]))
    assert _metric(served, hits) >= before + 48


def test_official_openai_client(served: str, offline: LLM, adapters: dict[str, Path]) -> None:
    """The ``openai`` package: adapters listed with their parent, an adapter selected by
    ``model``, an unknown model its NotFoundError."""
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=served + "/v1", api_key=KEY)
    cards = {m.id: m for m in client.models.list().data}
    extra = cards["attn_r4"].model_extra or {}
    assert (extra["root"], extra["parent"]) == (str(adapters["attn_r4"]), "base")
    r = client.completions.create(model="all_r8_rslora", prompt=PROMPTS[1], max_tokens=MAX_TOKENS,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    ref = offline.generate({"prompt_token_ids": PROMPTS[1]},
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False, lora_request=_lora(adapters, "all_r8_rslora"))
    assert r.model == "all_r8_rslora" and r.choices[0].text == ref[0].outputs[0].text
    with pytest.raises(NotFoundError):
        client.completions.create(model="nope", prompt="hi", max_tokens=1)


def test_unknown_model_is_404(served: str) -> None:
    for path, body in (("/v1/completions", {"prompt": [1, 2]}),
                       ("/v1/chat/completions", {"messages": CHAT})):
        r = httpx.post(served + path, headers=HEADERS, json={"model": "nope", **body})
        assert r.status_code == 404
        err = r.json()["error"]
        assert "'nope' does not exist" in err["message"] and err["code"] == "model_not_found"
    assert httpx.get(served + "/v1/models/nope", headers=HEADERS).status_code == 404


def test_bad_adapters_400_and_the_server_keeps_serving(served: str, offline: LLM, tmp_path: Path,
                                                        adapters: dict[str, Path]) -> None:
    good = adapters["attn_r4"]
    key_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    bad = {
        "missing": (tmp_path / "nothing", "missing file adapter_config.json"),
        "rank32": (edited_copy(good, tmp_path / "rank", {"r": 32}), "r=32 is over max_lora_rank=16"),
        "shape": (edited_copy(good, tmp_path / "shape", tensors={key_a: torch.zeros(4, 65)}),
                  "do not fit the base model"),
        "attn_r4": (good, "already loaded"),
        "base": (good, "the base model's"),
    }
    for name, (path, why) in bad.items():
        r = httpx.post(served + "/v1/load_lora_adapter", headers=HEADERS,
                       json={"lora_name": name, "lora_path": str(path)})
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert repr(name) in msg and why in msg, msg
    ids = [m["id"] for m in httpx.get(served + "/v1/models", headers=HEADERS).json()["data"]]
    assert ids == ["base", *STARTED]
    got = asyncio.run(_served_tokens(served, [("attn_r4", PROMPTS[1]), ("base", PROMPTS[1])]))
    assert got == [offline_tokens(offline, _lora(adapters, "attn_r4"), PROMPTS[1]),
                   offline_tokens(offline, None, PROMPTS[1])]


def test_runtime_load_and_unload(served: str, offline: LLM, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "v_down_r2", "lora_path": str(adapters["v_down_r2"])}
    r = httpx.post(served + "/v1/load_lora_adapter", json=body)
    assert r.status_code == 401  # behind the API key
    r = httpx.post(served + "/v1/load_lora_adapter", headers=HEADERS, json=body)
    assert r.status_code == 200, r.text
    want = offline_tokens(offline, _lora(adapters, "v_down_r2"), PROMPTS[2])
    assert asyncio.run(_served_tokens(served, [("v_down_r2", PROMPTS[2])])) == [want]
    assert "v_down_r2" in [m["id"] for m in httpx.get(served + "/v1/models", headers=HEADERS).json()["data"]]
    r = httpx.post(served + "/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "v_down_r2"})
    assert r.status_code == 200, r.text
    r = httpx.post(served + "/v1/completions", headers=HEADERS, json=_completion("v_down_r2", PROMPTS[2]))
    assert r.status_code == 404
    r = httpx.post(served + "/v1/unload_lora_adapter", headers=HEADERS, json={"lora_name": "v_down_r2"})
    assert r.status_code == 404
    # loaded again under the same name (a fresh id): the same tokens
    assert httpx.post(served + "/v1/load_lora_adapter", headers=HEADERS, json=body).status_code == 200
    assert asyncio.run(_served_tokens(served, [("v_down_r2", PROMPTS[2])])) == [want]


def test_unload_with_a_request_in_flight_lets_it_finish(served: str, offline: LLM,
                                                        adapters: dict[str, Path]) -> None:
    name = "mlp_r16_layer1"
    text, in_flight = [], None
    with httpx.stream("POST", served + "/v1/completions", headers=HEADERS, timeout=120,
                      json=_completion(name, PROMPTS[0], LONG, stream=True, logprobs=None)) as s:
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert chunk["model"] == name
            text.append(chunk["choices"][0]["text"])
            if in_flight is None:  # the first token is out: unload while the rest runs
                r = httpx.post(served + "/v1/unload_lora_adapter", headers=HEADERS,
                               json={"lora_name": name})
                assert r.status_code == 200, r.text
                metrics = httpx.get(served + "/metrics").text  # one record for both lines
                in_flight = _metric(served, "pagedllm:num_requests_running", metrics) == 1
                info = _metric_line(served, "pagedllm:lora_requests_info", metrics)
                assert f'running_lora_adapters="{name}"' in info or not in_flight, info
                assert 'max_lora="2"' in info
    assert in_flight, "the request ran on after the unload"
    ref = offline.generate({"prompt_token_ids": PROMPTS[0]},
                           SamplingParams(temperature=0.0, max_tokens=LONG, ignore_eos=True),
                           use_tqdm=False, lora_request=_lora(adapters, name))
    assert "".join(text) == ref[0].outputs[0].text
    r = httpx.post(served + "/v1/completions", headers=HEADERS, json=_completion(name, PROMPTS[0]))
    assert r.status_code == 404


def _metric_line(base: str, name: str, text: str | None = None) -> str:
    """``name``'s line in ``text`` (a /metrics page) or, without it, in ``base``'s /metrics."""
    text = httpx.get(base + "/metrics").text if text is None else text
    return next(m for m in text.splitlines() if m.startswith(name + "{"))


def _metric(base: str, name: str, text: str | None = None) -> float:
    return float(_metric_line(base, name, text).split()[-1])


def test_lora_metrics_and_every_block_back(served: str) -> None:
    metrics = httpx.get(served + "/metrics").text.splitlines()

    def value(name: str, label: str) -> float:
        return float(next(m for m in metrics if m.startswith(name + "{") and label in m).split()[-1])

    assert value("pagedllm:lora_requests_total", 'lora_name="attn_r4"') >= 4
    # tokens and end-to-end latency by adapter (the front end's output processing)
    assert value("pagedllm:lora_generation_tokens_total", 'lora_name="attn_r4"') >= 4
    assert value("pagedllm:lora_e2e_request_latency_seconds_count", 'lora_name="attn_r4"') >= 4
    assert value("pagedllm:lora_time_to_first_token_seconds_count", 'lora_name="attn_r4"') >= 4
    assert value("pagedllm:lora_inter_token_latency_seconds_count", 'lora_name="attn_r4"') >= 4
    state = httpx.get(served + "/kv/state", headers=HEADERS, timeout=30).json()["state"]
    assert state["tables"] == {} and state["requests"] == []
    # free, free and cached, or the pages of an adapter that stays resident until the pool needs
    # them (kv/adapters.py): every block a request held is back
    assert set(state["blocks"]) <= {".", "c", "a"}
    pages = sorted(i for ids in state["adapters"].values() for i in ids)
    assert pages and pages == [i for i, c in enumerate(state["blocks"]) if c == "a"]
    usage = value("pagedllm:kv_cache_usage_perc", 'engine="0"')
    assert usage == pytest.approx(len(pages) / len(state["blocks"]))
    info = _metric_line(served, "pagedllm:lora_requests_info")  # idle: no adapter runs or waits
    assert 'running_lora_adapters=""' in info and 'waiting_lora_adapters=""' in info


def test_core_resolves_lora_id_by_name(offline: LLM, adapters: dict[str, Path]) -> None:
    """The core's side, without a server: a request's ``lora_id`` names a registered adapter;
    an unknown or unregistered name is refused with nothing queued."""
    from pagedllm.engine.messages import EngineCoreRequest

    core = offline.engine.core
    sp = SamplingParams(temperature=0.0, max_tokens=2)

    def req(rid: str, lora_id: str) -> EngineCoreRequest:
        return EngineCoreRequest(request_id=rid, prompt_token_ids=[5, 6, 7], sampling_params=sp,
                                 arrival_time=0.0, lora_id=lora_id)

    with pytest.raises(ValueError, match="'x' is not loaded"):
        core.add_request(req("r0", "x"))
    core.register_lora("x", 40, str(adapters["attn_r4"]))
    with pytest.raises(ValueError, match="'x' is already loaded"):
        core.register_lora("x", 41, str(adapters["attn_r4"]))
    with pytest.raises(ValueError, match="'y'.*missing file"):
        core.register_lora("y", 42, "/nothing/here")
    core.add_request(req("r1", "x"))
    assert core.groups["r1"][0].lora_request == LoRARequest("x", 40, str(adapters["attn_r4"]))
    core.unregister_lora("x")  # r1 runs on with it
    with pytest.raises(ValueError, match="'x' is not loaded"):
        core.add_request(req("r2", "x"))
    while core.has_unfinished_requests():
        core.step()
    assert core.kv.num_free_blocks + core.kv.adapters.num_blocks == core.kv.num_blocks
    core.kv.check_integrity()


def test_lora_modules_flag() -> None:
    from pagedllm.server.lora import parse_lora_modules

    assert parse_lora_modules(["a=/x", " b = /y "]) == {"a": "/x", "b": "/y"}
    assert parse_lora_modules("a=/x b=/y") == {"a": "/x", "b": "/y"}  # a YAML string
    for bad in (["a"], ["=/x"], ["a="], ["a=/x", "a=/y"]):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules(bad)


def test_lora_modules_need_enable_lora(lora_base: Path, adapters: dict[str, Path]) -> None:
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    engine = LLMEngine.from_args(model=str(lora_base), num_kv_blocks=16, block_size=16,
                                 max_model_len=128)
    try:
        with pytest.raises(ValueError, match="--lora-modules needs --enable-lora"):
            build_app(engine, lora_modules={"a": str(adapters["attn_r4"])})
    finally:
        engine.shutdown()


@pytest.mark.slow  # a server and two engine-core processes
def test_two_replicas_each_serve_the_adapters(lora_base: Path, adapters: dict[str, Path],
                                              offline: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """--data-parallel-size 2: every replica learns each adapter (start-up and runtime), so
    requests routed to either run it; the tokens equal the offline engine's. The runtime
    endpoints by the environment variable instead of the flag."""
    monkeypatch.setenv("PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    with serve_process(str(lora_base), "--served-model-name", "base", "--api-key", KEY,
                       "--enable-lora", "--max-lora-rank", "16", "--lora-modules",
                       f"attn_r4={adapters['attn_r4']}", "-dp", "2", "--data-parallel-threads", "1", "--routing-policy",
                       "round_robin", "--dtype", "float32", "--num-kv-blocks", "128",
                       "--block-size", "16", timeout=180) as (_, base):
        body = {"lora_name": "v_down_r2", "lora_path": str(adapters["v_down_r2"])}
        assert httpx.post(base + "/v1/load_lora_adapter", headers=HEADERS, json=body).status_code == 200
        r = httpx.post(base + "/v1/load_lora_adapter", headers=HEADERS,
                       json={"lora_name": "bad", "lora_path": "/nothing"})
        assert r.status_code == 400 and "'bad'" in r.json()["error"]["message"]
        jobs = [(m, p) for m in ("attn_r4", "v_down_r2", "base") for p in PROMPTS[:2]]
        got = asyncio.run(_served_tokens(base, jobs * 2))  # round robin: each on both replicas
        want = [offline_tokens(offline, _lora(adapters, None if m == "base" else m), p)
                for m, p in jobs]
        assert got == want * 2
