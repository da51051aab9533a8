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

Two implementations, the same messages: ``InProcessClient`` runs the core loop in a thread of
this process (tests, in-process serving), ``MPClient`` in its own process over ZMQ (``pagedllm
serve``), so the model's steps never hold the GIL of the process that serves HTTP. The front
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
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import CoreLoop, EngineCore, QueueTransport
from pagedllm.engine.input import InputProcessor, PromptType
from pagedllm.engine.messages import (
    Abort,
    Accepted,
    CoreDead,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FromCore,
    Ready,
    Rejected,
    Shutdown,
    ToCore,
    UtilityCall,
    UtilityResult,
)
from pagedllm.generation_config import GenerationDefaults, load_generation_defaults
from pagedllm.logging_utils import init_logger
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.stats import StepStats
from pagedllm.structured.grammar import GrammarCompiler
from pagedllm.tokenizer import eos_token_ids, get_tokenizer

if TYPE_CHECKING:
    import multiprocessing.process

    from transformers import PreTrainedTokenizerBase

    from pagedllm.args import EngineArgs
    from pagedllm.engine.core import LLMEngine

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
        self.tokenizer: PreTrainedTokenizerBase = get_tokenizer(config.tokenizer)
        self.generation_defaults: GenerationDefaults = load_generation_defaults(
            config.model.model, config.generation_config)
        eos = eos_token_ids(self.tokenizer,
                            config.model.eos_token_ids + self.generation_defaults.eos_token_ids)
        self.compiler = compiler or GrammarCompiler(self.tokenizer, config.model.vocab_size, eos)
        self.input = InputProcessor(config, self.tokenizer, eos)


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
        self.stats_listeners: list[Callable[[StepStats], None]] = []  # called with each step's
        self.dead: str | None = None  # why the core died
        self.num_aborted = 0  # requests aborted while live (client disconnects, shutdown)
        self._streams: dict[str, OutputStream] = {}
        self._prompts: dict[str, list[int]] = {}
        self._accepts: dict[str, asyncio.Future[None]] = {}
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._call_ids = itertools.count(1)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tokenizer_thread = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="pagedllm-tokenizer")

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

    # -- requests ---------------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptSource, params: SamplingParams,
                          stream: OutputStream, priority: int = 0) -> None:
        """Tokenize (on the tokenizer thread) and queue a request; returns once the core accepted
        it (its outputs then arrive on ``stream``). Raises the core's ``ValueError`` if it
        refused the request, ``EngineUnavailable`` if the core is not running."""
        self._check_running()
        assert self._loop is not None
        arrival = time.monotonic()
        ids = await self._loop.run_in_executor(self._tokenizer_thread, self._prompt_ids, prompt)
        self._check_running()
        if request_id in self._streams or request_id in self._accepts:
            raise ValueError(f"request_id {request_id!r} is already in use")
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._accepts[request_id] = accepted
        self._streams[request_id] = stream
        self._prompts[request_id] = ids
        self._send(EngineCoreRequest(request_id=request_id, prompt_token_ids=ids,
                                     sampling_params=params, arrival_time=arrival,
                                     priority=priority))
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
        return await self._loop.run_in_executor(self._tokenizer_thread, fn, self.frontend)

    def abort(self, request_id: str) -> None:
        """Abort a request (idempotent); the core frees its blocks."""
        self.abort_many([request_id])

    def abort_stream(self, stream: OutputStream) -> None:
        self.abort_many(list(stream.pending))
        stream.pending.clear()

    def abort_many(self, request_ids: list[str]) -> None:
        live = []
        for rid in request_ids:
            stream = self._forget(rid)
            if stream is None:
                continue
            live.append(rid)
            self.num_aborted += 1
            stream.queue.put_nowait(_Failed(rid, RequestAborted(f"request {rid} was aborted")))
        if live and self.dead is None:
            self._send(Abort(live))

    def fail_in_flight(self, error: EngineError) -> None:
        """End every request in flight with ``error``; the core frees their blocks (the drain
        deadline's last word)."""
        ids = list(self._streams)
        for rid in ids:
            stream = self._forget(rid)
            if stream is not None:
                stream.queue.put_nowait(_Failed(rid, error))
        if ids and self.dead is None:
            self._send(Abort(ids))

    def _forget(self, request_id: str) -> OutputStream | None:
        self._prompts.pop(request_id, None)
        fut = self._accepts.pop(request_id, None)
        if fut is not None and not fut.done():
            fut.cancel()
        return self._streams.pop(request_id, None)

    # -- utility calls ----------------------------------------------------------------------------
    async def utility(self, name: str, *args: Any) -> Any:
        """A named call on the core between steps (``core_proc.UTILITIES``)."""
        self._check_running()
        assert self._loop is not None
        call_id = next(self._call_ids)
        fut: asyncio.Future[Any] = self._loop.create_future()
        self._calls[call_id] = fut
        self._send(UtilityCall(call_id, name, list(args)))
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
    def _dispatch(self, msg: FromCore) -> None:
        if isinstance(msg, EngineCoreOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, Accepted):
            fut = self._accepts.pop(msg.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
        elif isinstance(msg, Rejected):
            fut = self._accepts.pop(msg.request_id, None)
            self._forget(msg.request_id)
            if fut is not None and not fut.done():
                fut.set_exception(EngineError(msg.message) if msg.internal else ValueError(msg.message))
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

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        if msg.stats is not None:
            self.stats = msg.stats
            if msg.step:
                for listener in self.stats_listeners:
                    listener(msg.stats)
        for out in msg.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted here meanwhile
            item: RequestOutput | _Failed
            if out.error is not None:
                kind = ServerShuttingDown if out.error == "shutdown" else EngineError
                item = _Failed(out.request_id, kind(out.error_detail))
            else:
                item = self._request_output(out)
            if out.finished:
                self._forget(out.request_id)
            stream.queue.put_nowait(item)

    def _request_output(self, out: EngineCoreOutput) -> RequestOutput:
        outs = [CompletionOutput(c.index, c.text, c.token_ids, c.cumulative_logprob, c.logprobs,
                                 c.finish_reason, c.stop_reason) for c in out.outputs]
        metrics = RequestMetrics(out.arrival_time, out.first_token_time, out.finished_time,
                                 out.num_preemptions, out.num_cached_tokens)
        return RequestOutput(out.request_id, None, self._prompts[out.request_id],
                             out.prompt_logprobs, outs, out.finished, metrics)

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


class InProcessClient(EngineClient):
    """The core loop in a thread of this process: the same messages, not encoded."""

    def __init__(self, engine: LLMEngine, batch_wait_ms: float = 0.0) -> None:
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms={batch_wait_ms} must be >= 0")
        super().__init__(FrontEnd(engine.config, engine.structured.compiler), engine.stats)
        self.engine = engine  # tests' introspection (call_sync) only
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._core_loop: CoreLoop | None = None
        self._transport: _TestableQueue | None = None
        self._thread: threading.Thread | None = None

    @property
    def num_steps(self) -> int:
        return self._core_loop.num_steps if self._core_loop is not None else 0

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._transport = _TestableQueue(self._deliver, self.engine)
        self._core_loop = CoreLoop(EngineCore(self.engine), self._transport, self.batch_wait_s)
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        assert self._core_loop is not None
        try:
            self._core_loop.run()
        except BaseException:  # noqa: BLE001 - CoreDead was sent and logged by the loop
            pass

    def _deliver(self, msg: FromCore) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._dispatch, msg)
            except RuntimeError:  # the loop closed meanwhile: nobody is listening
                pass

    def _send(self, msg: ToCore) -> None:
        assert self._transport is not None, "start() the client first"
        self._transport.inbox.put(msg)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    async def shutdown(self, timeout: float = 10.0) -> None:
        """End what is in flight (``ServerShuttingDown``) and stop the core thread."""
        if self._thread is None:
            return
        self._send(Shutdown())
        await asyncio.to_thread(self._thread.join, timeout)
        await asyncio.sleep(0)  # the core's last outputs, queued by call_soon_threadsafe
        self._thread = None
        self._fail_local(ServerShuttingDown("the server is shutting down"))
        self.engine.shutdown()  # stops tensor-parallel workers; a no-op in one process
        self._tokenizer_thread.shutdown(wait=False)

    def call_sync(self, fn: Callable[[LLMEngine], Any], timeout: float | None = 30.0) -> Any:
        """Tests only: run ``fn(engine)`` on the core thread between steps and return its result
        (do not call from the event loop). The server uses named ``utility`` calls."""
        assert self._transport is not None, "start() the client first"
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._transport.inbox.put(_TestCall(fn, fut))  # type: ignore[arg-type]
        return fut.result(timeout)


