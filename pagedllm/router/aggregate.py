"""The data-parallel client's totals over its replicas: one ``StepStats`` record (what the
``/kv`` inspector's chart and ``client.stats`` read) and one ``kv_stats()`` dict, with each
replica's own beside it. Counts add up; rates are recomputed from the summed counts."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import fields
from typing import Any

from pagedllm.sched.stats import KVBlockCounts, SpecDecodeCounts, StepStats

# the KV tier's counters (--kv-transfer-config), in StepStats and kv_stats() alike
_TIER = ("external_prefix_cache_queries", "external_prefix_cache_hits", "kv_tier_blocks_loaded",
         "kv_tier_blocks_stored", "kv_tier_bytes_loaded", "kv_tier_bytes_stored")
# StepStats fields that are a count of the replica's state or a counter since start-up
_SUMMED = ("num_running", "num_waiting", "num_swapped", "num_preemptions", "prefix_cache_queries",
           "prefix_cache_hits", "swapped_out_blocks", "swapped_in_blocks", "window_freed_blocks",
           *_TIER)


def merge_stats(records: Sequence[StepStats]) -> StepStats:
    """The replicas' latest records as one: state and counters summed (KV blocks by state,
    queues, preemptions, prefix-cache queries and hits); ``step`` the largest."""
    out = StepStats()
    if not records:
        return out
    for name in _SUMMED:
        setattr(out, name, sum(getattr(r, name) for r in records))
    out.step = max(r.step for r in records)
    out.kv = KVBlockCounts(**{f.name: sum(getattr(r.kv, f.name) for r in records)
                              for f in fields(KVBlockCounts)})
    total = SpecDecodeCounts()
    kinds: Counter[str] = Counter()
    for r in records:
        total.add(r.spec_total)
        kinds.update(r.preemptions_by_kind)
    out.spec_total, out.preemptions_by_kind = total, dict(kinds)
    return out


# kv_stats() keys that add up over replicas (the rest: the largest, or the first replica's)
_KV_SUMMED = ("num_blocks", "used_blocks", "cached_blocks", "free_blocks", "shared_blocks",
              "pinned_blocks", "lora_blocks", "lora_resident_adapters", "lora_page_ins",
              "lora_page_outs", "window_freed_blocks", "prefix_cache_queries", "prefix_cache_hits",
              "num_preemptions", "swapped_out_blocks", "swapped_in_blocks", "num_swapped",
              "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
              "spec_decode_num_accepted_tokens", *_TIER)


def merge_kv_stats(per_replica: Sequence[dict[str, Any] | None]) -> dict[str, Any]:
    """``kv_stats()`` of the live replicas summed, each replica's under ``replicas`` (None for
    one that is down)."""
    live = [s for s in per_replica if s is not None]
    if not live:
        return {"replicas": list(per_replica)}
    out = dict(live[0])
    for key in _KV_SUMMED:
        out[key] = sum(s[key] for s in live)
    out["max_blocks_per_request"] = max(s["max_blocks_per_request"] for s in live)
    out["kv_utilization"] = sum(s["kv_utilization"] for s in live) / len(live)
    kinds: Counter[str] = Counter()
    for s in live:
        kinds.update(s["preemptions_by_kind"])
    out["preemptions_by_kind"] = dict(kinds)
    q, h = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = h / q if q else 0.0
    spec = SpecDecodeCounts(out["spec_decode_num_drafts"], out["spec_decode_num_draft_tokens"],
                            out["spec_decode_num_accepted_tokens"])
    out["spec_decode_acceptance_rate"] = spec.acceptance_rate
    out["spec_decode_mean_accepted_length"] = spec.mean_accepted_length
    out["replicas"] = list(per_replica)
    return out


def engine_row(index: int, alive: bool, stats: StepStats, routed: int) -> dict[str, Any]:
    """One replica's line in the KV inspector's ``engines`` table."""
    return {"engine": index, "alive": alive, "num_running": stats.num_running,
            "num_waiting": stats.num_waiting, "used_blocks": stats.kv.used,
            "num_blocks": stats.kv.total, "routed": routed}
