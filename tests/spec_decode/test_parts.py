"""The parts of speculative decoding on their own: n-gram lookup, the config, the KV manager's
rollback (exact block ids), the acceptance rule, the adaptive rule, the scheduler's budget."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pagedllm.kv.manager import KVCacheManager
from pagedllm.spec_decode.adaptive import AdaptiveRule
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import ngram_propose


def test_ngram_takes_the_latest_longest_match() -> None:
    #        0  1  2  3  4  5  6  7  8  9 10 11
    toks = [1, 2, 3, 9, 8, 1, 2, 3, 7, 6, 5, 2, 3]
    # suffix [2, 3] (n=2) last occurred at 6..7 -> followed by 7 6 5 ...
    assert ngram_propose(toks, 3, 2, 1) == [7, 6, 5]
    # n=3 tries [11, 2, 3] first: no match, falls back to n=2
    assert ngram_propose(toks, 3, 3, 1) == [7, 6, 5]
    assert ngram_propose(toks, 3, 3, 3) == []  # no suffix of length 3 repeats
    assert ngram_propose(toks, 10, 2, 2) == [7, 6, 5, 2, 3]  # the proposal stops at the end
    assert ngram_propose([4, 4, 4], 4, 2, 1) == [4]  # overlapping: [4, 4] at 0..1, then 4
    assert ngram_propose([5], 4, 3, 1) == [] and ngram_propose([5, 6], 4, 3, 1) == []


@pytest.mark.parametrize("bad, field", [
    ({"method": "medusa"}, "method"), ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_max"),
    ({"model": "x", "method": "ngram"}, "model"), ({"method": "draft_model"}, "model"),
    ({"min_acceptance_rate": 1.5}, "min_acceptance_rate"), ({"speculative_k": 4}, "unknown keys"),
    ("{not json", "not valid JSON"), ("[1]", "JSON object"),
])
def test_config_errors_name_the_field(bad: object, field: str) -> None:
    with pytest.raises(ValueError, match=field) as e:
        SpeculativeConfig.parse(bad)  # type: ignore[arg-type]
    assert "speculative" in str(e.value).lower()


def test_config_parse() -> None:
    assert SpeculativeConfig.parse(None) is None
    c = SpeculativeConfig.parse('{"num_speculative_tokens": 3, "prompt_lookup_max": 2}')
    assert c is not None and (c.method, c.num_speculative_tokens, c.prompt_lookup_max) == ("ngram", 3, 2)
    d = SpeculativeConfig.parse({"model": "/d", "num_speculative_tokens": 2})
    assert d is not None and d.method == "draft_model"
    assert SpeculativeConfig.parse(c) is c


def test_rollback_frees_the_blocks_past_the_kept_tokens() -> None:
    m = KVCacheManager(10, 4, enable_prefix_caching=True)
    toks = list(range(100, 106))  # 6 tokens: one full block + 2
    assert m.allocate_slots("a", 6)
    m.cache_blocks("a", toks, 6)
    # verify 1 + 4 proposals: positions 5..9 -> blocks 0, 1, 2
    assert m.allocate_slots("a", 10) and m.block_table("a") == [0, 1, 2]
    assert m.rollback("a", 7) == [2]  # 1 of 4 proposals accepted: positions 0..6 stay
    assert m.block_table("a") == [0, 1] and m.num_free_blocks == 8
    assert m.rollback("a", 7) == []  # nothing past the kept blocks: no-op
    assert m.rollback("zz", 3) == []  # unknown request: no-op
    m.cache_blocks("a", toks + [106, 107], 8)  # block 1 fills with kept tokens only: hashed
    assert m.pool.blocks[1].block_hash is not None and m.pool.blocks[2].block_hash is None
    m.check_integrity()
    with pytest.raises(AssertionError, match="past a hash"):
        m.rollback("a", 3)  # never past a hashed block
    m.free("a")
    assert m.num_free_blocks == 10
    m.check_integrity()


@dataclass
class _Tok:
    token_id: int


def test_accept_keeps_the_matching_prefix_and_the_targets_token() -> None:
    from pagedllm.runner.model_input import SeqInput
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.spec_decode.verify import accept

    def sched(rid: str, spec: list[int]) -> SeqInput:
        return SeqInput(rid, [3], 2, [0], spec, True, SamplingParams(max_tokens=8), 3, 0, ())

    a, b, c = sched("a", [5, 6, 7]), sched("b", []), sched("c", [8, 9])
    rows = [a] * 4 + [b] + [c] * 3
    toks = [_Tok(t) for t in (5, 6, 4, 1, 11, 8, 9, 12)]
    sampled: dict[str, _Tok] = {}
    accepted: dict[str, list[_Tok]] = {}
    accept(rows, toks, sampled, accepted)
    assert {k: v.token_id for k, v in sampled.items()} == {"a": 4, "b": 11, "c": 12}
    assert {k: [t.token_id for t in v] for k, v in accepted.items()} == {"a": [5, 6], "c": [8, 9]}


def test_adaptive_rule_backs_off_and_retries() -> None:
    cfg = SpeculativeConfig(min_acceptance_rate=0.5, acceptance_window=8, backoff_steps=3,
                            disable_by_batch_size=4)
    rule = AdaptiveRule(cfg)
    assert rule.batch_allows(4) and not rule.batch_allows(5)
    rule.record("r", 4, 4, step=1)
    rule.record("r", 4, 0, step=2)  # 4 of 8: not below half
    assert rule.request_allows("r", 3) and rule.num_backoffs == 0
    rule.record("r", 4, 0, step=3)  # window: last 8 proposed, 0 accepted
    assert rule.num_backoffs == 1
    assert not rule.request_allows("r", 4) and not rule.request_allows("r", 6)
    assert rule.request_allows("r", 7)  # after backoff_steps, with a fresh window
    rule.record("r", 4, 0, step=7)
    assert rule.request_allows("r", 8)
    rule.forget("r")
    assert rule.request_allows("r", 0)
    assert AdaptiveRule(SpeculativeConfig(disable_by_batch_size=None)).batch_allows(10 ** 6)


def test_build_spec_decoder_without_config() -> None:
    from types import SimpleNamespace

    from pagedllm.spec_decode.decoder import build_spec_decoder

    assert build_spec_decoder(SimpleNamespace(speculative=None), None, 1) is None  # type: ignore[arg-type]
