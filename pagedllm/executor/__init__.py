"""Executors: how the engine runs the model for a step, on one rank or a tensor-parallel group.

    UniProcExecutor    tensor_parallel_size=1: rank 0's ModelRunner in the engine process (no
                       extra process, no serialization)
    MultiprocExecutor  rank 0 in the engine process, ranks 1..N-1 in spawned worker processes
                       (executor/multiproc.py)
    RayExecutor        the same with ranks 1..N-1 as Ray actors (executor/ray_executor.py)

An executor holds its ranks and calls them: ``collective_rpc(ModelRunner.method, *args)`` runs
that ModelRunner method on every rank (rank 0 in-process, the others by message, the same way
for processes and Ray actors) and returns each rank's result. ``execute(scheduler_output)`` is
the step: every rank runs ``ModelRunner.run_step`` (the step's ``KVUpdate``, then the forward),
rank 0 also samples. KV changes reach the ranks only this way: inside the step.
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.executor.base import Executor, UniProcExecutor


def make_executor(config: EngineConfig) -> Executor:
    """The executor with the weights loaded (and, where ``config.kv_sized_by_profile``, its
    ``memory_profile``); the engine sizes the pool, then calls ``init_kv_cache``."""
    par = config.parallel
    if par.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    if config.kv_sized_by_profile:
        raise ValueError("tensor-parallel engines are sized from kv_cache_memory or num_kv_blocks")
    if par.distributed_executor_backend == "ray":
        from pagedllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    from pagedllm.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config)


__all__ = ["Executor", "UniProcExecutor", "make_executor"]
