"""Executors: how the engine runs the model for a step.

    UniProcExecutor    tensor_parallel_size=1: the ModelRunner in the engine process, as before
                       (no extra process, no serialization)
    MultiprocExecutor  rank 0 of the tensor-parallel group in the engine process, ranks 1..N-1
                       in spawned worker processes (executor/multiproc.py)
    RayExecutor        the same with ranks 1..N-1 as Ray actors (executor/ray_executor.py)

Every executor *is* rank 0's ModelRunner, so the engine and its helpers keep calling
``execute(scheduler_output)``, ``release(ids)`` and ``kv_cache.resize / copy_blocks``; a
tensor-parallel executor forwards each step and each KV block move to its workers first.
``shutdown()`` stops the workers (it also runs when the executor is garbage-collected and at exit).
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.runner.model_runner import ModelRunner


class Executor(ModelRunner):
    """Rank 0's ModelRunner plus the lifetime of any other ranks."""

    def shutdown(self) -> None:
        """Stop the other ranks; idempotent."""


class UniProcExecutor(Executor):
    """The single-process executor: exactly the ModelRunner."""


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
