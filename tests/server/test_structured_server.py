"""Structured outputs through the real server and the official ``openai`` client: OpenAI's
``response_format``, vLLM's ``structured_outputs`` and ``guided_*`` fields, streamed and not, on
the shipped model and on a random-weight one; bad constraints and unsupported vLLM fields are
400s naming the field, and every KV block comes back."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from server_helpers import API_KEY, ServerThread
from structured_helpers import MAX_TOKENS, SCHEMA, check_json

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}


def _serve(model: str | None) -> Iterator[ServerThread]:
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import build_app

    engine = LLMEngine.from_args(model=model, num_kv_blocks=512, max_num_seqs=32)
    with ServerThread(build_app(engine, model_name="m", api_key=API_KEY)) as s:
        yield s


@pytest.fixture(scope="module")
def shipped() -> Iterator[ServerThread]:
    yield from _serve(None)


@pytest.fixture(scope="module")
def rand(bpe_model: Path) -> Iterator[ServerThread]:
    yield from _serve(str(bpe_model))


def _client(s: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.base_url + "/v1", api_key=API_KEY, max_retries=0)


def _chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("messages", MESSAGES)
    kw.setdefault("max_tokens", MAX_TOKENS)
    return client.chat.completions.create(model="m", **kw)


@pytest.mark.parametrize("which", ["shipped", "rand"])
def test_json_schema_20_sampled_requests_validate(which: str, request: pytest.FixtureRequest) -> None:
    server: ServerThread = request.getfixturevalue(which)
    client = _client(server)

    def one(seed: int) -> Any:
        return _chat(client, temperature=1.0, seed=seed, response_format=RESPONSE_FORMAT)

    with ThreadPoolExecutor(20) as pool:  # concurrent: they share the engine's steps
        resps = list(pool.map(one, range(20)))
    for r in resps:
        c = r.choices[0]
        check_json(c.message.content)
        assert c.finish_reason == "stop" and r.usage.completion_tokens < MAX_TOKENS
    assert len({r.choices[0].message.content for r in resps}) > 10
    server.wait_idle()


def test_streamed_deltas_reassemble_to_the_same_object(rand: ServerThread) -> None:
    client = _client(rand)
    kw = dict(temperature=1.0, seed=11, response_format=RESPONSE_FORMAT)
    whole = _chat(client, **kw).choices[0].message.content
    parts = [c.choices[0].delta.content or "" for c in _chat(client, stream=True, **kw) if c.choices]
    assert len(parts) > 3 and "".join(parts) == whole
    check_json(whole)
    rand.wait_idle()


def test_vllm_fields_and_json_object(rand: ServerThread) -> None:
    client = _client(rand)
    choices = ["alpha", "beta", "gamma delta"]
    for seed in range(3):
        r = _chat(client, temperature=1.0, seed=seed, extra_body={"guided_choice": choices})
        assert r.choices[0].message.content in choices
    pattern = r"[a-z]{2,8}-[0-9]{2,4}"
    r = _chat(client, temperature=1.0, seed=1, extra_body={"guided_regex": pattern})
    assert re.fullmatch(pattern, r.choices[0].message.content)
    r = _chat(client, temperature=1.0, seed=1, extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].message.content)
    r = _chat(client, temperature=1.0, seed=2, extra_body={"guided_json": SCHEMA})
    check_json(r.choices[0].message.content)
    r = _chat(client, temperature=1.0, seed=2,
              extra_body={"guided_grammar": 'root ::= "[" [0-9] ("," [0-9])* "]"'})
    assert re.fullmatch(r"\[[0-9](,[0-9])*\]", r.choices[0].message.content)
    r = _chat(client, temperature=1.0, seed=3, max_tokens=60,
              response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # any object: nothing bounds its length
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    # the completions endpoint takes them too, n > 1 included
    c = client.completions.create(model="m", prompt="x = ", max_tokens=MAX_TOKENS, n=3, seed=5,
                                  temperature=1.0, extra_body={"guided_json": SCHEMA})
    assert len(c.choices) == 3
    for ch in c.choices:
        check_json(ch.text)
    rand.wait_idle()


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/missing"}}}}}}, "response_format",
     "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", ""),
    ({"guided_json": '{"type": '}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a(b"}, "guided_regex", "unclosed group"),
    ({"guided_grammar": "root ::= nothing_here"}, "guided_grammar", "nothing_here"),
    ({"guided_choice": []}, "guided_choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json": {"type": "frob"}}}, "structured_outputs", "frob"),
    ({"structured_outputs": {"nonsense": 1}}, "structured_outputs", ""),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex", "both constrain"),
    ({"guided_regex": "a", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend",
     "llguidance"),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD)
def test_a_bad_constraint_is_a_400_naming_it(rand: ServerThread, extra: dict[str, Any], param: str,
                                             words: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(_client(rand), extra_body=extra)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err
    rand.wait_idle()


# vLLM request fields pagedllm does not implement: a 400 naming each, not a silent 200 (those that
# change no output here, server.fields.WARNED, are accepted: test_openai_compat)
UNSUPPORTED = {"use_beam_search": True, "length_penalty": 0.5,
               "spaces_between_special_tokens": False,
               "echo": True,
               "documents": [{"title": "t"}], "reasoning_effort": "low",
               "no_such_field": 1, "audio": {"voice": "x"},
               "modalities": ["audio"]}


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_an_unsupported_field_is_a_400_naming_it(rand: ServerThread, name: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(_client(rand), max_tokens=4, extra_body={name: UNSUPPORTED[name]})
    assert e.value.body["param"] == name, e.value.body


def test_honoured_fields(rand: ServerThread) -> None:
    """Fields that used to be ignored or refused now change the answer: harmless no-ops and
    vLLM fields at their default are accepted."""
    client = _client(rand)
    base = dict(temperature=0.0, max_tokens=5, extra_body={"ignore_eos": True})
    r = _chat(client, **base, logit_bias={"77": 100})
    assert r.choices[0].message.content == rand.call(lambda e: e.tokenizer.decode([77] * 5))
    r = client.completions.create(model="m", prompt="x = ", max_tokens=6, temperature=1.0, seed=0,
                                  logprobs=1, extra_body={"allowed_token_ids": [5, 9, 11]})
    assert r.choices[0].logprobs.tokens  # every chosen token is one of the three
    ids = rand.call(lambda e: [e.tokenizer.convert_tokens_to_ids(e.tokenizer.tokenize(t)) for t in
                               r.choices[0].logprobs.tokens])
    assert all(i in ([5], [9], [11]) for i in ids), ids
    r = client.completions.create(model="m", prompt="x = 1", max_tokens=2, temperature=0.0,
                                  extra_body={"prompt_logprobs": 2})
    plp = r.model_dump()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == rand.call(lambda e: len(e.tokenizer.encode("x = 1")))
    assert all(len(p) >= 2 for p in plp[1:])
    r = _chat(client, temperature=0.0, max_tokens=5, user="someone", metadata={"k": "v"},
              extra_body={"ignore_eos": True, "use_beam_search": False, "length_penalty": 1.0})
    assert r.choices[0].finish_reason == "length"
    rand.wait_idle()


def test_the_request_field_takes_every_structured_outputs_param() -> None:
    """The server's ``structured_outputs`` model and ``StructuredOutputsParams`` list the same
    fields with the same defaults (written twice: a pydantic model and a dataclass)."""
    import dataclasses

    from pagedllm import StructuredOutputsParams
    from pagedllm.server.protocol import StructuredOutputsFields

    server = {(f.alias or name): f.default for name, f in StructuredOutputsFields.model_fields.items()}
    params = {f.name: f.default for f in dataclasses.fields(StructuredOutputsParams)}
    assert server == params
