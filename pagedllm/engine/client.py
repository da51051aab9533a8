"""EngineClient: the one async interface to an engine core, for the server (and tests).

::

    event loop (front end)                             engine core (core_proc.CoreLoop)
    ──────────────────────                             ────────────────────────────────
    add_request: prompt ─▶ token ids (tokenizer thread)
                 ─▶ EngineCoreRequest ───────────────▶ add ─▶ Accepted / Rejected
    OutputStream ◀─ RequestOutput ◀─ EngineCoreOutputs ◀ step
    abort / abort_stream ─▶ Abort ───────────────────▶ abort (blocks freed)
    utility("kv_stats") ─▶ UtilityCall ──────────────▶ a named call ─▶ UtilityResult
    stats ◀─ each EngineCoreOutputs' StepStats (stats_listeners: the Prometheus counters)

Implementations, the same messages: ``InProcessClient`` runs the core loop in a thread of
this process (tests, in-process serving), ``MPClient`` in its own process over ZMQ (``pagedllm
serve``), so the model's steps never hold the GIL of the process that serves HTTP;
``router.client.DPClient`` owns N cores (data-parallel replicas) and routes each request to one. The front
end tokenizes (one tokenizer thread: a tokenizer is not shared between threads) and knows the
model through ``FrontEnd``; it never holds a live ``Request``, scheduler or KV manager.

Failure, as a stream sees it: a request the core ended without a result raises ``EngineError``
(a failed step) or ``ServerShuttingDown``; a dead core (its process gone, or ``CoreDead``) fails
every stream and pending call with ``EngineError`` naming the cause and turns ``is_running``
False (``/health`` 503); an abort ends the stream with ``RequestAborted``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.engine.activity import Activity
from pagedllm.engine.input import InputProcessor, PromptType
from pagedllm.engine.messages import (
    Abort,
    Accepted,
    CoreDead,
    EngineCoreOutputs,
    EngineCoreRequest,
    FromCore,
    Ready,
    Rejected,
    ToCore,
    UtilityCall,
    UtilityResult,
)
from pagedllm.engine.output import OutputProcessor
from pagedllm.generation_config import GenerationDefaults, load_generation_defaults
from pagedllm.logging_utils import init_logger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.stats import StepStats
from pagedllm.structured.grammar import GrammarCompiler
from pagedllm.tokenizer import eos_token_ids, get_tokenizer

if TYPE_CHECKING:

    from transformers import PreTrainedTokenizerBase


logger = init_logger(__name__)


class EngineError(RuntimeError):
    """The engine could not finish a request (a failed step, shutdown, a dead engine core)."""


class EngineUnavailable(EngineError):
    """The engine core is not running (stopped, or dead after a fatal failure)."""


class RequestAborted(EngineError):
    """Aborted by the front end (its client went away)."""


class ServerShuttingDown(RequestAborted):
    """The server stopped (or its drain deadline passed) before the request finished."""


class FrontEnd:
    """What the front end knows of the model without the engine: the configs, its own tokenizer,
    the generation_config defaults, a grammar compiler (to refuse a bad grammar before it
    reaches the core) and the prompt checks of ``InputProcessor``."""

    def __init__(self, config: EngineConfig, compiler: GrammarCompiler | None = None) -> None:
        self.config = config
        self.tokenizer: PreTrainedTokenizerBase = get_tokenizer(config.tokenizer, config.model.trust_remote_code)
        self.generation_defaults: GenerationDefaults = load_generation_defaults(
            config.model.model, config.generation_config)
        eos = eos_token_ids(self.tokenizer,
                            config.model.eos_token_ids + self.generation_defaults.eos_token_ids)
        self.compiler = compiler or GrammarCompiler(self.tokenizer, config.model.vocab_size, eos)
        self.input = InputProcessor(config, self.tokenizer, eos)
        # detokenization runs on the event loop; the tokenizer above belongs to its thread
        self.output = OutputProcessor(get_tokenizer(config.tokenizer, config.model.trust_remote_code))


# A prompt, or a function run on the front end's tokenizer thread that makes one.
PromptSource = PromptType | Callable[[FrontEnd], PromptType]


@dataclass
class _Failed:
    request_id: str
    error: BaseException


class OutputStream:
    """The outputs of one HTTP request's engine requests (one per prompt), in arrival order."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[RequestOutput | _Failed] = asyncio.Queue()
        self.pending: set[str] = set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while self.pending:
            item = await self.queue.get()
            if isinstance(item, _Failed):
                self.pending.discard(item.request_id)
                raise item.error
            if item.finished:
                self.pending.discard(item.request_id)
            yield item


