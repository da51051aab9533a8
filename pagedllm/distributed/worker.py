"""A tensor-parallel worker: ranks 1..N-1 (rank 0 is the engine process, see executor/multiproc.py).

Life of a worker::

    start ── load this rank's weight shard ──▶ send ("ready", pid, host)
          ◀── ("connect",) ── join the gloo process group (all ranks at once)
          ◀── ("call", "init_kv_cache", ...) ── allocate this rank's KV heads
          loop: ("call", method, args, kwargs, reply)  run ModelRunner.<method>(*args, **kwargs)
                                                       on this rank; if reply: send ("result", r)
                ("shutdown",)                          return
    on any error: send ("error", rank, traceback), exit non-zero

A step is ``("call", "run_step", (kv_update, host_batch), {}, False)``: the step's KV changes,
then the forward, whose all-reduces pair with rank 0's (no reply: rank 0 learns of a failure from
the collective). Rank 0 sends every message to every worker over a ``multiprocessing`` connection
(a pipe, or TCP for Ray actors): pickled once, the same bytes to each worker (``send_message``).
Only public ModelRunner methods can be called (``rpc_method``). Waiting for the next message has
no timeout (an idle server is fine) but ends at once when the engine goes away (end of file). A
worker never samples: only rank 0 computes logits.
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Client, Connection
from typing import Any

import torch

from pagedllm.config import EngineConfig
from pagedllm.distributed.group import TPGroup

Message = tuple[Any, ...]


def send_message(conns: list[Connection], msg: Message) -> int:
    """Pickle ``msg`` once and send it to every connection; returns the size in bytes."""
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    for c in conns:
        c.send_bytes(data)
    return len(data)


def recv_message(conn: Connection) -> Message:
    return pickle.loads(conn.recv_bytes())  # type: ignore[no-any-return]


def rpc_method(name: str) -> Callable[..., Any]:
    """The ModelRunner method an RPC names. Only public methods can be called."""
    from pagedllm.runner.model_runner import ModelRunner

    fn = None if name.startswith("_") else getattr(ModelRunner, name, None)
    if not callable(fn):
        raise RuntimeError(f"rank 0 called {name!r}, which is not a public ModelRunner method")
    return fn  # type: ignore[no-any-return]


def make_process_group(store: Any, rank: int, size: int, host: str, timeout_s: float) -> Any:
    """A gloo process group over ``store`` (a torch.distributed TCPStore), its own object: no
    global default group, so several engines can live in one process one after another."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore("pagedllm_tp", store)
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, size, opts)


def worker_main(
    rank: int,
    config: EngineConfig,
    conn: Connection | tuple[str, int],
    store_addr: tuple[str, int],
    host: str,
    num_threads: int,
    authkey: bytes | None = None,
) -> None:
    """Entry point of rank ``rank`` (a spawned process, or a Ray actor's method). ``conn`` is the
    pipe to rank 0, or the (host, port) of rank 0's listener; ``host`` is this rank's address
    for gloo."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the engine, which stops us
    if not isinstance(conn, Connection):
        conn = Client(conn, authkey=authkey)
        conn.send_bytes(pickle.dumps(rank))
    try:
        _watch_parent()
        _serve(rank, config, conn, store_addr, host, num_threads)
    except EOFError:
        return  # the engine is gone: nothing to report to
    except BaseException:
        try:
            send_message([conn], ("error", rank, traceback.format_exc()))
        except OSError:
            pass
        raise


def _serve(rank: int, config: EngineConfig, conn: Connection,
           store_addr: tuple[str, int], host: str, num_threads: int) -> None:
    import torch.distributed as dist

    from pagedllm.runner.model_runner import ModelRunner

    torch.set_num_threads(num_threads)
    size = config.parallel.tensor_parallel_size
    tp = TPGroup(rank, size)
    runner = ModelRunner(config, tp=tp)  # the KV pool comes with rank 0's init_kv_cache call
    send_message([conn], ("ready", os.getpid(), host))
    msg = recv_message(conn)
    if msg[0] == "shutdown":
        return
    assert msg[0] == "connect", msg
    timeout = config.parallel.timeout_s
    store = dist.TCPStore(store_addr[0], store_addr[1], size, False, timeout=timedelta(seconds=timeout))
    tp.pg = make_process_group(store, rank, size, host, timeout)
    while True:
        msg = recv_message(conn)
        kind = msg[0]
        if kind == "call":
            _, name, args, kwargs, reply = msg
            result = rpc_method(name)(runner, *args, **kwargs)
            if reply:
                send_message([conn], ("result", result))
        elif kind == "shutdown":
            return
        else:
            raise RuntimeError(f"unknown message {kind!r} from rank 0")


def _watch_parent() -> None:
    """A spawned worker exits when the engine process dies, even in the middle of loading weights
    (a Ray actor is reaped by Ray instead)."""
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="pagedllm-parent-watch", daemon=True).start()
