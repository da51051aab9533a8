"""The engine core behind a message boundary, and its busy loop (in a thread, or in its own
process for ``pagedllm serve``).

::

    front end ── ToCore messages ──▶ CoreLoop: drain inputs ─▶ (batch window) ─▶ step ─┐
        ▲                                 ▲                                              │
        └──────── FromCore messages ──────┴──────────── EngineCoreOutputs ◀──────────────┘

``CoreService`` turns messages into ``EngineCore`` calls (token ids in, token ids out: the front
end detokenizes); ``CoreLoop`` is the loop over a ``Transport`` (a queue pair in one
process, two ZMQ PUSH/PULL sockets between processes; ``run_core_process`` is the process's
entry point). Only the loop's thread touches the engine. Tensor-parallel workers are started by
the engine's executor, so they are children of the core.

A request is ended by the core alone: finished by a step, refused at admission (``Rejected``),
aborted by the front end (``Abort``; a stop string found by a front end arrives as one), failed
with its step (``error="failed"``) or by the core stopping (``error="shutdown"``). A step that
raises fails the requests in flight and the loop keeps going; a fatal error (a lost TP rank) or
a broken loop sends ``CoreDead`` and ends the loop.

``serve_core`` builds an engine and runs the loop over any transport: the spawned process
(``run_core_process``, ZMQ) and a data-parallel replica's Ray actor (``router.ray_link``) both
run it, with the ``CoreOptions`` their front end chose.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm._malloc import IdleRelease
from pagedllm.engine.heap import freeze_startup_heap
from pagedllm.engine.messages import (
    Abort,
    Accepted,
    CoreDead,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FromCore,
    Rejected,
    Shutdown,
    ToCore,
    UtilityCall,
    UtilityResult,
)
from pagedllm.engine.snapshot import kv_snapshot
from pagedllm.engine.step_threads import StepThreads
from pagedllm.kv.events import KVEventBatch
from pagedllm.logging_utils import init_logger

if TYPE_CHECKING:
    from pagedllm.args import EngineArgs
    from pagedllm.engine.engine_core import EngineCore

logger = init_logger(__name__)

PARENT_CHECK_S = 1.0  # an idle core looks this often whether its front end still exists
# After an idle spell, requests arriving less than BURST_GAP_MS apart join the core's first step
# (the server's ``--burst-gap-ms``), for at most BURST_MAX_S. Off by default: a 2 ms gap cost 6 %
# of output tok/s at 128 at once (docs/performance/serving.md)
BURST_GAP_MS = 0.0
BURST_MAX_S = 0.05


@dataclass(frozen=True)
class CoreOptions:
    """How a front end asks its engine core to run (plain data: it crosses to a spawned process
    or a Ray actor). ``kv_events``: each step's KV cache events (``kv.events.KVEventBatch``,
    stamped with ``data_parallel_rank``) travel with the step's outputs, for a router that
    mirrors the replica's prefix cache; ``num_threads``: torch's threads in the core (None:
    torch's default)."""

    batch_wait_ms: float = 0.0
    num_threads: int | None = None
    kv_events: bool = False
    prefill_threads: int | None = None  # threads for steps of many tokens (``StepThreads``)
    burst_gap_ms: float = BURST_GAP_MS
    data_parallel_rank: int | None = None


def _integrity(core: EngineCore) -> list[int]:
    """Checks the KV invariants (raises if broken); [free blocks, total blocks]."""
    core.check_integrity()
    return [core.kv.num_free_blocks, core.kv.num_blocks]


# The named calls a front end may make (no closures cross the boundary). Each takes the core
# and plain-data arguments and returns plain data.
UTILITIES: dict[str, Callable[..., Any]] = {
    "kv_stats": lambda c: c.kv_stats(),
    "kv_snapshot": kv_snapshot,
    "prefix_cache_stats": lambda c: c.prefix_cache_stats(),
    "defragment": lambda c: c.defragment(),
    "num_unfinished_requests": lambda c: len(c.request_ids()),
    "check_integrity": _integrity,
    "add_lora": lambda c, name, lora_int_id, path: c.register_lora(name, lora_int_id, path),
    "remove_lora": lambda c, name: c.unregister_lora(name),
}


class CoreService:
    """An ``EngineCore`` driven by messages. Not thread-safe: one loop owns it. With
    ``kv_events`` each step's outputs carry the KV event batches of the KV manager's bus."""

    def __init__(self, core: EngineCore, kv_events: bool = False,
                 data_parallel_rank: int | None = None) -> None:
        self.core = core
        self._batches: list[KVEventBatch] | None = None
        if kv_events:
            self._batches = []
            core.kv.events.data_parallel_rank = data_parallel_rank
            core.kv.events.subscribe_batches(self._batches.append)

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def add(self, req: EngineCoreRequest) -> Accepted | Rejected:
        if req.kv_transfer_params is not None:
            return Rejected(req.request_id, "kv_transfer_params are not supported yet")
        try:
            self.core.add_request(req)
        except ValueError as e:
            return Rejected(req.request_id, str(e))
        except Exception as e:  # noqa: BLE001 - the request fails, the core keeps serving
            logger.exception("add_request %s failed", req.request_id)
            return Rejected(req.request_id, f"{type(e).__name__}: {e}", internal=True)
        return Accepted(req.request_id)

    def abort(self, request_ids: list[str]) -> EngineCoreOutputs | None:
        """Abort requests or single sequences (idempotent); a stats snapshot if anything was
        aborted."""
        if not self.core.abort_requests(request_ids):
            return None
        return EngineCoreOutputs(stats=self.core.stats, step=False)

    def utility(self, call: UtilityCall) -> UtilityResult:
        fn = UTILITIES.get(call.name)
        if fn is None:
            return UtilityResult(call.call_id, error=f"unknown utility call {call.name!r}; "
                                 f"choose one of {', '.join(UTILITIES)}", error_type="ValueError")
        try:
            return UtilityResult(call.call_id, result=fn(self.core, *call.args))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            if isinstance(e, ValueError):  # a refusal (a bad adapter): its message as it is
                return UtilityResult(call.call_id, error=str(e), error_type="ValueError")
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}",
                                 error_type=type(e).__name__)

    def step(self) -> EngineCoreOutputs:
        """One engine step. A step that raises fails every request in flight (their blocks are
        freed) unless the error is fatal, which is raised."""
        try:
            out = self.core.step()
        except Exception as e:
            if getattr(e, "fatal", False):
                raise
            logger.exception("engine step failed; failing the %d requests in flight: %s",
                             len(self.core.request_ids()), ", ".join(sorted(self.core.request_ids())))
            return self.fail_all("failed", f"the engine step failed: {type(e).__name__}: {e}")
        if self._batches:  # the step's KV events go with its outputs, in order
            out.kv_events, self._batches[:] = list(self._batches), []
        return out

    def fail_all(self, error: str, detail: str) -> EngineCoreOutputs:
        """End every request with ``error``; every block goes back to the pool."""
        ids = sorted(self.core.request_ids())
        msgs = [EngineCoreOutput(request_id=rid, error=error, error_detail=detail) for rid in ids]
        for rid in ids:
            try:
                self.core.abort_requests([rid])
            except Exception:  # noqa: BLE001 - keep freeing the others
                logger.exception("abort of %s failed", rid)
        return EngineCoreOutputs(outputs=msgs, stats=self.core.stats, step=False)


