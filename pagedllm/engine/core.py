"""LLMEngine: the synchronous front end. Prompts in, ``RequestOutput``s out: input processing
(tokenize, check) -> ``EngineCore`` (in this process, driven by the same messages as the engine-core
process) -> ``OutputProcessor`` (detokenize, stop strings, output kinds). ``step()`` = the core's
step, then its outputs made into ``RequestOutput``s; a stop string found there is sent back to the
core as an abort, before the next step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any

from pagedllm.args import EngineArgs
from pagedllm.config import EngineConfig
from pagedllm.engine.beam import MAX_BEAM_WIDTH, BeamSearchDriver
from pagedllm.engine.drive import Submission, drive
from pagedllm.engine.engine_core import EngineCore
from pagedllm.engine.input import PromptType, load_prompts
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.engine.output import OutputProcessor
from pagedllm.executor import Executor
from pagedllm.generation_config import GenerationDefaults
from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.plan import KVPoolPlan
from pagedllm.kv.publisher import ZmqEventPublisher
from pagedllm.logging_utils import init_logger
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.runner.model_runner import ModelRunner
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler
from pagedllm.sched.memory import KVMemoryPolicy
from pagedllm.sched.stats import StepStats
from pagedllm.spec_decode.decoder import SpecDecoder
from pagedllm.structured.manager import StructuredOutputManager

logger = init_logger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, scheduler_cls: type[Scheduler] = Scheduler) -> None:
        """``scheduler_cls`` swaps the batching policy (the benchmarks' contiguous baseline)."""
        self.config = config
        self.core = EngineCore(config, scheduler_cls)
        self.tokenizer = self.core.tokenizer  # one process: the front end shares the core's
        self.input = self.core.input
        self.output = OutputProcessor(self.tokenizer)
        # beam search above the core: rounds of 1-token requests (``pagedllm.engine.beam``)
        self.beams = BeamSearchDriver(self.core.add_request, self.core.abort_requests)

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

    # -- the core's parts (introspection, tests and benchmarks) -----------------------------------
    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def kv(self) -> KVCacheManager:
        return self.core.kv

    @property
    def memory(self) -> KVMemoryPolicy:
        return self.core.memory

    @property
    def executor(self) -> Executor:
        return self.core.executor

    @property
    def runner(self) -> ModelRunner:
        """Rank 0's ModelRunner (introspection: its KV tensors change only through a step)."""
        return self.core.executor.driver

    @property
    def structured(self) -> StructuredOutputManager:
        return self.core.structured

    @property
    def spec(self) -> SpecDecoder | None:
        return self.core.spec

    @property
    def stats(self) -> StepStats:
        """The last step's record (with the front end's request events), or a snapshot after
        a change outside a step."""
        return self.core.stats

    @property
    def kv_plan(self) -> KVPoolPlan:
        return self.core.kv_plan

    @property
    def kv_publisher(self) -> ZmqEventPublisher | None:
        return self.core.kv_publisher

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.core.eos_token_ids

    @property
    def generation_defaults(self) -> GenerationDefaults:
        return self.core.generation_defaults

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
        params = (params or SamplingParams()).clone()  # later edits by the caller change nothing
        self._check_new_id(request_id)
        text, ids = self.input.tokenize(prompt)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.core.add_request(EngineCoreRequest(
            request_id=request_id, prompt_token_ids=ids, sampling_params=params,
            arrival_time=arrival, priority=priority), lora_request)
        self.output.add(request_id, text, ids, params, arrival)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load and check an adapter (every rank); ValueError (``LoRAError``) naming it and the
        reason, or that LoRA is off. The engine is unchanged by a failure."""
        self.core.add_lora(lora_request)

    def add_beam_search(self, request_id: str, prompt: PromptType, beam_width: int,
                        max_tokens: int, arrival_time: float | None = None) -> None:
        """Queue a beam search, which this front end runs in rounds of ordinary requests
        (``pagedllm.engine.beam``); its one output, when it finishes, holds ``beam_width``
        sequences best first, ``cumulative_logprob`` = the beam's score."""
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
        arrival = time.monotonic() if arrival_time is None else arrival_time
        self.beams.add(request_id, ids, beam_width, max_tokens, arrival)
        self.output.add_beam_search(request_id, ids, arrival)

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.output.groups:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request; its blocks return to the pool. Returns False if it is unknown."""
        if not self.output.remove(request_id):
            return False
        if not self.beams.abort(request_id):
            self.core.abort_requests([request_id])
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.output.groups)

    def get_num_unfinished_requests(self) -> int:
        return len(self.output)

    def request_ids(self) -> list[str]:
        """The unfinished requests, generate and beam search."""
        return list(self.output.groups)

    # -- the hot loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outs = self.core.step()
        processed = self.output.process(outs)
        if processed.aborts:  # stop strings: the core forgets them before its next step
            self.core.abort_requests(processed.aborts, outs.stats)
        for rid, beams, why in self.beams.process(outs.outputs):  # and the next beam rounds
            if (done := self.output.finish_beam_search(rid, beams, why)) is not None:
                processed.outputs.append(done)
        return processed.outputs

    # -- introspection ----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop tensor-parallel workers (nothing to do in one process). Garbage collection and
        interpreter exit do it too; the engine is unusable afterwards."""
        self.core.shutdown()

    def check_integrity(self) -> None:
        self.core.check_integrity()
        # (the core may also hold requests of another front end: a client driving it)
        lost = set(self.output.groups) - set(self.core.request_ids()) - set(self.beams.searches)
        assert not lost, f"requests live in the front end but not in the core: {sorted(lost)}"

    @property
    def num_preemptions(self) -> int:
        return self.core.scheduler.num_preemptions

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
        drive(self, [Submission(f"__preheat__/{i}", partial(self.add_request,
                                                            prompt={"prompt_token_ids": tok},
                                                            params=sp))
                     for i, tok in enumerate(ids)])
        pinned = sum(self.kv.pin(tok) for tok in ids)
        self.kv.stats.reset()
        logger.info("preheated %d prompts: %d KV blocks pinned", len(ids), pinned)
        return pinned

    def defragment(self) -> int:
        """Compact now: live blocks move to the lowest ids. Returns the number of blocks moved."""
        return self.core.defragment()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block (vLLM's ``reset_prefix_cache``); refused (False)
        while a request holds blocks."""
        return self.core.reset_prefix_cache()

    def prefix_cache_stats(self) -> dict[str, float]:
        """Prompt tokens looked up at admission (``queries``), found cached (``hits``)."""
        return self.core.prefix_cache_stats()

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (``--generation-config``)."""
        return self.core.generation_defaults.sampling_params()

    def current_stats(self) -> StepStats:
        """A record of the engine as it is now, outside any step (``self.stats`` is the last
        step's)."""
        return self.core.current_stats()

    def kv_stats(self) -> dict[str, Any]:
        """KV memory now: blocks by state, utilization, prefix cache, preemptions, swaps."""
        return self.core.kv_stats()

