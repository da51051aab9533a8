"""Tensor parallelism with worker processes: rank 0 in the engine process, ranks 1..N-1 spawned.

::

    engine process (rank 0)                              worker r (spawned, or a Ray actor)
    ───────────────────────                              ──────────────────────────────────
    scheduler + block manager (once)
    prepare(step) ─ ("call", "run_step", (kv, batch, loras)) ─▶ run_step(kv, batch, loras):
    run_step(kv, batch, loras):                            the same KV changes on its KV heads,
      KV changes (swap, copies, compaction, resize,        the forward, the same all-reduces
        LoRA pages)                                        (no logits)
      forward: 2 all-reduces per layer  ◀──── gloo ────▶
        (+1 per row-parallel linear an adapter targets)
    sample (full logits: lm_head is replicated)

Any other ModelRunner method reaches every rank the same way (``collective_rpc``), with replies.

Supervision. Before every step rank 0 checks that each worker is alive and has not reported an
error; inside a step a dead worker closes its gloo sockets, so rank 0's next all-reduce fails at
once, and a hung one hits the collective timeout (``ParallelConfig.timeout_s``). Either way the
executor stops every worker and raises ``WorkerFailure`` saying which rank died and how; every
later step raises it again at once (the weights and the KV cache are split: a lost rank cannot be
replaced mid-flight). Workers exit on their own when the engine process dies (end of file on their
pipe, a parent-death watch), and ``shutdown()`` — also run by garbage collection and at exit —
stops them: a polite message, then SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import weakref
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Concatenate

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.group import CommStats, TPGroup, check_tp_size
from pagedllm.distributed.worker import (
    Message,
    make_process_group,
    recv_message,
    send_message,
    worker_main,
)
from pagedllm.executor.base import Executor, P, R
from pagedllm.logging_utils import init_logger
from pagedllm.runner.model_input import ModelInput
from pagedllm.runner.model_runner import ModelRunner, RunnerOutput

logger = init_logger(__name__)

STARTUP_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint can take minutes
FAILURE_GRACE_S = 2.0  # after a failed collective, how long to wait for the culprit to exit


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died, hung or raised; the engine cannot continue."""

    fatal = True  # for callers that keep serving after a failed step: this engine never recovers


class Worker:
    """Rank 0's handle on one worker: its pipe and how to tell whether it still runs."""

    def __init__(self, rank: int, conn: Connection) -> None:
        self.rank, self.conn = rank, conn
        self.pid: int | None = None
        self.host: str | None = None  # known once it reported ready
        self.error: str | None = None  # the traceback it sent, if any
        self.stopped = False

    def exitcode(self) -> int | None:
        """None while it runs."""
        raise NotImplementedError

    def stop(self, grace_s: float) -> None:
        raise NotImplementedError

    def describe(self) -> str:
        return f"rank {self.rank} (pid {self.pid}{f' on {self.host}' if self.host else ''})"


class ProcessWorker(Worker):
    def __init__(self, rank: int, conn: Connection, proc: multiprocessing.process.BaseProcess) -> None:
        super().__init__(rank, conn)
        self.proc = proc
        self.pid = proc.pid

    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def stop(self, grace_s: float) -> None:
        p = self.proc
        p.join(grace_s)
        for kill in (p.terminate, p.kill):
            if p.exitcode is None:
                kill()
                p.join(2.0)
        self.stopped = True


