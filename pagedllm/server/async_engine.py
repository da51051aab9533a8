"""AsyncEngine: one engine thread drives continuous batching for every HTTP connection.

::

    event loop (uvicorn)                          engine thread (owns the LLMEngine)
    ───────────────────                           ──────────────────────────────────
    add_request ──▶ commands (queue.Queue) ──▶    add / abort / call
        ▲                                         engine.step()   (torch, off the event loop)
        └── OutputStream.queue (asyncio) ◀──────  loop.call_soon_threadsafe(put outputs)

Only the engine thread touches the ``LLMEngine`` (it is not thread-safe), so the event loop never
blocks on a model step and every connection shares one continuous batch. A request that goes bad
inside a step is ended by the engine alone (finish_reason "error"); a step that raises fails the
requests that were in flight (their streams get the error, their blocks are freed) and the loop
keeps serving; an unexpected error in the loop itself marks the engine dead (health turns 503)
and fails every waiting stream rather than leaving them hanging. The errors carry detail for the
server log; clients are told only the kind of failure (``serving.engine_failure``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedllm._malloc import IdleRelease
from pagedllm.engine import LLMEngine, PromptType
from pagedllm.logging_utils import init_logger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.metrics import ServerMetrics

logger = init_logger(__name__)


class EngineError(RuntimeError):
    """The engine could not finish a request (a failed step, shutdown, a dead engine loop)."""


class EngineUnavailable(EngineError):
    """The engine loop is not running (stopped, or dead after a fatal failure)."""


class RequestAborted(EngineError):
    """Aborted by the server (its client went away)."""


class ServerShuttingDown(RequestAborted):
    """The server stopped (or its drain deadline passed) before the request finished."""


# A prompt, or a function run on the engine thread that makes one (tokenizing there keeps the
# tokenizer single-threaded and the event loop free).
PromptSource = PromptType | Callable[[LLMEngine], PromptType]


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


@dataclass
class _Add:
    request_id: str
    prompt: PromptSource
    params: SamplingParams
    priority: int
    stream: OutputStream
    accepted: asyncio.Future[None]
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: concurrent.futures.Future[Any]


class _Stop:
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None,
                 batch_wait_ms: float = 0.0) -> None:
        if batch_wait_ms < 0:
            raise ValueError(f"batch_wait_ms={batch_wait_ms} must be >= 0")
        self.engine = engine
        self.metrics = metrics
        self.batch_wait_s = batch_wait_ms / 1000.0
        self._commands: queue.Queue[_Add | _Abort | _Call | _Stop] = queue.Queue()
        self._streams: dict[str, OutputStream] = {}  # engine-thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        self.num_steps = 0
        self.num_aborted = 0  # requests aborted while live (client disconnects, shutdown)
        self.idle_release = IdleRelease()  # engine-thread only

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will read the outputs."""
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
        self._thread.start()

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Abort what is in flight and stop the engine thread."""
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, timeout)
        self._thread = None
        self.engine.shutdown()  # stops tensor-parallel workers; a no-op in one process

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    # -- API for the event loop ----------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: PromptSource, params: SamplingParams,
                          stream: OutputStream, priority: int = 0) -> None:
        """Queue a request; returns once the engine accepted it (its outputs then arrive on
        ``stream``). Raises the engine's ``ValueError`` if it refused the request."""
        if not self.is_running:
            raise EngineUnavailable(f"the engine is not running ({self.dead!r})" if self.dead else
                                    "the engine is not running (stopped)")
        assert self._loop is not None
        accepted: asyncio.Future[None] = self._loop.create_future()
        self._commands.put(_Add(request_id, prompt, params, priority, stream, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the client went away while we waited: nothing may leak
            raise
        stream.pending.add(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe, idempotent); its blocks return to the pool."""
        self._commands.put(_Abort(request_id))

    def abort_stream(self, stream: OutputStream) -> None:
        for rid in list(stream.pending):
            self.abort(rid)
        stream.pending.clear()

    def fail_in_flight(self, error: EngineError) -> None:
        """End every request in flight with ``error``; their blocks are freed (thread-safe; the
        drain deadline's last word)."""
        self._commands.put(_Call(lambda _: self._fail_all(error), concurrent.futures.Future()))

    def call_soon(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future[Any]:
        """Queue ``fn(engine)`` to run on the engine thread between steps; its result's future
        (``asyncio.wrap_future`` awaits it from the event loop)."""
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(_Call(fn, fut))
        return fut

    def call_sync(self, fn: Callable[[LLMEngine], Any], timeout: float | None = 30.0) -> Any:
        """Run ``fn(engine)`` on the engine thread between steps and return its result (for
        introspection and tests; do not call from the event loop)."""
        return self.call_soon(fn).result(timeout)

    # -- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                if not self._drain(block=not self.engine.has_unfinished_requests()):
                    break
                if not self.engine.has_unfinished_requests():
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001 - a dead loop must not leave streams hanging
            logger.exception("engine loop died")
            self.dead = e
            self._fail_all(EngineError(f"the engine loop died: {type(e).__name__}: {e}"))
            raise
        finally:
            self._fail_all(ServerShuttingDown("the server is shutting down"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands (waiting for one if ``block``); False once asked to stop. A wait
        that runs out gives the memory the last work freed back (``_malloc.IdleRelease``)."""
        new_arrivals = False
        try:
            cmd = self._commands.get(timeout=self.idle_release.wait_s) if block else \
                self._commands.get_nowait()
        except queue.Empty:
            if block and self.idle_release.idle():
                logger.debug("idle for %.1f s: freed memory given back in %.0f ms",
                             self.idle_release.after_s, 1e3 * self.idle_release.last_s)
            return True
        self.idle_release.worked()
        try:
            while True:
                if isinstance(cmd, _Stop):
                    return False
                new_arrivals |= self._apply(cmd)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            pass
        if new_arrivals and self.batch_wait_s > 0:
            self._wait_for_more_arrivals()
        return True

    def _wait_for_more_arrivals(self) -> None:
        """The batching window: while the batch is small, give late arrivals a moment to join."""
        deadline = time.monotonic() + self.batch_wait_s
        limit = self.engine.config.scheduler.max_num_seqs
        while self.engine.scheduler.num_running + self.engine.scheduler.num_waiting < limit:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                cmd = self._commands.get(timeout=left)
            except queue.Empty:
                return
            if isinstance(cmd, _Stop):
                self._commands.put(cmd)  # seen again by the next _drain
                return
            self._apply(cmd)

    def _apply(self, cmd: _Add | _Abort | _Call) -> bool:
        if isinstance(cmd, _Add):
            return self._add(cmd)
        if isinstance(cmd, _Abort):
            self._abort(cmd.request_id)
        else:
            try:
                cmd.future.set_result(cmd.fn(self.engine))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(e)
        return False

    def _add(self, cmd: _Add) -> bool:
        error: BaseException | None = None
        if cmd.request_id in self._streams:
            error = ValueError(f"request_id {cmd.request_id!r} is already in use")
        else:
            try:
                prompt = cmd.prompt(self.engine) if callable(cmd.prompt) else cmd.prompt
                self.engine.add_request(cmd.request_id, prompt, cmd.params, priority=cmd.priority,
                                        arrival_time=cmd.arrival)
            except Exception as e:  # noqa: BLE001 - ValueError = bad request, else a server error
                error = e
        if error is None:
            self._streams[cmd.request_id] = cmd.stream
        self._resolve(cmd.accepted, error)
        return error is None

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.engine.abort_request(request_id)
        self.num_aborted += 1
        self._deliver([(stream, _Failed(request_id, RequestAborted(f"request {request_id} was aborted")))])

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
            logger.exception("engine step failed; failing the %d requests in flight: %s",
                             len(self._streams), ", ".join(sorted(self._streams)))
            self._fail_all(EngineError(f"the engine step failed: {type(e).__name__}: {e}"))
            if getattr(e, "fatal", False):  # e.g. a dead tensor-parallel worker: /health -> 503
                self.dead = e
            return
        self.num_steps += 1
        self.idle_release.worked()
        if self.metrics is not None:
            self.metrics.on_step(self.engine.stats)
        items: list[tuple[OutputStream, RequestOutput | _Failed]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            items.append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        self._deliver(items)

    def _fail_all(self, error: BaseException) -> None:
        items: list[tuple[OutputStream, RequestOutput | _Failed]] = []
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001 - keep freeing the others
                logger.exception("abort of %s failed", rid)
            items.append((stream, _Failed(rid, error)))
        self._streams.clear()
        self._deliver(items)
        # Requests the engine still holds without a stream (should not happen) are freed too.
        for rid in self.engine.request_ids():
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort of %s failed", rid)

    def _deliver(self, items: list[tuple[OutputStream, RequestOutput | _Failed]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            try:
                self._loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop closed meanwhile: nobody is listening
                pass

    def _resolve(self, fut: asyncio.Future[None], error: BaseException | None) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(_set_future, fut, error)
        except RuntimeError:
            pass


def _put_all(items: list[tuple[OutputStream, RequestOutput | _Failed]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _set_future(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)
