"""The grammar state of every structured request, and each step's token masks.

Engine-side, like the scheduler: one ``LLMatcher`` per sequence (n > 1: one per child), keyed by
request id, advanced by the tokens the request appends. Preemption (recompute or swap) does not
touch it: a preempted request keeps its output tokens, and its matcher stays where they left it;
should a request's outputs ever differ from what its matcher consumed, the matcher is rolled back
and fed the outputs again (``_sync``).

A step's masks are computed while the model runs: ``masks()`` starts llguidance on the step's
structured rows (one batched call that fills one bitmask per row on llguidance's own threads,
without the GIL) and returns at once; the runner waits for the result only just before sampling
(``TokenMasks.bits``). Rows of requests without a grammar pay nothing.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.logging_utils import init_logger
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured.grammar import GrammarCompiler
from pagedllm.structured.masks import TokenMasks, mask_words

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase

    from pagedllm.sched.output import SchedulerOutput

logger = init_logger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
        self.vocab_size = vocab_size
        self.matchers: dict[str, llguidance.LLMatcher] = {}
        self.consumed: dict[str, int] = {}  # output tokens each matcher has consumed
        self._ll_executor: llguidance.LLExecutor | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: TokenMasks | None = None
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.matchers)

    # -- requests -----------------------------------------------------------------------------
    def check(self, params: SamplingParams) -> None:
        """Compile (or find cached) the request's grammar. Raises GrammarError (a ValueError)."""
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def add(self, requests: list[Request]) -> None:
        for req in requests:
            so = req.params.structured_outputs
            if so is not None:
                self.matchers[req.request_id] = self.compiler.compile(so)
                self.consumed[req.request_id] = 0

    def release(self, request_ids: list[str]) -> None:
        if not self.matchers:
            return
        self._join()
        for rid in request_ids:
            self.matchers.pop(rid, None)
            self.consumed.pop(rid, None)

    # -- the step -------------------------------------------------------------------------------
    def masks(self, out: SchedulerOutput) -> TokenMasks | None:
        """Start computing the masks of the step's structured rows that sample; None if none."""
        if not self.matchers:
            return None
        rows = [i for i, s in enumerate(out.scheduled)
                if s.samples and s.request.request_id in self.matchers]
        if not rows:
            return None
        self._join()
        pairs = []
        for j, i in enumerate(rows):
            req = out.scheduled[i].request
            self._sync(req)
            pairs.append((self.matchers[req.request_id], j))
        bits = np.empty((len(rows), mask_words(self.vocab_size)), dtype=np.int32)
        if self._pool is None:
            import llguidance

            self._ll_executor = llguidance.LLExecutor()
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedllm-grammar")
        masks = TokenMasks(rows, bits, self._pool.submit(self._fill, pairs, bits))
        self._pending = masks
        return masks

    def _fill(self, pairs: list[tuple[llguidance.LLMatcher, int]], bits: np.ndarray) -> float:
        from llguidance.numpy import fill_next_token_bitmask_par

        t0 = time.perf_counter()
        assert self._ll_executor is not None
        fill_next_token_bitmask_par(self._ll_executor, pairs, bits)
        return time.perf_counter() - t0

    def _join(self) -> None:
        """Matchers are not touched while a mask computation may still read them."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.bits()

    def advance(self, out: SchedulerOutput) -> list[str]:
        """Feed each structured request the tokens it appended this step. Returns the requests
        whose grammar is complete (nothing but the end may follow): they stop here, as at a stop
        token (the token that completed the grammar is part of the output)."""
        if not self.matchers:
            return []
        self._join()
        ended = []
        for s in out.scheduled:
            req = s.request
            if req.request_id in self.matchers and not req.is_finished:
                if self._sync(req):
                    ended.append(req.request_id)
        return ended

    def _sync(self, req: Request) -> bool:
        """Bring the request's matcher to its output tokens; True if the grammar is complete
        (or the matcher failed: logged, and the request is stopped rather than left unconstrained)."""
        rid = req.request_id
        m = self.matchers[rid]
        out = req.output_token_ids
        done = self.consumed[rid]
        if done > len(out):  # outputs were rewritten: go back and feed them again
            m.rollback(done - len(out))
            done = len(out)
        if done < len(out):
            m.consume_tokens(out[done:])
            self.consumed[rid] = len(out)
        if m.is_error():
            logger.warning("request %s: its grammar rejected an output token (%s); stopping it",
                           rid, m.get_error()[:200])
            return True
        return m.is_stopped()

    def shutdown(self) -> None:
        self._join()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
