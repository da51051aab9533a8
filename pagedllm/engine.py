"""LLMEngine: step() = schedule -> run -> update. LLM: the offline, vLLM-style API."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from pagedllm.args import EngineArgs
from pagedllm.config import EngineConfig
from pagedllm.executor import make_executor
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.plan import plan_kv_pool
from pagedllm.kv_preheat import KVMemoryController, kv_stats, load_prompts
from pagedllm.logging_utils import init_logger
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.request import Logprob, PositionLogprobs, Request, RequestStatus
from pagedllm.runner.model_runner import PromptLogprobsChunk, SampledToken
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import ScheduledRequest, Scheduler
from pagedllm.sched.preemption import PreemptionCost
from pagedllm.tokenizer import IncrementalDetokenizer, eos_token_ids, get_tokenizer

logger = init_logger(__name__)

if TYPE_CHECKING:
    from pagedllm.beam_search import BeamSearchOutput

PromptType = str | dict[str, Any] | list[int]


@dataclass
class _Group:
    """The user's request: n child sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    arrival_time: float


class LLMEngine:
    def __init__(self, config: EngineConfig, scheduler_cls: type[Scheduler] = Scheduler) -> None:
        """``scheduler_cls`` swaps the batching policy (the benchmarks' contiguous baseline)."""
        self.config = config
        self.tokenizer = get_tokenizer(config.tokenizer)
        self.eos_token_ids = eos_token_ids(self.tokenizer, config.model.eos_token_ids)
        cache = config.cache
        # On CUDA without an explicit size, the pool is what a memory profile leaves: the model
        # loads (and profiles) before the plan; otherwise the plan comes first.
        profiled = config.is_cuda and cache.num_kv_blocks is None and cache.kv_cache_memory is None
        measured: int | None = None
        if profiled:
            from pagedllm.runner.memory import kv_budget

            runner = make_executor(config, None)
            prof = runner.memory_profile
            assert prof is not None
            measured = kv_budget(prof, config.gpu_memory_utilization)
            if cache.initial_num_kv_blocks is not None:
                # growing reallocates: the old and the new pool are briefly both on the GPU
                measured //= 2
                logger.info("elastic KV pool on a profiled GPU budget: it grows to half the "
                            "budget (a growth holds the old and the new pool at once)")
            logger.info(
                "GPU memory: %.2f GiB free at start; weights %.2f GiB, activation peak %.2f GiB, "
                "non-torch %.2f GiB, CUDA graphs %.2f GiB -> KV budget %.2f GiB "
                "(gpu_memory_utilization=%.2f)",
                prof.free_at_start / 2**30, prof.weights / 2**30, prof.activation_peak / 2**30,
                prof.non_torch / 2**30, prof.graph_pool / 2**30, measured / 2**30,
                config.gpu_memory_utilization,
            )
        self.kv_plan = plan_kv_pool(config.model, cache, config.scheduler, measured)
        p = self.kv_plan
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s, %d bytes/token); fits %d "
            "requests of max_model_len=%d",
            p.num_blocks, p.block_size, p.num_tokens, p.nbytes / 2**20,
            config.cache.kv_dtype_label(config.model), p.bytes_per_block // p.block_size,
            p.max_concurrent_full_requests, p.max_model_len,
        )
        start = min(config.cache.initial_num_kv_blocks or p.num_blocks, p.num_blocks)
        self.kv = KVCacheManager(start, p.block_size, config.cache.enable_prefix_caching,
                                 num_host_blocks=config.cache.num_host_blocks(config.model))
        self.kv.set_max_num_blocks(p.num_blocks)  # an elastic pool grows up to the budget
        self.scheduler = scheduler_cls(config.scheduler, self.kv)
        self._closing = contextlib.ExitStack()  # what shutdown() closes besides the runner
        if config.cache.kv_trace_path is not None:
            from pagedllm.kv.trace import KVTracer, attach

            sched = self.scheduler
            tracer = KVTracer(config.cache.kv_trace_path, clock=lambda: sched.num_steps)
            attach(self.kv, tracer)
            self._closing.callback(tracer.close)
        self.scheduler.cost_model = preemption_cost(config, p.bytes_per_block)
        if profiled:
            runner.init_kv_cache(start)
            self.runner = runner
        else:
            self.runner = make_executor(config, start)  # a ModelRunner; with TP, rank 0 of the group
        self.memory = KVMemoryController(self)
        self.groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, tuple[_Group, int]] = {}
        self._ids = itertools.count()

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
    ) -> None:
        """Validate and queue a request. Raises ValueError without changing any state."""
        params = params or SamplingParams()
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text, ids = self._tokenize(prompt)
        self.scheduler.check_fits(len(ids))
        limit = self.config.scheduler.max_num_seqs
        if params.n > limit:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={limit}: the n sequences of a "
                             f"request run together; lower n or raise --max-num-seqs")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children: list[Request] = []
        detoks: list[IncrementalDetokenizer] = []
        for i in range(params.n):
            child_params = params
            if params.n > 1:
                child_params = params.clone(n=1, seed=None if params.seed is None else params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(
                Request(
                    request_id=child_id,
                    prompt_token_ids=ids,
                    params=child_params,
                    eos_token_ids=self.eos_token_ids,
                    max_model_len=self.config.scheduler.max_model_len,
                    priority=priority,
                    arrival_time=arrival,
                )
            )
            detoks.append(
                IncrementalDetokenizer(
                    self.tokenizer, ids, params.stop, params.include_stop_str_in_output,
                    params.skip_special_tokens,
                )
            )
        group = _Group(request_id, text, ids, children, detoks, arrival)
        for i, child in enumerate(children):
            self._child_to_group[child.request_id] = (group, i)
        try:  # n > 1: children fork the first child's prompt blocks (copy-on-write)
            self.scheduler.add_request(children[0], forks=children[1:])
        except Exception:
            for child in children:
                self._child_to_group.pop(child.request_id, None)
            raise
        self.groups[request_id] = group

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            else:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        else:
            ids = prompt
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        vocab = self.config.model.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains ids outside [0, {vocab}): {bad[:5]}")
        return None, list(ids)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its blocks return to the pool. Returns False if it is unknown."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        for child in group.children:
            self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)
            self._child_to_group.pop(child.request_id, None)
        self.runner.release([c.request_id for c in group.children])
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.groups)

    # -- the hot loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.memory.before_step()  # elastic pool growth
        sched = self.scheduler.schedule()
        result = self.runner.execute(sched)
        self.scheduler.update(sched, {rid: t.token_id for rid, t in result.sampled.items()})
        outputs = self._process(sched.scheduled, result.sampled, result.prompt_logprobs)
        self.memory.after_step()  # compaction triggers, shrink when idle
        return outputs

    def _process(
        self,
        scheduled: list[ScheduledRequest],
        sampled: dict[str, SampledToken],
        prompt_lps: dict[str, PromptLogprobsChunk],
    ) -> list[RequestOutput]:
        touched: dict[str, _Group] = {}
        now = time.monotonic()
        for s in scheduled:
            req = s.request
            entry = self._child_to_group.get(req.request_id)
            if entry is None:
                continue
            group, idx = entry
            chunk = prompt_lps.get(req.request_id)
            if chunk is not None:
                self._record_prompt_logprobs(req, chunk)
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            touched[group.request_id] = group
            if req.first_token_time is None:
                req.first_token_time = now
            self._record_logprobs(req, tok)
            detok = group.detoks[idx]
            stop_token = req.is_finished and req.status == RequestStatus.FINISHED_STOPPED
            new_ids = [] if stop_token and not req.params.include_stop_str_in_output else [tok.token_id]
            if new_ids:
                detok.add_tokens(new_ids)
            if detok.stopped_by is not None and not req.is_finished:
                req.stop_reason = detok.stopped_by
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)
        outputs = [self._make_output(g, now) for g in touched.values()]
        for o in outputs:
            if o.finished:
                group = self.groups.pop(o.request_id)
                ids = [c.request_id for c in group.children]
                for cid in ids:
                    self._child_to_group.pop(cid, None)
                self.runner.release(ids)
        return outputs

    def _record_logprobs(self, req: Request, tok: SampledToken) -> None:
        if tok.logprob is not None:
            req.cumulative_logprob += tok.logprob
        if req.logprobs is None or tok.logprob is None:
            return
        pos: PositionLogprobs = {}
        for rank, (tid, lp) in enumerate(tok.topk, start=1):
            pos[tid] = Logprob(lp, rank, self._token_text(tid))
        pos[tok.token_id] = Logprob(tok.logprob, tok.rank, self._token_text(tok.token_id))
        req.logprobs.append(pos)

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _record_prompt_logprobs(self, req: Request, chunk: PromptLogprobsChunk) -> None:
        assert req.prompt_logprobs is not None
        if chunk.start != len(req.prompt_logprobs):
            return  # a recomputation after preemption: these positions are already recorded
        for j, (lp, rank) in enumerate(zip(chunk.chosen, chunk.ranks)):
            tid = req.prompt_token_ids[chunk.start + j]
            pos: PositionLogprobs = {
                t: Logprob(v, r, self._token_text(t))
                for r, (t, v) in enumerate(chunk.topk[j], start=1)
            }
            pos[tid] = Logprob(lp, rank, self._token_text(tid))
            req.prompt_logprobs.append(pos)

    def _make_output(self, group: _Group, now: float) -> RequestOutput:
        outs = []
        for i, (child, detok) in enumerate(zip(group.children, group.detoks)):
            finish = child.status.value if child.is_finished else None
            text = detok.text if finish else detok.text[: len(detok.text) - detok.holdback()]
            outs.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=child.output_token_ids,
                    cumulative_logprob=child.cumulative_logprob if child.params.logprobs is not None else None,
                    logprobs=child.logprobs,
                    finish_reason=finish,
                    stop_reason=child.stop_reason,
                )
            )
        finished = all(o.finished for o in outs)
        first = group.children[0]
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_token_time=min((c.first_token_time for c in group.children if c.first_token_time), default=None),
            finished_time=now if finished else None,
            num_preemptions=sum(c.num_preemptions for c in group.children),
        )
        return RequestOutput(
            request_id=group.request_id,
            prompt=group.prompt,
            prompt_token_ids=group.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs,
            outputs=outs,
            finished=finished,
            metrics=metrics,
        )

    # -- introspection ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop tensor-parallel workers (nothing to do in one process). Garbage collection and
        interpreter exit do it too; the engine is unusable afterwards."""
        self._closing.close()
        self.runner.shutdown()

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        live = set(self.scheduler.requests)
        for rid in live:
            assert rid in self._child_to_group, f"scheduler request {rid} has no group"

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
        ids = [self._tokenize(p)[1] for p in items]
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
        return self.memory.defragment()

    def prefix_cache_stats(self) -> dict[str, float]:
        """Prompt tokens looked up at admission (``queries``), found cached (``hits``)."""
        st = self.kv.stats
        return {"queries": st.queries, "hits": st.hits, "hit_rate": st.hit_rate}

    def kv_stats(self) -> dict[str, Any]:
        stats = kv_stats(self.scheduler, self.kv)
        c = self.config.cache
        stats["kv_bytes_per_token"] = c.kv_bytes_per_token(self.config.model)
        stats["k_cache_dtype"], stats["v_cache_dtype"] = c.k_cache_dtype, c.v_cache_dtype
        return stats


def preemption_cost(config: EngineConfig, bytes_per_block: int) -> PreemptionCost:
    """Rough per-victim costs for preemption_mode="auto": 2 FLOPs per weight per token against
    host<->device bandwidth (assumed throughputs: CPU 5e10 FLOP/s and 5e9 B/s; CUDA 5e13 FLOP/s
    and 1.2e10 B/s over PCIe)."""
    m = config.model
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    per_layer = m.hidden_size * (2 * q + 2 * kv) + 3 * m.hidden_size * m.intermediate_size
    params = m.num_hidden_layers * per_layer + m.vocab_size * m.hidden_size
    cuda = config.is_cuda
    return PreemptionCost(2.0 * params, float(bytes_per_block), 5e13 if cuda else 5e10,
                          1.2e10 if cuda else 5e9)


class LLM:
    """Offline generation, vLLM-style: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

    With no ``model`` the shipped default model (a small Llama trained on Python source) is used.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """``kwargs``: the fields of ``pagedllm.EngineArgs`` (e.g. ``num_kv_blocks``,
        ``preheat_prompts``); an unknown name is a TypeError naming the closest one."""
        args = EngineArgs.from_kwargs({"model": model, **kwargs}, "LLM")
        self.engine = LLMEngine.from_engine_args(args)
        self._counter = itertools.count()

    def get_prefix_cache_stats(self) -> dict[str, float]:
        return self.engine.prefix_cache_stats()

    def defragment(self) -> int:
        return self.engine.defragment()

    def kv_stats(self) -> dict[str, Any]:
        return self.engine.kv_stats()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        plist = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise ValueError(f"got {len(params)} sampling_params for {len(plist)} prompts")
        prios = list(priority) if priority is not None else [0] * len(plist)
        if len(prios) != len(plist):
            raise ValueError(f"got {len(prios)} priorities for {len(plist)} prompts")

        ids = [f"gen-{next(self._counter)}" for _ in plist]
        added: list[str] = []
        try:
            for rid, p, sp, pr in zip(ids, plist, params, prios):
                self.engine.add_request(rid, p, sp, priority=pr)
                added.append(rid)
            return self._run(ids, use_tqdm)
        finally:
            for rid in added:  # on error or interrupt nothing stays queued or holds blocks
                self.engine.abort_request(rid)

    def beam_search(self, prompts: PromptType | Sequence[PromptType], beam_width: int,
                    max_tokens: int) -> list[BeamSearchOutput]:
        """Beam search; beams share KV blocks by fork (see ``pagedllm.beam_search``). Returns,
        per prompt, ``beam_width`` sequences best first with their summed logprobs."""
        from pagedllm.beam_search import beam_search

        ids = [self.engine._tokenize(p)[1] for p in _as_prompt_list(prompts)]
        return beam_search(self.engine, ids, beam_width, max_tokens)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        wanted = set(ids)
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # a single list of token ids
    return items

