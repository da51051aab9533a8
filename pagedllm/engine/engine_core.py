"""EngineCore: the model's side of the engine. Token ids in (``EngineCoreRequest``), token ids out
(``EngineCoreOutputs``); no text. ``step()`` = schedule -> execute -> update -> outputs, as
messages: the spec decoder's proposals (request id -> token ids) go into ``schedule``; the
executor is told the step as plain data (``ModelInput``: the scheduled sequences, KV changes and
grammar masks), never a live ``Request``.

Built in one order on every device: the executor loads the weights (and, on a GPU without an
explicit KV size, profiles memory) -> the KV pool is planned from the budget -> KV manager and
scheduler -> the executor allocates the KV cache.

One way a sequence ends. ``Scheduler.finish_request`` is the only code that gives a request a
finished status (and frees its blocks). The scheduler's own ``update`` calls it for token-level
stops (eos, stop token ids, length); every other end the core decides (a complete grammar, a
failed request, an abort) goes through ``EngineCore._finish``. A stop
string is found by the front end, which finishes the request there and sends an abort
(``tests/test_structure.py`` pins both rules).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.core_outputs import StepOutputs
from pagedllm.engine.input import InputProcessor
from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.executor import Executor, make_executor
from pagedllm.generation_config import load_generation_defaults
from pagedllm.kv.connector import make_transfer
from pagedllm.kv.ext_tier import merge_ranks
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.plan import KVPoolPlan, plan_kv_pool
from pagedllm.kv.publisher import ZmqEventPublisher
from pagedllm.kv.transfer import KVTransfer
from pagedllm.logging_utils import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.request import Request, RequestStatus
from pagedllm.runner.model_input import ModelInput
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.sched import Scheduler, SchedulerOutput
from pagedllm.sched.admission import check_fits
from pagedllm.sched.build import build_scheduler
from pagedllm.sched.memory import KVMemoryPolicy
from pagedllm.sched.stats import StepStats
from pagedllm.spec_decode.decoder import SpecDecoder, build_spec_decoder
from pagedllm.structured.manager import StructuredOutputManager
from pagedllm.tokenizer import eos_token_ids, get_tokenizer

logger = init_logger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, scheduler_cls: type[Scheduler] = Scheduler,
                 executor: Executor | None = None) -> None:
        """``scheduler_cls`` swaps the batching policy (the benchmarks' contiguous baseline);
        ``executor`` the model (the planner's ``SimulatedExecutor``; default: the config's)."""
        self.config = config
        self.tokenizer = get_tokenizer(config.tokenizer, config.model.trust_remote_code)  # grammars and n-gram proposals
        self.generation_defaults = load_generation_defaults(config.model.model,
                                                            config.generation_config)
        self.eos_token_ids = eos_token_ids(
            self.tokenizer, config.model.eos_token_ids + self.generation_defaults.eos_token_ids)
        if executor is None:
            executor = make_executor(config)  # rank 0 here; with TP, the other ranks started
        self.kv_plan = p = plan_kv_pool(config.model, config.cache, config.scheduler,
                                        _profiled_budget(config, executor), config.lora)
        logger.info(startup_line(config, p))
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
        self.transfer: KVTransfer | None = None  # --kv-transfer-config: the replicas' KV tier
        if config.cache.kv_transfer is not None:
            def export(blocks: list[int]) -> list[Any]:  # every rank's heads of each block
                parts = executor.collective_rpc(ModelRunner.export_kv_blocks, blocks)
                return [merge_ranks([p[i] for p in parts]) for i in range(len(blocks))]

            layout = merge_ranks(executor.collective_rpc(ModelRunner.kv_payload_layout))
            self.transfer = make_transfer(config, export, layout)
            self.scheduler.external = self.transfer
            self._closing.callback(self.kv.events.subscribe(self.transfer.on_event))
        self.input = InputProcessor(config, self.tokenizer, self.eos_token_ids)
        self.structured = StructuredOutputManager(self.tokenizer, config.model.vocab_size,
                                                  self.eos_token_ids)
        self.spec: SpecDecoder | None = build_spec_decoder(config, self.tokenizer, p.num_blocks)
        self.groups: dict[str, list[Request]] = {}  # request id -> its live sequences
        self.lora_names: dict[str, LoRARequest] = {}  # served adapters (EngineCoreRequest.lora_id)
        self._group_of: dict[str, str] = {}  # sequence id -> request id
        self._ended: list[Request] = []  # sequences ended this step outside ``update``
        self.stats = self.current_stats()  # the last step's record (StepStats)
        # called with each step's schedule before it runs (the served core's StepThreads)
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, req: EngineCoreRequest, lora_request: LoRARequest | None = None) -> None:
        """Check and queue a tokenized request (its n sequences: ``InputProcessor.fan_out``).
        Raises ValueError without changing any state. ``req.lora_id``: the name of an adapter
        served by ``register_lora`` (unless ``lora_request`` is given)."""
        rid, ids, params = req.request_id, req.prompt_token_ids, req.sampling_params
        if lora_request is None and req.lora_id is not None:
            lora_request = self.lora_names.get(req.lora_id)
            if lora_request is None:
                raise ValueError(f"LoRA adapter {req.lora_id!r} is not loaded")
        if self.owns(rid) or rid in self.scheduler.holds:
            raise ValueError(f"request_id {rid!r} is already in use")
        if (req.keep_kv_s is not None or req.fork_of is not None) and params.n != 1:
            raise ValueError("keep_kv_s and fork_of need n=1")
        ids = self.input.tokenize(ids)[1]  # checked against the vocabulary
        check_fits(self.scheduler.config, self.kv, len(ids))  # a prompt never served fails now
        self.input.check_params(params, len(ids))
        self.input.check_logprobs(params)
        self.structured.check(params)
        if lora_request is not None:
            self.add_lora(lora_request)
        children = self.input.fan_out(rid, ids, params, req.priority, req.arrival_time,
                                      lora_request)
        children[0].keep_kv_s, children[0].fork_of = req.keep_kv_s, req.fork_of
        try:  # n > 1: children fork the first child's prompt blocks (copy-on-write)
            self.structured.add(children)
            self.scheduler.add_request(children[0], forks=children[1:])
        except Exception:
            self.structured.release([c.request_id for c in children])
            raise
        self.groups[rid] = children
        for c in children:
            self._group_of[c.request_id] = rid

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter (every rank); ValueError (``LoRAError``) naming it and the
        reason, or that LoRA is off. The engine is unchanged by a failure."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a pagedllm.LoRARequest, not "
                             f"{type(lora_request).__name__}")
        if self.config.lora is None:
            raise ValueError(f"lora_request {lora_request.lora_name!r} needs an engine started "
                             "with enable_lora=True (--enable-lora)")
        pages = self.executor.collective_rpc(ModelRunner.add_lora, lora_request)
        self.kv.adapters.register(lora_request.lora_int_id, max(pages))  # kv/adapters.py

    def register_lora(self, name: str, lora_int_id: int, path: str) -> None:
        """Load and check adapter ``name`` (``add_lora``) and serve it by name: a request with
        ``lora_id=name`` runs it. ValueError naming it and the reason; nothing changes then."""
        if name in self.lora_names:
            raise ValueError(f"LoRA adapter {name!r} is already loaded")
        lora = LoRARequest(name, lora_int_id, path)
        self.add_lora(lora)
        self.lora_names[name] = lora

    def unregister_lora(self, name: str) -> None:
        """Stop serving adapter ``name``: a new request naming it is refused; the requests
        already running it finish with it (they hold its ``LoRARequest``)."""
        if self.lora_names.pop(name, None) is None:
            raise ValueError(f"LoRA adapter {name!r} is not loaded")

    def owns(self, seq_id: str) -> bool:
        """A request or one of its sequences."""
        return seq_id in self._group_of or seq_id in self.groups

    def abort_requests(self, ids: list[str], step: StepStats | None = None) -> list[str]:
        """Abort requests or single sequences of n > 1 (a stop string found by the front end);
        an id held (``keep_kv_s``) ends its hold. Returns the ids that were live. ``step``: the record of the step whose
        outputs led to the aborts (stop strings, in the same process), brought up to date as
        ``stats``; else ``stats`` becomes a snapshot."""
        found = []
        for rid in ids:
            seqs = self.groups.get(rid)
            if seqs is None and rid in self._group_of:
                seqs = [r for r in self.groups[self._group_of[rid]] if r.request_id == rid]
            if seqs is not None:
                found.append(rid)
                for r in list(seqs):
                    self._finish(r.request_id, RequestStatus.FINISHED_ABORTED)
            else:
                self.scheduler.holds.release(rid)
        if found:
            self._release_ended()
            # the state changed outside a step
            self.stats = self.current_stats() if step is None else self._close(step, step.step_time_s)
        return found

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def request_ids(self) -> list[str]:
        """The unfinished requests."""
        return list(self.groups)

    def _finish(self, seq_id: str, status: RequestStatus) -> Request | None:
        """End a sequence for a reason decided outside the scheduler's ``update`` (grammar
        complete, error, abort); its state is released with the step's."""
        req = self.scheduler.finish_request(seq_id, status)
        if req is not None:
            self._ended.append(req)
        return req

    def _release_ended(self, finished: list[Request] | None = None) -> None:
        """Forget ended sequences' per-request state (sampling, grammars, proposers, groups)."""
        ended = [*(finished or ()), *self._ended]
        self._ended = []
        if not ended:
            return
        ids = [r.request_id for r in ended]
        self.executor.release(ids)
        self.structured.release(ids)
        if self.spec is not None:
            self.spec.release(ids)
        for r in ended:
            gid = self._group_of.pop(r.request_id, None)
            if gid is None:
                continue
            live = [c for c in self.groups[gid] if c is not r]
            if live:
                self.groups[gid] = live
            else:
                del self.groups[gid]

    # -- the hot loop ---------------------------------------------------------------------------
    def step(self) -> EngineCoreOutputs:
        t0 = time.perf_counter()
        proposals = None if self.spec is None else self.spec.propose(  # speculative decoding
            self.scheduler.running, self.owns, self.scheduler.num_steps + 1)
        sched = self.scheduler.schedule(proposals)
        if self.on_schedule is not None:
            self.on_schedule(sched)
        stats = StepStats.open(self.scheduler, sched)
        # the executor's message; the grammar masks are computed while the model runs
        model_input = ModelInput.build(sched, self.structured.masks(sched))
        out = StepOutputs(sched, self._group_of)
        try:
            result = self.executor.execute(model_input)
        except Exception as e:  # noqa: BLE001 - a bad request fails alone, else re-raised
            self._fail_culprits(sched, e)
            finished: list[Request] = []
        else:
            accepted = {rid: len(toks) for rid, toks in result.accepted.items()}
            tokens = {rid: t.token_id for rid, t in result.sampled.items()}
            finished = self.scheduler.update(sched, tokens, accepted)
            if self.spec is not None:
                stats.spec = self.spec.record(sched, accepted, self.scheduler.num_steps)
            for rid in self.structured.advance(sched):  # a complete grammar ends its request
                self._finish(rid, RequestStatus.FINISHED_STOPPED)
            out.add_tokens(result)
            stats.prepare_time_s = result.prepare_s
            if model_input.token_masks is not None:
                m = model_input.token_masks
                stats.num_structured_rows = len(m.rows)
                stats.grammar_mask_time_s, stats.grammar_wait_time_s = m.compute_s, m.wait_s
        if self.transfer is not None:  # the blocks cached this step, before a freed one is reused
            self.transfer.flush()
        outputs = out.build(self._ended)
        self._release_ended(finished)
        upkeep = self.scheduler.end_step()  # compaction, or shrinking an idle pool: KV only
        if upkeep is not None:
            self.executor.execute(ModelInput(kv=upkeep.kv))
        self.stats = self._close(stats, time.perf_counter() - t0)
        return EngineCoreOutputs(outputs=outputs, stats=self.stats)

    def _close(self, stats: StepStats, step_time_s: float) -> StepStats:
        stats.close(self.scheduler, step_time_s)
        if self.spec is not None:
            stats.spec_total = replace(self.spec.total)
        return stats

    def _fail_culprits(self, sched: SchedulerOutput, error: Exception) -> None:
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
        if not culprits:
            raise error
        for gid in sorted({self._group_of[rid] for rid in culprits}):
            logger.error("request %s failed inside a step and is ended with finish_reason "
                         "'error' (%s); the other requests continue",
                         gid, "; ".join(str(w) for r, w in culprits.items()
                                        if self._group_of[r] == gid), exc_info=error)
            for r in list(self.groups[gid]):
                self._finish(r.request_id, RequestStatus.FINISHED_ERROR)

    # -- state ------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        self._closing.close()
        self.scheduler.holds.release_all()
        self.structured.shutdown()
        self.executor.shutdown()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        if self.spec is not None:
            self.spec.check_integrity()  # a draft model's own KV pool
        for rid in self.scheduler.requests:
            assert rid in self._group_of, f"scheduler request {rid} has no owner"
        for rid in self.scheduler.holds.held:  # a hold is a table in the KV manager, no request
            assert self.kv.has_request(rid) and rid not in self.scheduler.requests, rid

    def current_stats(self) -> StepStats:
        """A record of the engine as it is now, outside any step (``self.stats`` is the last
        step's)."""
        return self._close(StepStats.open(self.scheduler, SchedulerOutput()), 0.0)

    def defragment(self) -> int:
        """Compact now: live blocks move to the lowest ids. Returns the number of blocks moved."""
        out = self.memory.defragment()
        self.executor.execute(ModelInput(kv=out.kv))
        return len(out.kv.compaction)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block; refused (False) while a request holds blocks."""
        return self.kv.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict[str, float]:
        """Prompt tokens looked up at admission (``queries``), found cached (``hits``)."""
        s = self.current_stats()
        return {"queries": s.prefix_cache_queries, "hits": s.prefix_cache_hits,
                "hit_rate": s.prefix_cache_hit_rate}

    def kv_stats(self) -> dict[str, Any]:
        from pagedllm.engine.core_outputs import kv_stats

        return kv_stats(self.current_stats(), self.config, self.kv.sliding_window)


def startup_line(config: EngineConfig, p: KVPoolPlan) -> str:
    """The one start-up line: model, dtype, device and KV pool (the tuning choices: DEBUG)."""
    m = config.model
    dtype = m.dtype if m.weight_dtype is None else f"{m.dtype} (linear weights {m.weight_dtype})"
    device = config.device
    if device == "cpu":
        from pagedllm import kernels

        device += f" (CPU kernels {kernels.isa()})" if kernels.available() else " (pure torch)"
    tp = config.parallel.tensor_parallel_size
    if tp > 1:
        device += f" x {tp} (tensor parallel)"
    return (f"model {m.model} ({m.architecture}), dtype {dtype}, device {device}; KV cache: "
            f"{p.num_blocks} blocks x {p.block_size} tokens = {p.num_tokens} tokens "
            f"({p.nbytes / 2**20:.1f} MiB, {config.cache.kv_dtype_label(m)}, "
            f"{p.bytes_per_block // p.block_size} bytes/token); {p.fit_summary()}")


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