class Transport(Protocol):
    def recv(self, timeout_s: float | None) -> ToCore | None:
        """The next message; None if none came within ``timeout_s`` (0: do not wait)."""

    def send(self, msg: FromCore) -> None: ...


class QueueTransport:
    """Both ends in one process (``InProcessClient``): the messages themselves, no encoding."""

    def __init__(self, deliver: Callable[[FromCore], None]) -> None:
        self.inbox: queue.Queue[ToCore] = queue.Queue()
        self.deliver = deliver

    def recv(self, timeout_s: float | None) -> ToCore | None:
        try:
            if timeout_s == 0:
                return self.inbox.get_nowait()
            return self.inbox.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def send(self, msg: FromCore) -> None:
        self.deliver(msg)


class CoreLoop:
    """The busy loop: drain inputs, let late arrivals join, step, send. Late arrivals: after an
    idle spell, those that follow each other within ``burst_gap_s`` (the first step of a burst
    is then full, not one request while the rest queue behind a long prefill); with
    ``batch_wait_s``, before any step that saw a new request, those of the next
    ``batch_wait_s``."""

    def __init__(self, core: CoreService, transport: Transport, batch_wait_s: float = 0.0,
                 alive: Callable[[], bool] = lambda: True,
                 burst_gap_s: float = BURST_GAP_MS / 1000.0) -> None:
        self.core = core
        self.transport = transport
        self.batch_wait_s = batch_wait_s
        self.burst_gap_s = burst_gap_s
        self.alive = alive  # False once the front end is gone: the loop ends
        self.num_steps = 0
        # An idle spell gives back what the last burst freed (_malloc.IdleRelease: once, never
        # per step); a test may swap it for one with a shorter delay before ``run``.
        self.idle_release = IdleRelease()

    def run(self) -> None:
        """Until ``Shutdown`` (requests in flight end with error "shutdown") or a dead front end.
        Raises after sending ``CoreDead`` if the engine fails for good."""
        try:
            while self._drain(block=not self.core.has_work()):
                if self.core.has_work():
                    self.transport.send(self.core.step())
                    self.num_steps += 1
                    self.idle_release.worked()
        except BaseException as e:  # noqa: BLE001 - say why before going
            logger.exception("the engine core loop died")
            self.transport.send(CoreDead(f"{type(e).__name__}: {e}"))
            raise
        self.transport.send(self.core.fail_all("shutdown", "the engine core is shutting down"))

    def _drain(self, block: bool) -> bool:
        """Apply the queued messages (waiting for one while idle); False on Shutdown or when the
        front end is gone."""
        msg = self.transport.recv(self._idle_wait() if block else 0)
        while msg is None and block:
            if not self.alive():
                logger.warning("the engine core's front end is gone; stopping")
                return False
            if self.idle_release.idle():
                logger.debug("idle for %.1f s: freed memory given back in %.0f ms",
                             self.idle_release.after_s, 1e3 * self.idle_release.last_s)
            msg = self.transport.recv(self._idle_wait())
        if msg is not None:
            self.idle_release.worked()
        new = False
        while msg is not None:
            if isinstance(msg, Shutdown):
                return False
            new |= self._apply(msg)
            msg = self.transport.recv(0)
        if new and self.batch_wait_s > 0:
            return self._window(self.batch_wait_s, self.batch_wait_s)
        if new and block and self.burst_gap_s > 0:  # the core was idle: a burst may be arriving
            return self._window(BURST_MAX_S, self.burst_gap_s)
        return self.alive()

    def _idle_wait(self) -> float:
        """How long an idle loop blocks: until the front end is due a check, or the idle
        release (whichever comes first)."""
        due = self.idle_release.wait_s
        return PARENT_CHECK_S if due is None else min(due, PARENT_CHECK_S)

    def _window(self, span_s: float, gap_s: float) -> bool:
        """While the batch is small, give late arrivals up to ``span_s`` to join, each at most
        ``gap_s`` after the one before."""
        deadline = time.monotonic() + span_s
        sched = self.core.core.scheduler
        limit = self.core.core.config.scheduler.max_num_seqs
        while sched.num_running + sched.num_waiting < limit:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            msg = self.transport.recv(min(left, gap_s))
            if msg is None:
                break
            if isinstance(msg, Shutdown):
                return False
            self._apply(msg)
        return True

    def _apply(self, msg: ToCore) -> bool:
        """One message; True if it added a request."""
        if isinstance(msg, EngineCoreRequest):
            reply = self.core.add(msg)
            self.transport.send(reply)
            return isinstance(reply, Accepted)
        if isinstance(msg, Abort):
            snap = self.core.abort(msg.request_ids)
            if snap is not None:
                self.transport.send(snap)
        elif isinstance(msg, UtilityCall):
            self.transport.send(self.core.utility(msg))
        return False