class EngineClient:
    """The front end's side of an engine core; subclasses move the messages. Every method runs
    on the event loop that called ``start``."""

    def __init__(self, frontend: FrontEnd, stats: StepStats) -> None:
        self.frontend = frontend
        self.config = frontend.config
        self.stats = stats  # the core's latest record (each step's, or a snapshot after aborts)
        # called with each step's record and the index of the engine (replica) that ran it
        self.stats_listeners: list[Callable[[StepStats, int], None]] = []
        self.dead: str | None = None  # why the core died
        self.num_aborted = 0  # requests aborted while live (client disconnects, shutdown)
        self._streams: dict[str, OutputStream] = {}
        self.output = frontend.output  # detokenization and stop strings, here not in the core
        self._accepts: dict[str, asyncio.Future[None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagedllm-tokenizer")
        self.activity = Activity()  # the front end's own work: HTTP requests, tokenizer jobs

    # -- for subclasses ---------------------------------------------------------------------------
    def _send(self, msg: ToCore) -> None:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def shutdown(self, timeout: float = 10.0) -> None:
        raise NotImplementedError

    @property
    def degraded(self) -> str | None:
        """Why the client serves with less than it was started with (a replica down), or None."""
        return None

    def engine_stats(self) -> list[tuple[int, StepStats]]:
        """The latest record of each engine core serving (its replica index, the record)."""
        return [(0, self.stats)]

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptSource, params: SamplingParams,
                          stream: OutputStream, priority: int = 0,
                          lora_name: str | None = None) -> None:
        """Tokenize (on the tokenizer thread) and queue a request, run by the LoRA adapter
        ``lora_name`` (one the core serves: utility ``add_lora``) or the base model; returns once
        the core accepted it (its outputs then arrive on ``stream``). Raises the core's
        ``ValueError`` if it refused the request, ``EngineUnavailable`` if the core is not running."""
        self._check_running()
        assert self._loop is not None
        arrival = time.monotonic()
        with self.activity():
            ids = await self._loop.run_in_executor(self._tokenizer_thread, self._prompt_ids,
                                                   prompt)
        self._check_running()
        if request_id in self._streams or request_id in self._accepts:
            raise ValueError(f"request_id {request_id!r} is already in use")
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._accepts[request_id] = accepted
        self._streams[request_id] = stream
        self.output.add(request_id, None, ids, params, arrival, lora_name)
        self._send(EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                     sampling_params=params, arrival_time=arrival,
                                     priority=priority, lora_id=lora_name))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the client went away while we waited: nothing may leak
            raise
        except BaseException:
            self._forget(request_id)
            raise
        stream.pending.add(request_id)

    def _prompt_ids(self, prompt: PromptSource) -> list[int]:
        p = prompt(self.frontend) if callable(prompt) else prompt
        return self.frontend.input.tokenize(p)[1]

    async def run_on_tokenizer_thread(self, fn: Callable[[FrontEnd], Any]) -> Any:
        """``fn(frontend)`` on the tokenizer thread (``/tokenize``, ``/detokenize``)."""
        assert self._loop is not None
        with self.activity():
            return await self._loop.run_in_executor(self._tokenizer_thread, fn, self.frontend)

    def is_idle(self) -> bool:
        """No request in flight or waiting to be accepted."""
        return not self._streams and not self._accepts

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent); the core frees its blocks."""
        self.abort_many([request_id])

    def abort_stream(self, stream: OutputStream) -> None:
        self.abort_many(list(stream.pending))
        stream.pending.clear()

    def abort_many(self, request_ids: list[str]) -> None:
        live = [rid for rid in dict.fromkeys(request_ids) if rid in self._streams]
        try:
            if live and self.dead is None:  # sent first: a router still knows where they run
                self._send(Abort(live))
        finally:
            for rid in live:
                stream = self._forget(rid)
                assert stream is not None
                self.num_aborted += 1
                stream.queue.put_nowait(_Failed(rid, RequestAborted(f"request {rid} was aborted")))

    def fail_in_flight(self, error: EngineError) -> None:
        """End every request in flight with ``error``; the core frees their blocks (the drain
        deadline's last word)."""
        ids = list(self._streams)
        try:
            if ids and self.dead is None:
                self._send(Abort(ids))
        finally:
            for rid in ids:
                stream = self._forget(rid)
                if stream is not None:
                    stream.queue.put_nowait(_Failed(rid, error))

    def _fail_request(self, request_id: str, error: BaseException) -> None:
        """End one request in flight with ``error`` (nothing is sent to the core)."""
        stream = self._forget(request_id)
        if stream is not None:
            stream.queue.put_nowait(_Failed(request_id, error))

    def _forget(self, request_id: str) -> OutputStream | None:
        self.output.remove(request_id)
        fut = self._accepts.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()
        return self._streams.pop(request_id, None)

    # -- utility calls ----------------------------------------------------------------------------
    async def utility(self, name: str, *args: Any) -> Any:
        """A named call on the core between steps (``core_proc.UTILITIES``)."""
        return await self._call(name, list(args), self._send)

    async def _call(self, name: str, args: list[Any], send: Callable[[ToCore], None]) -> Any:
        """A named call sent with ``send``; its result (or error) comes back by call id."""
        self._check_running()
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = fut
        send(UtilityCall(call_id, name, args))
        try:
            return await fut
        finally:
            self._calls.pop(call_id, None)

    async def kv_stats(self) -> dict[str, Any]:
        return await self.utility("kv_stats")  # type: ignore[no-any-return]

    async def kv_snapshot(self, show_text: bool = False) -> dict[str, Any]:
        """The KV block map and the requests holding it (``engine.snapshot.kv_snapshot``)."""
        return await self.utility("kv_snapshot", show_text)  # type: ignore[no-any-return]

    # -- messages from the core (on the event loop) ------------------------------------------------
    def _dispatch(self, msg: FromCore, source: int = 0) -> None:
        """One message from engine core ``source`` (the replica's index; 0 for one core)."""
        if isinstance(msg, EngineCoreOutputs):
            self._on_outputs(msg, source)
        elif isinstance(msg, Accepted):
            fut = self._accepts.pop(msg.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(msg, Rejected):
            fut = self._accepts.pop(msg.request_id, None)
            error = EngineError(msg.message) if msg.internal else ValueError(msg.message)
            stream = self._forget(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_exception(error)
            elif stream is not None:  # accepted before, refused where a router sent it again
                stream.queue.put_nowait(_Failed(msg.request_id, error))
        elif isinstance(msg, UtilityResult):
            call = self._calls.pop(msg.call_id, None)
            if call is None or call.done():
                return
            if msg.error is None:
                call.set_result(msg.result)
            else:
                kind = ValueError if msg.error_type == "ValueError" else RuntimeError
                call.set_exception(kind(msg.error))
        elif isinstance(msg, CoreDead):
            self._on_dead(msg.reason)
        elif isinstance(msg, Ready):
            pass

    def _on_outputs(self, msg: EngineCoreOutputs, source: int = 0) -> None:
        for out in msg.outputs:  # requests the core ended without a result
            if out.error is not None:
                stream = self._forget(out.request_id)
                if stream is not None:
                    kind = ServerShuttingDown if out.error == "shutdown" else EngineError
                    stream.queue.put_nowait(_Failed(out.request_id, kind(out.error_detail)))
        done = self.output.process(msg)  # adds the request events to msg.stats
        if done.aborts and self.dead is None:  # stop strings found here: the core forgets them
            self._send(Abort(done.aborts))
        for ro in done.outputs:
            stream = self._streams.get(ro.request_id)
            if stream is None:
                continue  # aborted here meanwhile
            if ro.finished:
                self._forget(ro.request_id)
            stream.queue.put_nowait(ro)
            self._streamed(ro.request_id)
        if msg.stats is not None:
            self._record_stats(msg.stats, msg.step, source)

    def _streamed(self, request_id: str) -> None:
        """An output of the request reached its stream (a router may no longer retry it)."""

    def _record_stats(self, stats: StepStats, step: bool, source: int) -> None:
        self.stats = stats
        if step:
            for listener in self.stats_listeners:
                listener(stats, source)

    def _on_dead(self, reason: str) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        logger.error("the engine core died: %s; failing the %d requests in flight", reason,
                     len(self._streams))
        self._fail_local(EngineError(f"the engine core died: {reason}"))

    def _fail_local(self, error: EngineError) -> None:
        """Every stream, pending admission and call ends with ``error`` (nothing is sent)."""
        for rid in list(self._streams):
            stream = self._forget(rid)
            if stream is not None:
                stream.queue.put_nowait(_Failed(rid, error))
        for fut in [*self._accepts.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(error)
        self._accepts.clear()
        self._calls.clear()

    def _check_running(self) -> None:
        if not self.is_running:
            raise EngineUnavailable(f"the engine core is not running ({self.dead})" if self.dead
                                    else "the engine core is not running (stopped)")
