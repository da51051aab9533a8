"""Tables, JSON files, plots and the machine description shared by the bench subcommands."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pagedllm import envs


def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[str],
                 headers: Sequence[str] | None = None) -> str:
    """A plain fixed-width text table (floats to 4 significant digits)."""
    headers = list(headers or columns)

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e6 else f"{v:.3e}"
        return "-" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    from pagedllm import kernels

    info["cpu_model"] = kernels.cpu_model()
    info["cpu_flags"] = " ".join(sorted(kernels.cpu_flags()))
    try:  # the ISA the CPU kernels are (or would be) built for: PAGEDLLM_ISA or this CPU's best
        info["pagedllm_isa"] = kernels.choose_isa(envs.get("PAGEDLLM_ISA") or "auto",
                                                  kernels.cpu_flags())
    except ValueError as e:
        info["pagedllm_isa"] = str(e)
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if (load := loadavg()) is not None:
        info["loadavg_at_start"] = load
    return info


def loadavg() -> list[str] | None:
    """The 1, 5 and 15 minute load averages, as /proc/loadavg writes them ("1.23")."""
    try:
        return [f"{x:.2f}" for x in os.getloadavg()]
    except OSError:  # not available on this platform
        return None


def write_json(path: str | Path, obj: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_default) + "\n")
    return path


def _default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    if hasattr(o, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(o)
    raise TypeError(f"cannot serialise {type(o).__name__}")


def percentiles(xs: Sequence[float], ps: Sequence[int] = (50, 90, 99)) -> dict[str, float]:
    """mean and pNN (linear interpolation) of ``xs``; empty -> zeros."""
    if not xs:
        return {"mean": 0.0, **{f"p{p}": 0.0 for p in ps}}
    s = sorted(xs)
    out = {"mean": statistics.fmean(s)}
    for p in ps:
        k = (len(s) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(s) - 1)
        out[f"p{p}"] = s[lo] + (s[hi] - s[lo]) * (k - lo)
    return out


def plot(path: str | Path, draw: Callable[[Any], None]) -> Path | None:
    """Call ``draw(plt)`` and save a PNG; None (and nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    plt.figure(figsize=(7, 4.2))
    try:
        draw(plt)
        plt.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        plt.savefig(path, dpi=110)
    finally:
        plt.close("all")
    return Path(path)


def targets(checks: Sequence[tuple[str, float | None, str, float]]) -> list[dict[str, Any]]:
    """The project's stated targets (issue 4) against measured values: (name, value, '>=' or
    '<=', threshold) -> rows with ``met``; a missing value is not met."""
    out = []
    for name, value, op, threshold in checks:
        met = value is not None and (value >= threshold if op == ">=" else value <= threshold)
        out.append({"target": f"{name} {op} {threshold:g}", "value": value, "met": met})
    return out


def print_targets(rows: Sequence[dict[str, Any]]) -> None:
    for r in rows:
        v = "n/a" if r["value"] is None else f"{r['value']:.3g}"
        print(f"target {r['target']}: {v} -> {'met' if r['met'] else 'MISSED'}")
