"""Structured outputs through ``LLM.generate``: JSON schemas, choices, regexes, grammars on the
shipped model and on a random-weight one, sampled at temperature 1; with n > 1, preemption by
recompute and by swap, prefix hits and a quantized KV cache; bad constraints refused up front."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from structured_helpers import MAX_TOKENS, SCHEMA, SMALL_SCHEMA, check_json

from pagedllm import LLM, SamplingParams, StructuredOutputsParams

PROMPT = "def main():\n    config = "


def _json_params(seed: int | None, schema: dict[str, Any] = SCHEMA, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0 if seed is not None else 0.0, seed=seed,
                          max_tokens=MAX_TOKENS, structured_outputs=StructuredOutputsParams(json=schema),
                          **kw)


def _small(seed: int | None) -> SamplingParams:
    return _json_params(seed, SMALL_SCHEMA)


@pytest.fixture(scope="module")
def shipped() -> LLM:
    return LLM(max_num_seqs=32, num_kv_blocks=512)


@pytest.fixture(scope="module")
def rand(bpe_model: Path) -> LLM:
    return LLM(str(bpe_model), max_num_seqs=32, num_kv_blocks=512)


def _idle(llm: LLM) -> None:
    e = llm.engine
    assert not e.has_unfinished_requests()
    assert e.kv.num_free_blocks == e.kv.num_blocks
    assert len(e.structured) == 0, "grammar state left behind"


@pytest.mark.parametrize("which", ["shipped", "rand"])
def test_json_schema_20_sampled_requests_validate(which: str, request: pytest.FixtureRequest) -> None:
    llm: LLM = request.getfixturevalue(which)
    outs = llm.generate([PROMPT] * 20, [_json_params(seed) for seed in range(20)], use_tqdm=False)
    texts = set()
    for o in outs:
        c = o.outputs[0]
        check_json(c.text)
        assert c.finish_reason == "stop" and len(c.token_ids) < MAX_TOKENS
        texts.add(c.text)
    assert len(texts) > 10, "seeded samples should differ"
    assert llm.engine.structured.compiler.misses <= 1  # one schema, compiled once
    _idle(llm)


def test_choice_regex_grammar_json_object(shipped: LLM) -> None:
    cases = [
        (StructuredOutputsParams(choice=["yes", "no", "it depends"]),
         lambda t: t in ("yes", "no", "it depends")),
        (StructuredOutputsParams(regex=r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)"),
         lambda t: re.fullmatch(r"[a-z]{2,8}@[a-z]{2,6}\.(com|org)", t)),
        (StructuredOutputsParams(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'),
         lambda t: re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", t)),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
         lambda t: isinstance(json.loads(t), dict)),
    ]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, structured_outputs=so)
              for so, _ in cases for s in range(3)]
    outs = llm_outs = shipped.generate([PROMPT] * len(params), params, use_tqdm=False)
    for i, o in enumerate(llm_outs):
        ok = cases[i // 3][1]
        c = o.outputs[0]
        if c.finish_reason == "length":  # json_object has no bound on its length
            assert cases[i // 3][0].json_object
            continue
        assert c.finish_reason == "stop" and ok(c.text), (cases[i // 3][0].kind, c.text)
    assert len(outs) == 12
    _idle(shipped)


def test_n_children_each_follow_the_grammar(rand: LLM) -> None:
    out = rand.generate(PROMPT, _json_params(7, SMALL_SCHEMA, n=4), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        check_json(c.text, SMALL_SCHEMA)
    assert len({c.text for c in out.outputs}) > 1
    _idle(rand)


def test_constrained_rows_leave_the_others_alone(rand: LLM) -> None:
    """In a mixed batch, unconstrained greedy requests get exactly what they get alone."""
    free = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = rand.generate([PROMPT, "x = "], free, use_tqdm=False)
    mixed = rand.generate([PROMPT, PROMPT, "x = ", PROMPT],
                          [free, _small(1), free, _small(None)], use_tqdm=False)
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == \
        [alone[0].outputs[0].token_ids, alone[1].outputs[0].token_ids]
    check_json(mixed[1].outputs[0].text, SMALL_SCHEMA)
    check_json(mixed[3].outputs[0].text, SMALL_SCHEMA)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_grammar_state(bpe_model: Path, mode: str) -> None:
    """A pool too small for the batch preempts requests mid-object; greedy and seeded outputs are
    the same as with room for all (seeded rows draw from their own generator), and valid."""
    prompts = [PROMPT * 2 + "#" * i for i in range(8)]
    params = [_small(None if i % 2 else i) for i in range(8)]
    roomy = LLM(str(bpe_model), block_size=4, num_kv_blocks=512)
    want = roomy.generate(prompts, params, use_tqdm=False)
    tight = LLM(str(bpe_model), block_size=4, num_kv_blocks=48, max_model_len=192,
                preemption_mode=mode, swap_space=0.01 if mode == "swap" else 0.0)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.num_preemptions > 0, "the pool was not small enough to preempt"
    if mode == "swap":
        assert tight.kv_stats()["swapped_out_blocks"] > 0
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    for o in got:
        check_json(o.outputs[0].text, SMALL_SCHEMA)
    _idle(tight)


def test_prefix_hits_and_quantized_kv(bpe_model: Path) -> None:
    llm = LLM(str(bpe_model), block_size=4, num_kv_blocks=256, kv_cache_dtype="int8")
    first = llm.generate([PROMPT * 3] * 2, [_small(None), _small(3)], use_tqdm=False)
    again = llm.generate([PROMPT * 3] * 2, [_small(None), _small(3)], use_tqdm=False)
    assert llm.get_prefix_cache_stats()["hits"] > 0
    for a, b in zip(first, again):
        check_json(a.outputs[0].text, SMALL_SCHEMA)
        assert a.outputs[0].text == b.outputs[0].text
    _idle(llm)


@pytest.mark.parametrize(("so", "problem"), [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
     "json: .*nope"),
    (StructuredOutputsParams(json='{"type": '), "json: not valid JSON"),
    (StructuredOutputsParams(json={"type": "frobnicate"}), "json: .*frobnicate"),
    (StructuredOutputsParams(regex="a(b"), "regex: .*unclosed group"),
    (StructuredOutputsParams(grammar="root ::= undefined_rule"), "grammar: .*undefined_rule"),
])
def test_a_constraint_that_cannot_compile_is_a_value_error(rand: LLM, so: StructuredOutputsParams,
                                                          problem: str) -> None:
    with pytest.raises(ValueError, match="(?s)structured_outputs." + problem):
        rand.generate(PROMPT, SamplingParams(structured_outputs=so), use_tqdm=False)
    _idle(rand)  # and the engine serves on: the next tests use it


def test_structured_outputs_params_checks() -> None:
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one of .*got json, regex"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutputsParams(choice=[])
    import pagedllm.sampling_params as sp

    assert sp.StructuredOutputsParams is StructuredOutputsParams


def test_logit_bias_and_allowed_token_ids(rand: LLM) -> None:
    base = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    greedy = rand.generate(PROMPT, base, use_tqdm=False)[0].outputs[0].token_ids
    forced = rand.generate(PROMPT, base.clone(logit_bias={77: 100.0}), use_tqdm=False)[0]
    assert forced.outputs[0].token_ids == [77] * 6
    banned = rand.generate(PROMPT, base.clone(logit_bias={greedy[0]: -100.0}), use_tqdm=False)[0]
    assert banned.outputs[0].token_ids[0] != greedy[0]
    allowed = rand.generate(PROMPT, base.clone(temperature=1.0, seed=0, allowed_token_ids=[5, 9, 11]),
                            use_tqdm=False)[0]
    assert set(allowed.outputs[0].token_ids) <= {5, 9, 11}
    for bad, field in (({4096: 1.0}, "logit_bias"), ({"x": 1.0}, "logit_bias"),
                       ({1: 200.0}, "logit_bias")):
        with pytest.raises(ValueError, match=field):
            rand.generate(PROMPT, base.clone(logit_bias=bad), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        rand.generate(PROMPT, base.clone(allowed_token_ids=[1, 5000]), use_tqdm=False)
    _idle(rand)


def test_step_stats_count_the_masks(rand: LLM) -> None:
    seen = []
    e = rand.engine
    e.add_request("s", PROMPT, _small(2))
    while e.has_unfinished_requests():
        e.step()
        seen.append(e.stats.num_structured_rows)
    assert max(seen) == 1 and e.stats.grammar_mask_time_s >= 0.0


def test_constrained_requests_beside_speculative_decoding() -> None:
    """With n-gram speculation on, a constrained request never verifies proposals (its grammar's
    mask holds for one token), so it is sampled exactly as without speculation, and an
    unconstrained request in the same batch still speculates and keeps its greedy tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "min_acceptance_rate": 0.0, "disable_by_batch_size": None}
    free = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = [PROMPT, PROMPT * 3]
    params = [_json_params(None), free]
    plain = LLM(max_num_seqs=8, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    llm = LLM(max_num_seqs=8, num_kv_blocks=256, speculative_config=spec)
    fast = llm.generate(prompts, params, use_tqdm=False)
    assert len(plain) == len(fast) == 2
    check_json(fast[0].outputs[0].text)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert llm.engine.stats.spec_total.num_drafts > 0, "the free request should have speculated"
    _idle(llm)
