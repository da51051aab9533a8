"""Tensor parallelism with ranks 1..N-1 as Ray actors (``--distributed-executor-backend ray``).

Rank 0 stays in the engine process, exactly as with worker processes; what changes is where the
other ranks run and how they reach rank 0:

- each worker is a Ray actor (``num_cpus`` = its thread count) placed by Ray anywhere in the
  cluster; its ``run`` method is the same ``worker_main`` a spawned process runs;
- messages travel over a TCP ``multiprocessing`` connection to a listener in the engine process
  (authenticated with a random key), the all-reduces over gloo between the nodes' addresses
  (``ray.util.get_node_ip_address()``), rendezvous through rank 0's TCPStore.

The engine connects to a running cluster when ``RAY_ADDRESS`` is set (or ``ray.init`` was already
called), else starts a local Ray instance. A worker whose actor dies is seen as a finished ``run``
(``ray.wait``) or as a closed connection; ``shutdown`` kills the actors.
"""

from __future__ import annotations

import pickle
import queue
import secrets
import threading
import time
from multiprocessing.connection import Connection, Listener
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.distributed.ray_init import join_ray
from pagedllm.distributed.worker import worker_main
from pagedllm.executor.multiproc import STARTUP_TIMEOUT_S, MultiprocExecutor, Worker


class _RankActor:
    """The Ray actor class body (wrapped with ``ray.remote`` at start-up)."""

    def node_ip(self) -> str:
        import ray

        return str(ray.util.get_node_ip_address())

    def run(self, rank: int, config: EngineConfig, addr: tuple[str, int],
            store_addr: tuple[str, int], host: str, threads: int, authkey: bytes) -> None:
        worker_main(rank, config, addr, store_addr, host, threads, authkey)


class RayWorker(Worker):
    def __init__(self, rank: int, conn: Connection, actor: Any, done: Any) -> None:
        super().__init__(rank, conn)
        self.actor, self.done = actor, done  # done: the ObjectRef of actor.run

    def exitcode(self) -> int | None:
        import ray

        ready, _ = ray.wait([self.done], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self.done)
            return 0
        except Exception:
            return 1

    def stop(self, grace_s: float) -> None:
        import ray

        ray.wait([self.done], timeout=grace_s)
        ray.kill(self.actor)
        self.stopped = True

    def describe(self) -> str:
        return f"rank {self.rank} (Ray actor, pid {self.pid} on {self.host or '?'})"


class RayExecutor(MultiprocExecutor):
    def _driver_host(self) -> str:
        import ray

        join_ray(log_to_driver=True)
        return str(ray.util.get_node_ip_address())

    def _start_workers(self, config: EngineConfig, store_addr: tuple[str, int],
                       threads: int) -> list[Worker]:
        import ray

        authkey = secrets.token_bytes(32)
        listener = Listener((self.host, 0), authkey=authkey)
        accepted: queue.Queue[Connection | BaseException] = queue.Queue()

        def accept() -> None:
            for _ in range(self.world - 1):
                try:
                    accepted.put(listener.accept())
                except BaseException as e:  # the listener was closed, or a bad handshake
                    accepted.put(e)
                    return

        threading.Thread(target=accept, name="pagedllm-ray-accept", daemon=True).start()
        actor_cls = ray.remote(num_cpus=threads)(_RankActor)
        actors, dones = {}, {}
        for rank in range(1, self.world):
            actor = actor_cls.remote()  # type: ignore[attr-defined]
            host = ray.get(actor.node_ip.remote(), timeout=STARTUP_TIMEOUT_S)  # type: ignore[union-attr]
            actors[rank] = actor
            run: Any = actor.run
            dones[rank] = run.remote(rank, config, listener.address, store_addr, host, threads,
                                     authkey)
        out: list[Worker] = []
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        try:
            while len(out) < self.world - 1:
                failed, _ = ray.wait(list(dones.values()), timeout=0)
                if failed:
                    ray.get(failed[0])  # raises the actor's error
                    raise RuntimeError("a Ray worker returned before connecting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"Ray workers did not connect within {STARTUP_TIMEOUT_S:.0f}s")
                try:
                    item = accepted.get(timeout=0.5)
                except queue.Empty:
                    continue
                if isinstance(item, BaseException):
                    raise item
                rank = _recv_rank(item)
                out.append(RayWorker(rank, item, actors[rank], dones[rank]))
        except BaseException:
            for a in actors.values():
                ray.kill(a)  # type: ignore[arg-type]
            raise
        finally:
            listener.close()
        return sorted(out, key=lambda w: w.rank)


def _recv_rank(conn: Connection) -> int:
    return int(pickle.loads(conn.recv_bytes()))
