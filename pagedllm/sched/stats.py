"""StepStats: one record per engine step, counted once. ``kv_stats()``, the Prometheus metrics,
the benchmarks and the model-free replay read these records instead of counting on their own.

A record is opened right after ``schedule()`` (``StepStats.open``: the batch the step runs, and
the KV it holds, as the benchmarks' utilization plots need it), gets the step's request events
from the engine's output processing (first tokens, latencies, finishes), and is closed at the end
of the step (``close``: queue lengths, KV blocks by state and the cumulative counters, as the
step left them). Pure Python; every count is O(1) or O(running requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.sched.memory import kv_slots, kv_utilization

if TYPE_CHECKING:
    from pagedllm.request import Request
    from pagedllm.sched.output import SchedulerOutput
    from pagedllm.sched.scheduler import Scheduler


@dataclass
class KVBlockCounts:
    """Device KV blocks by state, and the host (swap) tier."""

    total: int = 0
    free: int = 0  # ref count 0, cached ones included
    cached: int = 0  # free, still holding a cached prefix block (reusable until evicted)
    shared: int = 0  # referenced by more than one sequence (prefix hits, forks)
    pinned: int = 0  # held by preheated prefixes
    lora: int = 0  # held by resident LoRA adapters' weights (kv/adapters.py)
    lora_resident: int = 0  # adapters resident in the pool
    lora_page_ins: int = 0  # adapters paged into the pool, since start-up
    lora_page_outs: int = 0  # adapters paged out to make room, since start-up
    host_total: int = 0
    host_used: int = 0  # holding swapped-out KV

    @property
    def used(self) -> int:
        return self.total - self.free


@dataclass
class SpecDecodeCounts:
    """Speculative decoding (vLLM's metric names): verifications (``num_drafts``: requests that
    verified proposals), proposed and accepted tokens."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification produced on average: the accepted ones plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def add(self, other: SpecDecodeCounts) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens


