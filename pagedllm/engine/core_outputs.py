"""What the engine core reports: a step's ``EngineCoreOutput``s (token ids, logprobs, finish
reasons; no text) and its KV statistics as plain data."""

from __future__ import annotations

from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.messages import EngineCoreOutput, PromptLogprobs, TokenLogprobs
from pagedllm.request import Request
from pagedllm.runner.model_runner import RunnerOutput, SampledToken
from pagedllm.sched import SchedulerOutput
from pagedllm.sched.stats import StepStats


class StepOutputs:
    """Collects one step's outputs. Opened before the forward (it notes each scheduled
    sequence's length), it reports what ``Scheduler.update`` appended: the sampled token after a
    verification's accepted proposals, cut where a token-level stop ended the sequence."""

    def __init__(self, sched: SchedulerOutput, group_of: dict[str, str]) -> None:
        self.group_of = group_of
        self.before = [(s.request, s.request.num_tokens) for s in sched.scheduled
                       if s.request.request_id in group_of]
        self.result: RunnerOutput | None = None

    def add_tokens(self, result: RunnerOutput) -> None:
        self.result = result

    def build(self, ended: list[Request]) -> list[EngineCoreOutput]:
        """The outputs of the scheduled sequences that gained tokens, a prompt-logprobs chunk or
        an end, then those of sequences ended without being scheduled (``ended``)."""
        outs = []
        seen = set()
        res = self.result
        for req, n0 in self.before:
            rid = req.request_id
            seen.add(rid)
            new = req.token_ids[n0:] if res is not None else []
            chunk = res.prompt_logprobs.get(rid) if res is not None else None
            if not new and chunk is None and not req.is_finished:
                continue
            out = _output(req, new)
            if chunk is not None:
                out.prompt_logprobs = PromptLogprobs(chunk.start, chunk.chosen, chunk.ranks, chunk.topk)
            if new and req.params.logprobs is not None and res is not None:
                toks = [*res.accepted.get(rid, ()), res.sampled[rid]][: len(new)]
                out.new_logprobs = [_logprobs(t) for t in toks]
            outs.append(out)
        outs += [_output(r, []) for r in ended if r.request_id in self.group_of and r.request_id not in seen]
        return outs


def _output(req: Request, new: list[int]) -> EngineCoreOutput:
    out = EngineCoreOutput(request_id=req.request_id, new_token_ids=new,
                           num_cached_tokens=req.num_cached_tokens or 0,
                           num_preemptions=req.num_preemptions)
    if req.is_finished:
        out.finish_reason, out.stop_reason = req.status.value, req.stop_reason
        out.stop_token = req.stopped_on_token
    return out


def _logprobs(t: SampledToken) -> TokenLogprobs:
    assert t.logprob is not None, "a request with logprobs samples them"
    return TokenLogprobs(t.logprob, t.rank, t.topk)


def kv_stats(s: StepStats, config: EngineConfig, sliding_window: int | None) -> dict[str, Any]:
    """KV memory now: blocks by state, utilization, prefix cache, preemptions, swaps."""
    c = config.cache
    return {
        "num_blocks": s.kv.total,
        "used_blocks": s.kv.used,
        "cached_blocks": s.kv.cached,
        "free_blocks": s.kv.free,
        "shared_blocks": s.kv.shared,
        "pinned_blocks": s.kv.pinned,
        "lora_blocks": s.kv.lora,  # pages of resident LoRA adapters (their weights)
        "lora_resident_adapters": s.kv.lora_resident,
        "lora_page_ins": s.kv.lora_page_ins,
        "lora_page_outs": s.kv.lora_page_outs,
        "max_blocks_per_request": s.max_blocks_per_request,
        "sliding_window": sliding_window,  # None: every block is kept
        "window_freed_blocks": s.window_freed_blocks,
        "kv_utilization": s.kv_utilization,
        "prefix_cache_queries": s.prefix_cache_queries,
        "prefix_cache_hits": s.prefix_cache_hits,
        "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
        "external_prefix_cache_queries": s.external_prefix_cache_queries,
        "external_prefix_cache_hits": s.external_prefix_cache_hits,
        "kv_tier_blocks_loaded": s.kv_tier_blocks_loaded,
        "kv_tier_blocks_stored": s.kv_tier_blocks_stored,
        "kv_tier_bytes_loaded": s.kv_tier_bytes_loaded,
        "kv_tier_bytes_stored": s.kv_tier_bytes_stored,
        "num_preemptions": s.num_preemptions,
        "preemptions_by_kind": s.preemptions_by_kind,
        "swapped_out_blocks": s.swapped_out_blocks,
        "swapped_in_blocks": s.swapped_in_blocks,
        "num_swapped": s.num_swapped,
        "kv_bytes_per_token": c.kv_bytes_per_token(config.model),
        "k_cache_dtype": c.k_cache_dtype,
        "v_cache_dtype": c.v_cache_dtype,
        "spec_decode_num_drafts": s.spec_total.num_drafts,
        "spec_decode_num_draft_tokens": s.spec_total.num_draft_tokens,
        "spec_decode_num_accepted_tokens": s.spec_total.num_accepted_tokens,
        "spec_decode_acceptance_rate": s.spec_total.acceptance_rate,
        "spec_decode_mean_accepted_length": s.spec_total.mean_accepted_length,
    }
