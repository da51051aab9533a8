"""The KV tier shared by replicas (``--kv-transfer-config``) on the shipped model: one engine
stores its blocks, another loads them instead of computing, and its greedy tokens and
logprobs are those of an engine without the tier. Two engines in one process share an
``inproc`` tier by name, as replicas share the ``ray`` one."""

from __future__ import annotations

import itertools

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.args import EngineArgs

SYSTEM = ("You are a careful assistant. Answer in one short paragraph, cite the standard library "
          "where it helps, and never invent an API. ") * 2
PROMPTS = [SYSTEM + q for q in ("What is a list?", "How do I sort a dict by value?",
                                "Explain generators.", "What does zip do?")]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, logprobs=2)
_names = itertools.count()


def _tier(role: str = "kv_both", name: str | None = None) -> dict:
    return {"kv_connector": "inproc", "kv_role": role,
            "kv_connector_extra_config": {"actor_name": name or f"test-tier-{next(_names)}"}}


def _run(llm: LLM, prompts: list[str]) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


def _same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs, strict=True):
            for t, lp in lw.items():
                assert lg[t].logprob == pytest.approx(lp.logprob, abs=1e-4)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_a_second_engine_loads_the_first_ones_blocks(kv_dtype: str) -> None:
    ref = _run(LLM(seed=0, k_cache_dtype=kv_dtype, v_cache_dtype=kv_dtype), PROMPTS)
    name = f"test-tier-{next(_names)}"
    a = LLM(seed=0, k_cache_dtype=kv_dtype, v_cache_dtype=kv_dtype, kv_transfer_config=_tier(name=name))
    _same(_run(a, PROMPTS[:1]), ref[:1])
    sa = a.llm_engine.kv_stats()
    assert sa["kv_tier_blocks_stored"] >= len(a.get_tokenizer()(PROMPTS[0]).input_ids) // 16
    b = LLM(seed=0, k_cache_dtype=kv_dtype, v_cache_dtype=kv_dtype, kv_transfer_config=_tier(name=name))
    _same(_run(b, PROMPTS), ref)
    sb = b.llm_engine.kv_stats()
    system_blocks = len(b.get_tokenizer()(SYSTEM).input_ids) // 16
    # each prompt of b loaded at least the system prompt's full blocks from a's
    assert sb["external_prefix_cache_hits"] >= len(PROMPTS) * system_blocks * 16
    assert sb["kv_tier_bytes_loaded"] > 0 and sb["prefix_cache_hits"] == 0
    assert sb["external_prefix_cache_queries"] == sum(
        len(b.get_tokenizer()(p).input_ids) for p in PROMPTS)
    assert sb["used_blocks"] == 0  # every block back in the pool


def test_engines_of_other_kv_layouts_never_share_blocks() -> None:
    name = f"test-tier-{next(_names)}"
    LLM(seed=0, kv_transfer_config=_tier(name=name)).generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    b = LLM(seed=0, k_cache_dtype="int8", kv_transfer_config=_tier(name=name))
    ref = _run(LLM(seed=0, k_cache_dtype="int8"), PROMPTS[:1])
    _same(_run(b, PROMPTS[:1]), ref)
    assert b.llm_engine.kv_stats()["external_prefix_cache_hits"] == 0


def test_what_the_tier_does_not_cover_is_refused() -> None:
    with pytest.raises(ValueError, match="prefix cache's hashes"):
        EngineArgs(kv_transfer_config=_tier(), enable_prefix_caching=False).create_engine_config()


@pytest.mark.slow  # two tensor-parallel engines of 2 ranks each: ~30 s on 2 cores
def test_tensor_parallel_engines_share_blocks_rank_by_rank() -> None:
    """Each rank's heads travel in one payload (``r<rank>.`` planes); a TP=2 engine loading
    another's blocks gives the tokens of a TP=2 engine without the tier. A TP=1 engine has
    other keys: it loads nothing of theirs."""
    tp = dict(seed=0, tensor_parallel_size=2)
    ref_llm = LLM(**tp)
    ref = _run(ref_llm, PROMPTS)
    ref_llm.llm_engine.shutdown()
    name = f"test-tier-{next(_names)}"
    a = LLM(**tp, kv_transfer_config=_tier(name=name))
    _run(a, PROMPTS[:1])
    a.llm_engine.shutdown()
    b = LLM(**tp, kv_transfer_config=_tier(name=name))
    _same(_run(b, PROMPTS), ref)
    assert b.llm_engine.kv_stats()["external_prefix_cache_hits"] > 0
    b.llm_engine.shutdown()
    one = LLM(seed=0, kv_transfer_config=_tier(name=name))
    _run(one, PROMPTS[:1])
    assert one.llm_engine.kv_stats()["external_prefix_cache_hits"] == 0


def test_a_bad_config_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown kv_connector"):
        EngineArgs(kv_transfer_config='{"kv_connector": "nixl"}').create_engine_config()
