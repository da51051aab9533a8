"""A step-cost profile: the fitted model plus what it was measured on, as a small JSON file.

``pagedllm plan calibrate`` writes it; ``pagedllm plan --profile`` reads it and warns when the
plan's machine, model, dtype, pool or token budget differ from the profile's (the prediction
then carries that difference; the README says by how much), and prints how well the fit
predicted steps it did not see.
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedllm._cpu import cpu_model
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
        ``made_on``, as ``describe_setup`` gives them; only those present in both are
        compared)."""
        out = [f"{what}: profile {self.made_on[k]!r}, plan {here[k]!r}"
               for k, what in MATCHED.items()
               if k in self.made_on and k in here and self.made_on[k] != here[k]]
        top = self.made_on.get("largest_timed_step")
        if top is not None and "pool_tokens" in here and "max_num_batched_tokens" in here:
            step = min(here["pool_tokens"], here["max_num_batched_tokens"])
            if step > STEP_SLACK * top:  # a few tokens more extrapolate within the noise
                out.append(f"largest step: profile timed steps of up to {top} tokens, the plan's "
                           f"pool and budget allow {step}; larger steps are extrapolated")
        return out

    def quality(self) -> str:
        return fit_quality(self.fit)


STEP_SLACK = 1.1  # warn when the plan's steps may exceed the largest timed one by more

# made_on key -> what it is, in a warning
MATCHED = {
    "model": "model", "dtype": "dtype", "kv_cache_dtype": "KV cache dtype", "device": "device",
    "hostname": "machine", "cpu_model": "machine (CPU)", "processor": "machine (processor)",
    "cpu_count": "machine (CPUs)", "torch": "torch", "torch_threads": "torch threads",
    "block_size": "block size", "pool_tokens": "KV pool (tokens)",
    "max_num_batched_tokens": "token budget (--max-num-batched-tokens)",
    "max_num_seqs": "--max-num-seqs", "max_model_len": "--max-model-len",
}


def fit_quality(fit: dict[str, Any]) -> str:
    """One line: how well the fit predicts steps, in-sample and held out."""
    if "holdout_median_rel_err" not in fit:
        return ("fit quality unknown: the profile has no held-out error (made before calibrate "
                "measured one); re-run `pagedllm plan calibrate`")
    return (f"fit over {fit['num_samples']} timed steps ({fit['num_kept']} kept, "
            f"{fit['num_terms']} free terms): on steps the fit did not see (leave-one-out) "
            f"median error {fit['holdout_median_rel_err']:.1%}, p90 "
            f"{fit['holdout_p90_rel_err']:.1%}, max {fit['holdout_max_rel_err']:.1%}; "
            f"in-sample median {fit['median_rel_err']:.1%}, p90 {fit['p90_rel_err']:.1%}")


def machine() -> dict[str, Any]:
    """The machine a profile describes (no torch import: torch facts are added by calibrate)."""
    return {"hostname": platform.node(), "cpu_model": cpu_model(),
            "processor": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "platform": platform.platform(), "python": platform.python_version()}




def describe_setup(config: Any) -> dict[str, Any]:
    """What ``plan`` compares a profile against: the config's keys, its pool and budget (as
    ``pool_lines`` sizes the pool) and this machine."""
    from pagedllm.kv.plan import plan_kv_pool
    from pagedllm.planner.grid import Settings

    pool = plan_kv_pool(config.model, config.cache, config.scheduler, lora=config.lora)
    return {**describe_config(config), **Settings.of(config, pool.num_blocks).facts(),
            **machine()}


def describe_config(config: Any) -> dict[str, Any]:
    """The ``made_on`` keys an ``EngineConfig`` determines (compared by ``mismatches``)."""
    m, c = config.model, config.cache
    return {"model": m.model, "dtype": m.dtype, "kv_cache_dtype": c.kv_dtype_label(m),
            "device": config.device, "block_size": c.block_size,
            "attention_backend": config.attention_backend}
