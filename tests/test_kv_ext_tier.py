"""The cluster-wide KV tier's store: config parsing, verified longest-prefix get, LRU byte budget,
int8 payloads with scales, and a failing tier degrading to a miss."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedllm.kv.connector import make_tier
from pagedllm.kv.ext_tier import KVTransferConfig, LRUBlockStore, SafeTier, payload_bytes


def _payload(seed: int, n: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"k0": torch.randn(n, generator=g), "v0": torch.randn(n, generator=g)}


def test_config_parses_vllm_shape_and_rejects_bad_input() -> None:
    c = KVTransferConfig.parse('{"kv_connector":"ray","kv_role":"kv_both"}')
    assert (c.kv_connector, c.produces, c.consumes) == ("ray", True, True)
    assert not KVTransferConfig.parse({"kv_connector": "inproc", "kv_role": "kv_consumer"}).produces
    for bad, msg in [
        ('{"kv_connector":"nixl"}', "unknown kv_connector"),
        ('{"kv_connector":"ray","kv_role":"kv_x"}', "unknown kv_role"),
        ('{"kv_connector":"ray","bogus":1}', "unknown --kv-transfer-config keys"),
        ("{not json", "not valid JSON"),
        ('{"kv_role":"kv_both"}', "needs a kv_connector"),
        ('{"kv_connector":"ray","kv_buffer_size":0}', "must be > 0"),
    ]:
        with pytest.raises(ValueError, match=msg):
            KVTransferConfig.parse(bad)


def test_get_returns_the_longest_verified_prefix() -> None:
    s = LRUBlockStore()
    toks = [[1, 2], [3, 4], [5, 6]]
    for i, (h, t) in enumerate(zip([10, 11, 12], toks)):
        s.put(h, t, _payload(i))
    got = s.get([10, 11, 12, 13], [*toks, [7, 8]])
    assert len(got) == 3 and torch.equal(got[1]["k0"], _payload(1)["k0"])
    assert len(s.get([10, 99, 12], toks)) == 1  # a gap ends the prefix


def test_a_block_whose_tokens_differ_is_rejected() -> None:
    s = LRUBlockStore()
    s.put(10, [1, 2], _payload(0))
    s.put(11, [3, 4], _payload(1))
    assert len(s.get([10, 11], [[1, 2], [3, 5]])) == 1  # collision on 11: stop before it
    assert s.stats["rejected"] == 1


def test_byte_budget_evicts_least_recently_used() -> None:
    size = payload_bytes(_payload(0))
    s = LRUBlockStore(budget_bytes=3 * size)
    for h in range(3):
        s.put(h, [h], _payload(h))
    s.get([0], [[0]])  # 0 is now hot; 1 is coldest
    s.put(3, [3], _payload(3))
    assert 1 not in s and 0 in s and 3 in s and s.used_bytes <= 3 * size
    assert s.stats["evicted"] == 1


def test_int8_payload_round_trips_with_its_scales() -> None:
    s = LRUBlockStore()
    p = {"k0": torch.randint(-128, 127, (4, 8), dtype=torch.int8), "k0_scale": torch.rand(4)}
    s.put(5, [9], p)
    (q,) = s.get([5], [[9]])
    assert q["k0"].dtype == torch.int8 and torch.equal(q["k0"], p["k0"]) and torch.equal(q["k0_scale"], p["k0_scale"])


class _Broken:
    def put(self, *a: object) -> None:
        raise ConnectionError("tier down")

    def get(self, *a: object) -> list:
        raise TimeoutError("tier down")


def test_a_failing_tier_warns_and_misses(caplog: pytest.LogCaptureFixture) -> None:
    t = SafeTier(_Broken())
    with caplog.at_level(logging.WARNING):
        t.put(1, [1], _payload(0))
        assert t.get([1], [[1]]) == []
    assert t.failures == 2 and "recomputing" in caplog.text


def test_make_tier_inproc() -> None:
    t = make_tier(KVTransferConfig.parse({"kv_connector": "inproc", "kv_buffer_size": 1 << 20}))
    t.put(1, [1], _payload(0))
    assert len(t.get([1], [[1]])) == 1


@pytest.mark.slow
def test_ray_tier_is_shared_by_name() -> None:
    ray = pytest.importorskip("ray")
    from pagedllm.kv.ray_tier import RayTier

    ray.init(num_cpus=1, include_dashboard=False, ignore_reinit_error=True, namespace="pagedllm-test")
    try:
        a, b = RayTier("t-shared", 1 << 20), RayTier("t-shared", 1 << 20)
        p = {"k0": torch.randint(-128, 127, (4, 8), dtype=torch.int8), "k0_scale": torch.rand(4)}
        a.put(7, [1, 2], p)
        (q,) = b.get([7, 8], [[1, 2], [3, 4]])
        assert torch.equal(q["k0"], p["k0"]) and torch.equal(q["k0_scale"], p["k0_scale"])
        assert b.stats()["hits"] == 1
    finally:
        ray.shutdown()