@dataclass
class _TestCall:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


class _TestableQueue(QueueTransport):
    """Runs ``_TestCall``s where it takes messages: on the core thread, between steps."""

    def __init__(self, deliver: Callable[[FromCore], None], engine: LLMEngine) -> None:
        super().__init__(deliver)
        self.engine = engine

    def recv(self, timeout_s: float | None) -> ToCore | None:
        while True:
            msg = super().recv(timeout_s)
            if not isinstance(msg, _TestCall):
                return msg
            try:
                msg.future.set_result(msg.fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                msg.future.set_exception(e)


WATCH_S = 0.1  # how often the front end looks whether the core process is alive


class MPClient(EngineClient):
    """The engine core in its own process (spawned: CUDA and torch threads do not survive a
    fork), over two ZMQ PUSH/PULL sockets on IPC paths in a private temporary directory."""

    def __init__(self, engine_args: EngineArgs, config: EngineConfig | None = None,
                 batch_wait_ms: float = 0.0) -> None:
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms={batch_wait_ms} must be >= 0")
        config = config or engine_args.create_engine_config()
        super().__init__(FrontEnd(config), StepStats())
        self.engine_args = engine_args
        self.batch_wait_ms = batch_wait_ms
        self.proc: multiprocessing.process.BaseProcess | None = None
        self._dir: str | None = None
        self._ctx: Any = None
        self._push: Any = None
        self._pull: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False

    async def start(self) -> None:
        """Start the core process and wait until its engine is built (weights loaded, KV pool
        allocated). Raises RuntimeError if it failed to start (the log says why)."""
        import multiprocessing

        import zmq
        import zmq.asyncio

        from pagedllm.engine.core_proc import run_core_process
        from pagedllm.engine.messages import encoder, from_core_decoder

        if self.proc is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._dir = tempfile.mkdtemp(prefix="pagedllm-core-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)  # never block the event loop on a send
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(out_addr)
        self._enc, self._dec = encoder(), from_core_decoder()
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_core_process, name="pagedllm-engine-core",
            args=(self.engine_args, in_addr, out_addr, self.batch_wait_ms, os.getpid()))
        self.proc.start()
        logger.info("engine core process started (pid %d)", self.proc.pid)
        while True:  # the engine's build has no fixed bound (weights, TP workers): wait for it
            if await self._pull.poll(int(WATCH_S * 1000)):
                msg = self._dec.decode(await self._pull.recv())
                if isinstance(msg, Ready):
                    self.stats = msg.stats
                    break
                if isinstance(msg, CoreDead):
                    await self._close_after_failed_start()
                    raise RuntimeError(f"the engine core failed to start: {msg.reason}")
            elif not self.proc.is_alive():
                why = _exit_cause(self.proc.exitcode)
                await self._close_after_failed_start()
                raise RuntimeError(f"the engine core process failed to start ({why}); the log "
                                   "above has the details")
        self._tasks = [asyncio.ensure_future(self._read()), asyncio.ensure_future(self._watch())]

    async def _close_after_failed_start(self) -> None:
        assert self.proc is not None
        await asyncio.to_thread(self.proc.join, 10)
        self._close()

    def _send(self, msg: ToCore) -> None:
        import zmq

        try:  # unlimited HWM: a send never blocks (a dead core's pipe only queues)
            self._push.send(self._enc.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as e:
            raise EngineUnavailable(f"could not send to the engine core: {e}") from e

    async def _read(self) -> None:
        while True:
            frame = await self._pull.recv(copy=False)
            self._dispatch(self._dec.decode(frame.buffer))

    async def _watch(self) -> None:
        """The core process's death, seen within ``WATCH_S``: health goes down, every stream
        ends with an error naming the cause."""
        assert self.proc is not None
        while self.proc.is_alive():
            await asyncio.sleep(WATCH_S)
        await asyncio.sleep(WATCH_S)  # its last messages (CoreDead) first, if it sent any
        if not self._stopping or self._streams:
            self._on_dead(f"the engine core process (pid {self.proc.pid}) "
                          f"{_exit_cause(self.proc.exitcode)}")

    @property
    def is_running(self) -> bool:
        return (self.proc is not None and self.proc.is_alive() and self.dead is None
                and not self._stopping)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to end what is in flight and exit; kill it after ``timeout``."""
        if self.proc is None or self._stopping:
            return
        self._stopping = True
        if self.proc.is_alive():
            try:
                self._send(Shutdown())
            except EngineUnavailable:
                pass
            await asyncio.to_thread(self.proc.join, timeout)
        if self.proc.is_alive():
            logger.warning("the engine core did not stop within %.0f s; killing it", timeout)
            self.proc.kill()
            await asyncio.to_thread(self.proc.join, 5)
        while self._pull is not None and await self._pull.poll(50):  # its last outputs
            self._dispatch(self._dec.decode(await self._pull.recv()))
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_local(ServerShuttingDown("the server is shutting down"))
        self._close()
        self._tokenizer_thread.shutdown(wait=False)

    def _close(self) -> None:
        for sock in (self._push, self._pull):
            if sock is not None:
                sock.close(0)
        self._push = self._pull = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def _exit_cause(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by {name}"
    return f"exited with code {code}"
