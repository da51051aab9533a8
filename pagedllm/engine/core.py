"""LLMEngine: requests in, ``step()`` = schedule -> execute -> update -> outputs.

Built in one order on every device: the executor loads the weights (and, on a GPU without an
explicit KV size, profiles memory) -> the KV pool is planned from the budget -> KV manager and
scheduler -> the executor allocates the KV cache.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from pagedllm.args import EngineArgs
from pagedllm.config import EngineConfig
from pagedllm.engine.beam import MAX_BEAM_WIDTH, BeamSearch
from pagedllm.engine.input import InputProcessor, PromptType, load_prompts
from pagedllm.engine.output import OutputProcessor
from pagedllm.executor import Executor, make_executor
from pagedllm.generation_config import load_generation_defaults
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.plan import plan_kv_pool
from pagedllm.kv.publisher import ZmqEventPublisher
from pagedllm.logging_utils import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.request import RequestStatus
from pagedllm.runner.model_runner import ModelRunner, RunnerOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler, SchedulerOutput
from pagedllm.sched.build import build_scheduler
from pagedllm.sched.memory import KVMemoryPolicy
from pagedllm.sched.stats import StepStats
from pagedllm.spec_decode.decoder import SpecDecoder, build_spec_decoder
from pagedllm.structured.manager import StructuredOutputManager
from pagedllm.tokenizer import eos_token_ids, get_tokenizer

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, scheduler_cls: type[Scheduler] = Scheduler) -> None:
        """``scheduler_cls`` swaps the batching policy (the benchmarks' contiguous baseline)."""
        self.config = config
        self.tokenizer = get_tokenizer(config.tokenizer)
        self.generation_defaults = load_generation_defaults(config.model.model,
                                                            config.generation_config)
        self.eos_token_ids = eos_token_ids(
            self.tokenizer, config.model.eos_token_ids + self.generation_defaults.eos_token_ids)
        executor = make_executor(config)  # rank 0 here; with TP, the other ranks started
        self.kv_plan = p = plan_kv_pool(config.model, config.cache, config.scheduler,
                                        _profiled_budget(config, executor))
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s, %d bytes/token); %s",
            p.num_blocks, p.block_size, p.num_tokens, p.nbytes / 2**20,
            config.cache.kv_dtype_label(config.model), p.bytes_per_block // p.block_size,
            p.fit_summary(),
        )
        self.scheduler = build_scheduler(config, p, scheduler_cls)  # as the planner's replay
        self.kv: KVCacheManager = self.scheduler.kv
        self.memory: KVMemoryPolicy = self.scheduler.memory
        start = self.kv.num_blocks
        self._closing = contextlib.ExitStack()  # what shutdown() closes besides the executor
        if config.cache.kv_trace_path is not None:
            from pagedllm.kv.trace import KVTracer, attach

            sched = self.scheduler
            tracer = KVTracer(config.cache.kv_trace_path, clock=lambda: sched.num_steps)
            attach(self.kv, tracer)
            self._closing.callback(tracer.close)
        self.kv_publisher = None  # --kv-events-endpoint: the step batches over ZMQ
        if config.cache.kv_events_endpoint is not None:
            self.kv_publisher = ZmqEventPublisher(self.kv.events, config.cache.kv_events_endpoint)
            self._closing.callback(self.kv_publisher.close)
        executor.init_kv_cache(start)
        self.executor: Executor = executor
        self.input = InputProcessor(config, self.tokenizer, self.eos_token_ids)
        self.output = OutputProcessor(self.tokenizer)
        self.structured = StructuredOutputManager(self.tokenizer, config.model.vocab_size,
                                                  self.eos_token_ids)
        self.beams = BeamSearch(self.scheduler, self.tokenizer, config.scheduler.max_model_len)
        self.spec: SpecDecoder | None = build_spec_decoder(config, self.tokenizer, p.num_blocks)
        self.stats = self.current_stats()  # the last step's record (StepStats)

    @classmethod
    def from_engine_args(cls, args: EngineArgs,
                         scheduler_cls: type[Scheduler] = Scheduler) -> LLMEngine:
        """Build from settings; ``args.preheat_prompts`` are computed and pinned at start-up."""
        engine = cls(args.create_engine_config(), scheduler_cls)
        if args.preheat_prompts is not None:
            engine.preheat(args.preheat_prompts)
        return engine

    @classmethod
    def from_args(cls, scheduler_cls: type[Scheduler] = Scheduler, **kwargs: Any) -> LLMEngine:
        """Build from keyword settings: the fields of ``EngineArgs`` (vLLM's names accepted)."""
        return cls.from_engine_args(EngineArgs.from_kwargs(kwargs, "LLMEngine.from_args"),
                                    scheduler_cls)

    # -- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request (with ``lora_request``: run by that adapter, loaded and
        checked now). Raises ValueError without changing any state."""
        params = params or SamplingParams()
        self._check_new_id(request_id)
        text, ids = self.input.tokenize(prompt)
        self.scheduler.check_fits(len(ids))
        self.input.check_params(params, len(ids))
        self.structured.check(params)
        if lora_request is not None:
            self.add_lora(lora_request)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = self.input.fan_out(request_id, ids, params, priority, arrival, lora_request)
        self.output.add(request_id, text, ids, children, arrival)
        try:  # n > 1: children fork the first child's prompt blocks (copy-on-write)
            self.structured.add(children)
            self.scheduler.add_request(children[0], forks=children[1:])
        except Exception:
            self.structured.release([c.request_id for c in children])
            self.output.remove(request_id)
            raise

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter (every rank); ValueError (``LoRAError``) naming it and the
        reason, or that LoRA is off. The engine is unchanged by a failure."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a pagedllm.LoRARequest, not "
                             f"{type(lora_request).__name__}")
        if self.config.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs an engine started "
                             "with enable_lora=True (--enable-lora)")
        self.executor.collective_rpc(ModelRunner.add_lora, lora_request)

    def add_beam_search(self, request_id: str, prompt: PromptType, beam_width: int,
                        max_tokens: int, arrival_time: float | None = None) -> None:
        """Queue a beam search (``pagedllm.engine.beam``); its one output, when it finishes,
        holds ``beam_width`` sequences best first, ``cumulative_logprob`` = the beam's score."""
        self._check_new_id(request_id)
        if not 1 <= beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width={beam_width} must be in [1, {MAX_BEAM_WIDTH}]")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens} must be >= 1")
        _, ids = self.input.tokenize(prompt)
        max_len = self.config.scheduler.max_model_len
        if len(ids) + max_tokens > max_len:
            raise ValueError(f"a prompt of {len(ids)} tokens + max_tokens={max_tokens} exceeds "
                             f"max_model_len={max_len}")
        self.scheduler.check_fits(len(ids))
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.beams.add(request_id, ids, beam_width, max_tokens, arrival)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.output.groups or request_id in self.beams.searches:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its blocks return to the pool. Returns False if it is unknown."""
        ids = self.output.remove(request_id)
        for rid in ids:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        ids += self.beams.abort(request_id)
        if not ids:
            return False
        self._release(ids)
        self.stats = self.current_stats()  # the state changed outside a step
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.output.groups) or bool(self.beams.searches)

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's ModelRunner (introspection: its KV tensors change only through a step)."""
        return self.executor.driver

    def get_num_unfinished_requests(self) -> int:
        return len(self.output) + len(self.beams)

    def request_ids(self) -> list[str]:
        """The unfinished requests, generate and beam search."""
        return [*self.output.groups, *self.beams.searches]

    # -- the hot loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        if self.spec is not None:  # speculative decoding: proposals for this step's decodes
            self.spec.propose(self.scheduler.running, self.output.owns, self.scheduler.num_steps + 1)
        sched = self.scheduler.schedule()
        stats = StepStats.open(self.scheduler, sched)
        sched.token_masks = self.structured.masks(sched)  # computed while the model runs
        try:
            result = self.executor.execute(sched)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone, else re-raised
            outputs = self._fail_culprits(sched, e, stats)
        else:
            accepted = {rid: len(toks) for rid, toks in result.accepted.items()}
            self.scheduler.update(sched, self.beams.take(sched, result.sampled), accepted)
            if self.spec is not None:
                stats.spec = self.spec.record(sched, accepted, self.scheduler.num_steps)
            for rid in self.structured.advance(sched):  # a complete grammar ends its request
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
            outputs = self._process_outputs(sched, result, stats)
        upkeep = self.scheduler.end_step()  # compaction, or shrinking an idle pool: KV only
        if upkeep is not None:
            self.executor.execute(upkeep)
        self.stats = self._close(stats, time.perf_counter() - t0)
        return outputs

    def _close(self, stats: StepStats, step_time_s: float) -> StepStats:
        stats.close(self.scheduler, step_time_s)
        if self.spec is not None:
            stats.spec_total = replace(self.spec.total)
        return stats

    def _release(self, request_ids: list[str]) -> None:
        """Forget finished sequences' per-request state (sampling, grammars, proposers)."""
        self.executor.release(request_ids)
        self.structured.release(request_ids)
        if self.spec is not None:
            self.spec.release(request_ids)

    def _process_outputs(self, sched: SchedulerOutput, result: RunnerOutput,
                         stats: StepStats) -> list[RequestOutput]:
        stats.prepare_time_s = result.prepare_s
        if sched.token_masks is not None:
            m = sched.token_masks
            stats.num_structured_rows = len(m.rows)
            stats.grammar_mask_time_s, stats.grammar_wait_time_s = m.compute_s, m.wait_s
        done = self.output.process(sched.scheduled, result.sampled, result.prompt_logprobs, stats,
                                   result.accepted)
        for rid in done.stopped:
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)
        beam_outputs, beams_ended = self.beams.select()
        if done.finished or beams_ended:
            self._release(done.finished + beams_ended)
        return done.outputs + beam_outputs if beam_outputs else done.outputs

    def _fail_culprits(self, sched: SchedulerOutput, error: Exception,
                       stats: StepStats) -> list[RequestOutput]:
        """The executor failed a step. The requests in it that no longer pass admission's checks
        fail alone: finish_reason "error", blocks freed, the error logged with their ids. The
        others run the same step again next time: ``update`` never ran, so nothing of the failed
        step was recorded, and rerunning it writes the same K/V into the same slots (the step's
        KV changes are applied before the forward and sampling, where a request's bad data
        fails, and are not planned again). A failure that no request explains, or a fatal one
        (a lost tensor-parallel rank), is the engine's own: raised."""
        if getattr(error, "fatal", False):
            raise error
        culprits = {s.request.request_id: why for s in sched.scheduled
                    if (why := self.input.check_request(s.request)) is not None}
        groups = {self.output.group_of(rid) for rid in culprits}
        if not culprits or None in groups:  # none, or a beam (whose input the engine made)
            raise error
        outputs = []
        for gid in sorted(g for g in groups if g is not None):
            logger.error("request %s failed inside a step and is ended with finish_reason "
                         "'error' (%s); the other requests continue",
                         gid, "; ".join(str(w) for r, w in culprits.items()
                                        if self.output.group_of(r) == gid), exc_info=error)
            seqs = self.output.seq_ids(gid)
            for rid in seqs:
                self.scheduler.finish_request(rid, RequestStatus.FINISHED_ERROR)
            out = self.output.finish(gid, stats)
            if out is not None:
                outputs.append(out)
            self._release(seqs)
        return outputs

    # -- introspection ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop tensor-parallel workers (nothing to do in one process). Garbage collection and
        interpreter exit do it too; the engine is unusable afterwards."""
        self._closing.close()
        self.structured.shutdown()
        self.executor.shutdown()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.spec is not None:
            self.spec.check_integrity()  # a draft model's own KV pool
        for rid in self.scheduler.requests:
            assert self.output.owns(rid) or self.beams.owns(rid), f"scheduler request {rid} has no owner"

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    # -- KV memory management ---------------------------------------------------------------------
    def preheat(self, prompts: Sequence[PromptType] | str) -> int:
        """Warm-up: prefill ``prompts`` (a list, or a file with one prompt per line: text, or a
        JSON list of token ids) and pin their full prefix blocks in the cache.

        Trade-off: pinned blocks are never evicted, so requests sharing these prefixes (system
        prompts known in advance) always hit, at the price of that many blocks taken from the
        pool for good (``kv.unpin_all()`` releases them). Returns the number of pinned blocks.
        """
        items = load_prompts(prompts) if isinstance(prompts, str) else list(prompts)
        if self.has_unfinished_requests():
            raise RuntimeError("preheat needs an idle engine")
        ids = [self.input.tokenize(p)[1] for p in items]
        sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        for i, tok in enumerate(ids):
            self.add_request(f"__preheat__/{i}", {"prompt_token_ids": tok}, sp)
        while self.has_unfinished_requests():
            self.step()
        pinned = sum(self.kv.pin(tok) for tok in ids)
        self.kv.stats.reset()
        logger.info("preheated %d prompts: %d KV blocks pinned", len(ids), pinned)
        return pinned

    def defragment(self) -> int:
        """Compact now: live blocks move to the lowest ids. Returns the number of blocks moved."""
        out = self.memory.defragment()
        self.executor.execute(out)
        return len(out.kv.compaction)

    def prefix_cache_stats(self) -> dict[str, float]:
        """Prompt tokens looked up at admission (``queries``), found cached (``hits``)."""
        s = self.current_stats()
        return {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
                "hit_rate": s.prefix_cache_hit_rate}

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (``--generation-config``)."""
        return SamplingParams(**self.generation_defaults.sampling)

    def current_stats(self) -> StepStats:
        """A record of the engine as it is now, outside any step (``self.stats`` is the last
        step's)."""
        return self._close(StepStats.open(self.scheduler, SchedulerOutput()), 0.0)

    def kv_stats(self) -> dict[str, Any]:
        """KV memory now: blocks by state, utilization, prefix cache, preemptions, swaps."""
        s = self.current_stats()
        c = self.config.cache
        return {
            "num_blocks": s.kv.total,
            "used_blocks": s.kv.used,
            "cached_blocks": s.kv.cached,
            "free_blocks": s.kv.free,
            "shared_blocks": s.kv.shared,
            "pinned_blocks": s.kv.pinned,
            "max_blocks_per_request": s.max_blocks_per_request,
            "sliding_window": self.kv.sliding_window,  # None: every block is kept
            "window_freed_blocks": s.window_freed_blocks,
            "kv_utilization": s.kv_utilization,
            "prefix_cache_queries": s.prefix_cache_queries,
            "prefix_cache_hits": s.prefix_cache_hits,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "num_preemptions": s.num_preemptions,
            "preemptions_by_kind": s.preemptions_by_kind,
            "swapped_out_blocks": s.swapped_out_blocks,
            "swapped_in_blocks": s.swapped_in_blocks,
            "num_swapped": s.num_swapped,
            "kv_bytes_per_token": c.kv_bytes_per_token(self.config.model),
            "k_cache_dtype": c.k_cache_dtype,
            "v_cache_dtype": c.v_cache_dtype,
            "spec_decode_num_drafts": s.spec_total.num_drafts,
            "spec_decode_num_draft_tokens": s.spec_total.num_draft_tokens,
            "spec_decode_num_accepted_tokens": s.spec_total.num_accepted_tokens,
            "spec_decode_acceptance_rate": s.spec_total.acceptance_rate,
            "spec_decode_mean_accepted_length": s.spec_total.mean_accepted_length,
        }


def _profiled_budget(config: EngineConfig, executor: Executor) -> int | None:
    """KV bytes a CUDA memory profile leaves (``config.kv_sized_by_profile``), else None."""
    if not config.kv_sized_by_profile:
        return None
    from pagedllm.runner.memory import kv_budget

    prof = executor.memory_profile
    assert prof is not None
    measured = kv_budget(prof, config.gpu_memory_utilization)
    if config.cache.initial_num_kv_blocks is not None:
        # growing reallocates: the old and the new pool are briefly both on the GPU
        measured //= 2
        logger.info("elastic KV pool on a profiled GPU budget: it grows to half the budget "
                    "(a growth holds the old and the new pool at once)")
    logger.info(
        "GPU memory: %.2f GiB free at start; weights %.2f GiB, activation peak %.2f GiB, "
        "non-torch %.2f GiB, CUDA graphs %.2f GiB -> KV budget %.2f GiB "
        "(gpu_memory_utilization=%.2f)",
        prof.free_at_start / 2**30, prof.weights / 2**30, prof.activation_peak / 2**30,
        prof.non_torch / 2**30, prof.graph_pool / 2**30, measured / 2**30,
        config.gpu_memory_utilization,
    )
    return measured
