"""A step-cost profile: the fitted model plus what it was measured on, as a small JSON file.

``pagedllm plan calibrate`` writes it; ``pagedllm plan --profile`` reads it and warns when the
plan's model, dtype or machine differ from the profile's (the prediction then carries that
mismatch; the README says by how much).
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm.planner.cost import StepCostModel

FORMAT = "pagedllm-step-profile/1"


@dataclass
class Profile:
    model: StepCostModel
    made_on: dict[str, Any]  # model, dtype, kv dtype, device, block size, torch, threads, machine
    fit: dict[str, float] = field(default_factory=dict)  # relative errors of the fit
    samples: list[list[float]] = field(default_factory=list)  # [T, S, D, A, seconds] per cell

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {"format": FORMAT, "cost_model": self.model.as_dict(), "made_on": self.made_on,
               "fit": self.fit, "samples": self.samples}
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--profile {path}: no such file; make one with "
                             f"`pagedllm plan calibrate --output {path}`")
        try:
            doc = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"--profile {path} is not JSON: {e}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"--profile {path} is not a {FORMAT} file (from "
                             f"`pagedllm plan calibrate`)")
        return cls(StepCostModel.from_dict(doc["cost_model"]), doc.get("made_on", {}),
                   doc.get("fit", {}), doc.get("samples", []))

    def mismatches(self, here: dict[str, Any]) -> list[str]:
        """Human-readable differences between where the profile was made and ``here`` (keys of
        ``made_on``; only those present in both are compared)."""
        keys = ("model", "dtype", "kv_cache_dtype", "device", "block_size", "torch",
                "torch_threads", "processor", "cpu_count")
        return [f"{k}: profile {self.made_on[k]!r}, plan {here[k]!r}" for k in keys
                if k in self.made_on and k in here and self.made_on[k] != here[k]]


def machine() -> dict[str, Any]:
    """The machine a profile describes (no torch import: torch facts are added by calibrate)."""
    return {"processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}


def describe_config(config: Any) -> dict[str, Any]:
    """The ``made_on`` keys an ``EngineConfig`` determines (compared by ``mismatches``)."""
    m, c = config.model, config.cache
    return {"model": m.model, "dtype": m.dtype, "kv_cache_dtype": c.kv_dtype_label(m),
            "device": config.device, "block_size": c.block_size,
            "attention_backend": config.attention_backend}
