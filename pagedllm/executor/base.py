"""The executor interface and the single-process executor (see the package docstring)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Concatenate, ParamSpec, TypeVar

from pagedllm.config import EngineConfig
from pagedllm.runner.model_input import ModelInput
from pagedllm.runner.model_runner import ModelRunner, RunnerOutput

if TYPE_CHECKING:
    from pagedllm.runner.memory import MemoryProfile

P = ParamSpec("P")
R = TypeVar("R")


class Executor:
    """One rank: rank 0's ModelRunner (``driver``), in this process."""

    def __init__(self, config: EngineConfig) -> None:
        """Loads the weights (and profiles memory where ``config.kv_sized_by_profile``); the KV
        pool comes with ``init_kv_cache``."""
        self.config = config
        self.driver = ModelRunner(config)

    def collective_rpc(self, method: Callable[Concatenate[ModelRunner, P], R],
                       *args: P.args, **kwargs: P.kwargs) -> list[R]:
        """Run ``method`` (a ModelRunner method) on every rank; results in rank order."""
        return [method(self.driver, *args, **kwargs)]

    def execute(self, step: ModelInput) -> RunnerOutput:
        """The step (plain data: ``ModelInput``) on every rank; rank 0 samples."""
        return self.driver.execute(step)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate every rank's KV pool (once the engine has planned it)."""
        self.collective_rpc(ModelRunner.init_kv_cache, num_blocks)

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests' sampling state (rank 0 alone samples)."""
        self.driver.release(request_ids)

    def shutdown(self) -> None:
        """Stop the other ranks; idempotent."""

    @property
    def memory_profile(self) -> MemoryProfile | None:
        return self.driver.memory_profile


class UniProcExecutor(Executor):
    """The single-process executor."""