@dataclass
class StepStats:
    step: int = 0  # the scheduler's step count (0: a snapshot outside any step)
    # -- the batch, right after scheduling ----------------------------------------------------
    num_scheduled_requests: int = 0
    num_prefill_tokens: int = 0  # prompt positions computed (recomputation included)
    num_decode_tokens: int = 0
    batch_running: int = 0  # requests holding KV while the step runs
    # tokens whose K/V are in the cache once the step has run (not those freed behind a window)
    live_tokens: int = 0
    max_blocks_per_request: int = 0  # the most blocks one running request holds in the step
    reserved_tokens: int = 0  # slots of those requests' block tables (a shared block per holder)
    pool_tokens: int = 0  # slots the pool has handed out: used blocks x block size
    # attention work (the planner's step-cost features): the summed contexts of 1-token steps
    # (of which in blocks shared with other requests: read once from cache, not from memory),
    # and the query x key pairs of multi-token chunks, n * (start + (n + 1) / 2) each (keys
    # capped at the sliding window when the KV manager has one)
    decode_context_tokens: int = 0
    decode_shared_context_tokens: int = 0
    prefill_attention_pairs: float = 0.0
    # -- the state the step left ----------------------------------------------------------------
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    kv: KVBlockCounts = field(default_factory=KVBlockCounts)
    num_preemptions: int = 0  # since start-up, as every counter below
    preemptions_by_kind: dict[str, int] = field(default_factory=dict)
    prefix_cache_queries: int = 0  # prompt tokens looked up (since the last stats reset)
    prefix_cache_hits: int = 0
    # the KV tier shared by replicas (--kv-transfer-config): prompt tokens looked up, loaded,
    # and blocks / bytes moved each way
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_tier_blocks_loaded: int = 0
    kv_tier_blocks_stored: int = 0
    kv_tier_bytes_loaded: int = 0
    kv_tier_bytes_stored: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    window_freed_blocks: int = 0  # freed behind a sliding window
    step_time_s: float = 0.0
    prepare_time_s: float = 0.0  # of the step time: building the flat batch from block tables
    # speculative decoding: this step's verifications, and the totals since start-up
    spec: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    spec_total: SpecDecodeCounts = field(default_factory=SpecDecodeCounts)
    num_structured_rows: int = 0  # rows sampled under a grammar mask
    grammar_mask_time_s: float = 0.0  # llguidance computing them (overlapping the forward)
    grammar_wait_time_s: float = 0.0  # of the step time: sampling waiting for the masks
    # -- request events of the step (the engine's output processing) --------------------------
    num_prompt_tokens: int = 0  # prompts of the requests that produced their first token
    num_generation_tokens: int = 0
    time_to_first_token_s: list[float] = field(default_factory=list)
    inter_token_latency_s: list[float] = field(default_factory=list)  # per request and step
    e2e_latency_s: list[float] = field(default_factory=list)  # of the requests that finished
    finish_reasons: list[str] = field(default_factory=list)  # one per finished sequence
    # LoRA on: the adapters of the running and the waiting (or swapped) requests, by name
    running_loras: list[str] = field(default_factory=list)
    waiting_loras: list[str] = field(default_factory=list)
    # the step's request events by adapter name (the front end's output processing)
    lora_generation_tokens: dict[str, int] = field(default_factory=dict)
    lora_ttft_s: list[tuple[str, float]] = field(default_factory=list)
    lora_itl_s: list[tuple[str, float]] = field(default_factory=list)
    lora_e2e_latency_s: list[tuple[str, float]] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kv_utilization(self) -> float:
        """live / reserved tokens of the step (``pagedllm.sched.memory.kv_utilization``)."""
        return kv_utilization(self.live_tokens, self.reserved_tokens)

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @classmethod
    def open(cls, sched: Scheduler, out: SchedulerOutput) -> StepStats:
        """The record of the step ``out`` was just scheduled for."""
        kv = sched.kv
        new = {s.request.request_id: s.num_new_tokens for s in out.scheduled}
        prefill = most = decode_ctx = decode_shared = 0
        pairs = 0.0
        bs, w = kv.block_size, kv.sliding_window
        for s in out.scheduled:
            r, c, n = s.request, s.request.num_computed_tokens, s.num_new_tokens
            prefill += max(0, min(c + n, r.num_prompt_tokens) - c)
            if n == 1:
                ctx = c + 1 if w is None else min(c + 1, w)
                decode_ctx += ctx
                decode_shared += min(ctx, kv.num_shared_blocks_of(r.request_id) * bs)
            elif w is None:
                pairs += n * (c + (n + 1) / 2)
            else:  # query c + j (j = 1..n) sees min(c + j, w) keys
                k = min(max(w - c, 0), n)
                pairs += k * c + k * (k + 1) / 2 + (n - k) * w
        live, reserved = kv_slots(sched.running, kv, new)
        most = max((kv.num_blocks_of(r.request_id) for r in sched.running), default=0)
        return cls(
            step=sched.num_steps, num_scheduled_requests=len(out.scheduled),
            num_prefill_tokens=prefill, num_decode_tokens=out.num_batched_tokens - prefill,
            batch_running=len(sched.running), live_tokens=live, reserved_tokens=reserved,
            pool_tokens=kv.num_used_blocks * bs, decode_context_tokens=decode_ctx,
            decode_shared_context_tokens=decode_shared, prefill_attention_pairs=pairs,
            max_blocks_per_request=most,
        )

    def close(self, sched: Scheduler, step_time_s: float) -> StepStats:
        """Fill in the state the step left; returns self."""
        kv, pool = sched.kv, sched.kv.pool
        self.num_running, self.num_waiting = sched.num_running, sched.num_waiting
        self.num_swapped = sched.num_swapped
        self.kv = KVBlockCounts(
            total=pool.num_blocks, free=pool.num_free_blocks, cached=pool.num_cached_free_blocks,
            shared=pool.num_shared_blocks, pinned=kv.num_pinned_blocks,
            lora=kv.adapters.num_blocks, lora_resident=len(kv.adapters.held),
            lora_page_ins=kv.adapters.num_loads, lora_page_outs=kv.adapters.num_evictions,
            host_total=kv.num_host_blocks, host_used=kv.num_host_blocks - kv.num_free_host_blocks,
        )
        self.num_preemptions = sched.num_preemptions
        self.preemptions_by_kind = dict(sched.preemptions_by_kind)
        self.prefix_cache_queries, self.prefix_cache_hits = kv.stats.queries, kv.stats.hits
        if (t := sched.external) is not None:
            x = t.stats
            self.external_prefix_cache_queries, self.external_prefix_cache_hits = x.queries, x.hits
            self.kv_tier_blocks_loaded, self.kv_tier_blocks_stored = x.blocks_loaded, x.blocks_stored
            self.kv_tier_bytes_loaded, self.kv_tier_bytes_stored = x.bytes_loaded, x.bytes_stored
        self.swapped_out_blocks, self.swapped_in_blocks = kv.host.stats["out"], kv.host.stats["in"]
        self.window_freed_blocks = kv.num_window_freed
        self.step_time_s = step_time_s
        if sched.config.max_loras is not None:
            self.running_loras = lora_names(sched.running)
            self.waiting_loras = lora_names([r for _, r in sched.waiting] + list(sched.swapped))
        return self


def lora_names(requests: list[Request]) -> list[str]:
    """The adapters ``requests`` run, by name, sorted (the base model's are left out)."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