def _stop_all(workers: list[Worker], grace_s: float) -> None:
    """Ask each worker to return, then terminate the ones still running. Idempotent."""
    live = [w for w in workers if not w.stopped]
    for w in live:
        try:
            send_message([w.conn], ("shutdown",))
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    for w in live:
        w.stop(max(0.0, deadline - time.monotonic()))
        w.conn.close()


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class MultiprocExecutor(Executor):
    """Rank 0 of the tensor-parallel group and the handles of the others (module docstring)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        par = config.parallel
        m = config.model
        self.world = n = par.tensor_parallel_size
        check_tp_size(m.num_attention_heads, m.num_key_value_heads, m.intermediate_size, n)
        if torch.device(config.device).type != "cpu":
            raise ValueError(f"tensor_parallel_size={n} runs on CPU (gloo) for now; "
                             f"use --device cpu or --tensor-parallel-size 1")
        self.timeout_s = par.timeout_s
        self.failure: WorkerFailure | None = None
        self._closed = False
        self.workers: list[Worker] = []
        self._finalizer = weakref.finalize(self, _stop_all, self.workers, 5.0)
        self.tp = TPGroup(0, n)
        import torch.distributed as dist

        self.host = self._driver_host()
        self._store: Any = dist.TCPStore(self.host, 0, n, True, timeout=timedelta(seconds=self.timeout_s),
                                         wait_for_workers=False)
        try:
            threads = max(1, (os.cpu_count() or 1) // n)
            self.workers.extend(self._start_workers(config, (self.host, self._store.port), threads))
            self.driver = ModelRunner(config, tp=self.tp)  # loads while theirs do
            self._await_ready()
            self._send(("connect",))
            self.tp.pg = make_process_group(self._store, 0, n, self.host, self.timeout_s)
        except BaseException:
            self.shutdown()
            raise
        logger.info("tensor parallel: %d ranks (%s backend): %s", n, par.distributed_executor_backend,
                    ", ".join(w.describe() for w in self.workers))

    # -- start-up ---------------------------------------------------------------------------------
    def _driver_host(self) -> str:
        return "127.0.0.1"

    def _start_workers(self, config: EngineConfig, store_addr: tuple[str, int],
                       threads: int) -> list[Worker]:
        ctx = multiprocessing.get_context("spawn")
        out: list[Worker] = []
        for rank in range(1, self.world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, name=f"pagedllm-tp{rank}", daemon=True,
                args=(rank, config, theirs, store_addr, self.host, threads),
            )
            proc.start()
            theirs.close()
            out.append(ProcessWorker(rank, mine, proc))
        return out

    def _await_ready(self) -> None:
        pending = {w.conn: w for w in self.workers}
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            if time.monotonic() > deadline:
                raise self._fail(TimeoutError(f"workers not ready after {STARTUP_TIMEOUT_S:.0f}s"))
            for conn in wait(list(pending), timeout=0.5):
                w = pending.pop(conn)  # type: ignore[call-overload]
                try:
                    msg = recv_message(w.conn)
                except (EOFError, OSError) as e:
                    raise self._fail(e) from e
                if msg[0] != "ready":
                    w.error = msg[2] if msg[0] == "error" else repr(msg)
                    raise self._fail(RuntimeError(f"worker rank {w.rank} failed to start"))
                w.pid, w.host = msg[1], msg[2]
            for w in pending.values():
                if w.exitcode() is not None:
                    raise self._fail(RuntimeError(f"worker rank {w.rank} exited during start-up"))

    # -- the step -------------------------------------------------------------------------------
    @property
    def comm_stats(self) -> CommStats:
        return self.tp.stats

    def execute(self, step: ModelInput) -> RunnerOutput:
        """The step on every rank: workers get ``run_step`` with the same KV changes and host
        batch that rank 0's ``execute`` runs (the batch is prepared once, here). Workers need
        no more of the ``ModelInput``: they neither sample nor wait for grammar masks."""
        self.check_health()
        t0 = time.perf_counter()
        hb = self.driver.prepare(step.seqs) if step.seqs else None
        prepare_s = time.perf_counter() - t0
        loras = None if self.driver.lora is None else step.lora_rows()
        self._call(ModelRunner.run_step.__name__, (step.kv, hb, loras), {}, reply=False)
        result = self._on_driver(self.driver.execute, step, hb)
        result.prepare_s = prepare_s
        if hb is not None:
            self.tp.stats.steps += 1
        return result

    def collective_rpc(self, method: Callable[Concatenate[ModelRunner, P], R],
                       *args: P.args, **kwargs: P.kwargs) -> list[R]:
        self.check_health()
        self._call(method.__name__, args, kwargs, reply=True)
        mine = self._on_driver(method, self.driver, *args, **kwargs)
        return [mine, *self._replies()]

    def _call(self, name: str, args: tuple, kwargs: dict[str, Any], reply: bool) -> None:
        self._send(("call", name, args, kwargs, reply))

    def _on_driver(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """Rank 0's part of a call the workers run too: any failure leaves the ranks out of step."""
        try:
            return fn(*args, **kwargs)
        except BaseException as e:  # a failed all-reduce, rank 0's own error, Ctrl-C
            failure = self._fail(e)
            if isinstance(e, Exception):
                raise failure from e
            raise

    def _replies(self) -> list[Any]:
        """Each worker's answer to the last call with ``reply``, in rank order."""
        out = []
        for w in self.workers:
            if not w.conn.poll(self.timeout_s):
                raise self._fail(TimeoutError(f"rank {w.rank} sent no reply within "
                                              f"timeout_s={self.timeout_s:g}"))
            try:
                msg = recv_message(w.conn)
            except (EOFError, OSError) as e:
                raise self._fail(e) from e
            if msg[0] != "result":
                if msg[0] == "error":
                    w.error = msg[2]
                raise self._fail(None)
            out.append(msg[1])
        return out

    def _send(self, msg: Message) -> None:
        self._check_open()
        t0 = time.perf_counter()
        try:
            n = send_message([w.conn for w in self.workers], msg)
        except OSError as e:  # a worker's end of the pipe is gone
            raise self._fail(e) from e
        st = self.tp.stats
        st.control_seconds += time.perf_counter() - t0
        st.control_messages += 1
        st.control_bytes += n

    # -- supervision ----------------------------------------------------------------------------
    def check_health(self) -> None:
        """Raise WorkerFailure if a worker has exited or reported an error."""
        self._check_open()
        for w in self.workers:
            if w.exitcode() is not None or w.conn.poll():
                raise self._fail(None)

    def _check_open(self) -> None:
        if self.failure is not None:
            raise WorkerFailure(str(self.failure))
        if self._closed:
            raise RuntimeError("this engine's tensor-parallel workers were shut down; start a new engine")

    def _fail(self, cause: BaseException | None) -> WorkerFailure:
        """Find out what happened, stop every worker, remember and return the error."""
        if self.failure is not None:
            return self.failure
        deadline = time.monotonic() + FAILURE_GRACE_S
        while time.monotonic() < deadline and all(w.exitcode() is None for w in self.workers):
            time.sleep(0.02)  # a crashed worker's exit can trail its closed socket
        for w in self.workers:
            self._read_error(w)
        problems = []
        for w in self.workers:
            code = w.exitcode()
            if code is not None or w.error:
                what = "exited with " + describe_exit(code) if code is not None else "failed"
                problems.append(f"worker {w.describe()} {what}" + (f":\n{w.error}" if w.error else ""))
        if any(w.host is None and not w.error for w in self.workers):
            problems.append(
                "it died during start-up without a report (its traceback, if any, is on stderr); "
                "a script that starts a tensor-parallel engine must do so under "
                "`if __name__ == '__main__':`, since workers are spawned and re-import the main module")
        if not problems:
            problems.append(f"no worker exited; rank 0 failed or a worker stopped answering within "
                            f"timeout_s={self.timeout_s:g}")
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        self.failure = WorkerFailure(
            "tensor-parallel group failed: " + "; ".join(problems) + why + ". The weights and KV "
            "cache are split across the ranks, so this engine cannot continue; all workers were "
            "stopped. Start a new engine."
        )
        logger.error("%s", self.failure)
        self.shutdown(grace_s=0.5)
        return self.failure

    @staticmethod
    def _read_error(w: Worker) -> None:
        try:
            while not w.conn.closed and w.conn.poll():
                msg = recv_message(w.conn)
                if msg[0] == "error":
                    w.error = msg[2]
        except (EOFError, OSError):
            pass

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop the workers and drop the process group. Idempotent."""
        self._closed = True
        _stop_all(self.workers, grace_s)
        self._finalizer.detach()
        self.tp.pg = None
        self._store = None
