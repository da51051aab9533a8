"""What a user names (``LoRARequest``, vLLM's) and what the engine is configured with
(``LoRAConfig``). Pure Python: the scheduler and the KV manager read these."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter to run a request with, as vLLM's: ``lora_int_id`` (>= 1) identifies it in the
    engine (slots, the prefix cache); ``lora_path`` is a PEFT directory (``adapter_config.json``
    + ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_int_id={self.lora_int_id!r} "
                             "must be an int >= 1")


@dataclass(frozen=True)
class LoRAConfig:
    """``max_loras`` adapters run in one step (device slots); ``max_cpu_loras`` stay loaded on
    the host (LRU); ranks up to ``max_lora_rank``."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras={self.max_loras} must be >= 1 (--max-loras)")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank={self.max_lora_rank} must be >= 1 (--max-lora-rank)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras="
                             f"{self.max_loras} (--max-cpu-loras)")

    @property
    def cpu_capacity(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


def lora_extra_keys(lora: LoRARequest | None) -> tuple | None:
    """The prefix-cache extra key of a request's blocks: its adapter id (None: the base), so no
    block is shared across adapters."""
    return None if lora is None else (("lora", lora.lora_int_id),)


class LoRAPlaces:
    """The adapters of one step being scheduled: at most ``limit`` distinct ones (None: no
    limit, LoRA off). The scheduler asks in ``sort_key`` order, so a request that waits for a
    place is served before any younger one."""

    def __init__(self, limit: int | None) -> None:
        self.limit, self.ids = limit, set[int]()

    def admits(self, lora: LoRARequest | None) -> bool:
        """Whether a request with ``lora`` may run in this step (taking a place if one is left)."""
        if lora is None or self.limit is None or lora.lora_int_id in self.ids:
            return True
        if len(self.ids) >= self.limit:
            return False
        self.ids.add(lora.lora_int_id)
        return True