# -- the engine-core process ------------------------------------------------------------------------


class ZmqTransport:
    """The core's end of two ZMQ sockets: PULL for inputs, PUSH for outputs (the front end binds
    both on IPC paths it owns)."""

    def __init__(self, in_addr: str, out_addr: str) -> None:
        import zmq

        from pagedllm.engine.messages import encoder, to_core_decoder

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(in_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 5000)
        self.push.connect(out_addr)
        self.enc, self.dec = encoder(), to_core_decoder()

    def recv(self, timeout_s: float | None) -> ToCore | None:
        zmq = self._zmq
        if timeout_s != 0 and not self.pull.poll(None if timeout_s is None else int(timeout_s * 1000)):
            return None
        try:
            frame = self.pull.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        return self.dec.decode(frame.buffer)

    def send(self, msg: FromCore) -> None:
        self.push.send(self.enc.encode(msg), copy=False)

    def close(self) -> None:
        self.pull.close(0)
        self.push.close()
        self.ctx.term()


def serve_core(engine_args: EngineArgs, transport: Transport, options: CoreOptions,
               alive: Callable[[], bool], pid: int) -> int:
    """Build the engine, say ``Ready`` and run the loop until ``Shutdown`` or a dead front end;
    the exit code (1: the engine failed to start, ``CoreDead`` was sent, or the loop died)."""
    from pagedllm.engine.core import LLMEngine
    from pagedllm.engine.messages import Ready

    threads = None
    if options.num_threads is not None:
        import torch

        torch.set_num_threads(options.num_threads)
        if options.prefill_threads not in (None, options.num_threads):
            threads = StepThreads(options.num_threads, options.prefill_threads)
    engine = None
    try:
        engine = LLMEngine.from_engine_args(engine_args)
        freeze_startup_heap()
        transport.send(Ready(pid, engine.kv.num_blocks, engine.stats))
        if threads is not None and engine.config.parallel.tensor_parallel_size == 1:
            engine.core.on_schedule = threads.apply
        service = CoreService(engine.core, options.kv_events, options.data_parallel_rank)
        CoreLoop(service, transport, options.batch_wait_ms / 1000.0, alive=alive,
                 burst_gap_s=options.burst_gap_ms / 1000.0).run()
    except BaseException as e:  # noqa: BLE001 - logged; the exit code tells the front end
        if engine is None:
            logger.exception("the engine core failed to start")
            transport.send(CoreDead(f"start-up failed: {type(e).__name__}: {e}"))
        return 1
    finally:
        if engine is not None:
            engine.shutdown()
    return 0


def run_core_process(engine_args: EngineArgs, in_addr: str, out_addr: str,
                     options: CoreOptions, parent_pid: int) -> None:
    """The entry point of the engine-core process. SIGINT and SIGTERM are left to the front
    end, which drains and then sends ``Shutdown``; the core also stops when its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    transport = ZmqTransport(in_addr, out_addr)
    try:
        code = serve_core(engine_args, transport, options,
                          lambda: os.getppid() == parent_pid, os.getpid())
    finally:
        transport.close()
    sys.exit(code)
