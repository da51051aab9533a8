"""A checkpoint's ``generation_config.json`` as default sampling settings, as vLLM's
``--generation-config auto``: temperature, top_p, top_k, min_p and repetition_penalty apply to
requests that do not set them, and its eos ids stop generation too. ``vllm`` ignores the file;
a directory reads the file from there.

One merge, for every entry point (``LLM.generate``, ``pagedllm generate``, the server): what the
caller set wins, then the file, then the caller's fallback (the CLI's greedy), then
SamplingParams' own defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedllm.sampling_params import SamplingParams

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams field -> value
    eos_token_ids: tuple[int, ...] = ()

    def merge(self, **given: Any) -> dict[str, Any]:
        """The file's settings under what the caller set (``None`` = not set)."""
        return {**self.sampling, **{k: v for k, v in given.items() if v is not None}}

    def sampling_params(self, fallback: dict[str, Any] | None = None,
                        **given: Any) -> SamplingParams:
        """SamplingParams from ``given`` (``None`` = not set), else the file, else
        ``fallback``, else SamplingParams' defaults."""
        from pagedllm.sampling_params import SamplingParams

        return SamplingParams(**{**(fallback or {}), **self.merge(**given)})


def load_generation_defaults(model_dir: str, mode: str = "auto") -> GenerationDefaults:
    """``mode``: auto (the model's file, if any), vllm (none), or a directory holding one."""
    if mode == "vllm":
        return GenerationDefaults()
    path = Path(model_dir if mode == "auto" else mode) / "generation_config.json"
    if not path.is_file():
        if mode != "auto":
            raise ValueError(f"generation_config={mode!r}: no generation_config.json in that "
                             "directory; pass auto, vllm or a directory that has one")
        return GenerationDefaults()
    try:
        cfg = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); fix it or pass "
                         "--generation-config vllm") from None
    sampling = {k: cfg[k] for k in SAMPLING_KEYS if isinstance(cfg.get(k), (int, float))
                and not isinstance(cfg.get(k), bool)}
    eos = cfg.get("eos_token_id")
    eos_ids = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    return GenerationDefaults(sampling, tuple(int(e) for e in eos_ids))
