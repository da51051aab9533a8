"""``bench kernel``'s table, JSON and plots (the measurement is ``bench.kernel``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.bench.report import format_table, plot, print_targets, write_json

DECODE_COLUMNS = ("context", "block_size", "batch", "paged_ms", "contiguous_ms", "ratio",
                  "paged_GBps", "contiguous_GBps", "frac_peak", "frac_copy", "gather_ms",
                  "contiguous_masked_ms")
PREFILL_COLUMNS = ("context", "block_size", "paged_ms", "contiguous_ms", "ratio", "paged_TFLOPs",
                   "contiguous_TFLOPs", "contiguous_impl")


def report_kernel(res: dict[str, Any], output_dir: Path, output_json: Path | None,
                  make_plots: bool = True) -> list[Path]:
    s = res["shape"]
    path = f" ({res['decode_path']} decode)" if res.get("decode_path") else ""
    print(f"{res['backend']} backend{path} vs contiguous SDPA on "
          f"{res['device_name'] or res['device']}; "
          f"{s['num_heads']} q heads, {s['num_kv_heads']} kv heads, head_dim {s['head_dim']}, "
          f"{s['dtype']}")
    peak, copy = res["peak_bandwidth_bytes_per_s"], res["copy_bandwidth"].get("bytes_per_s")
    print(f"memory bandwidth: spec peak {'n/a' if peak is None else f'{peak / 1e9:.0f} GB/s'}, "
          f"measured copy {'n/a' if copy is None else f'{copy / 1e9:.0f} GB/s'} (read + write)")
    for phase, cols, heads in (
        ("decode", DECODE_COLUMNS,
         ["context", "block", "batch", "paged ms", "contig ms", "paged/contig", "paged GB/s",
          "contig GB/s", "of peak", "of copy", "gather ms", "contig+mask ms"]),
        ("prefill", PREFILL_COLUMNS,
         ["context", "block", "paged ms", "contig ms", "paged/contig", "paged TFLOP/s",
          "contig TFLOP/s", "contig impl"]),
    ):
        rows = [r for r in res["results"] if r["phase"] == phase]
        if rows:  # columns that apply (gather / masked: CPU backend; of peak: known GPU)
            keep = [i for i, c in enumerate(cols) if any(r.get(c) is not None for r in rows)]
            print(f"-- {phase}")
            print(format_table(rows, [cols[i] for i in keep], [heads[i] for i in keep]))
    for phase, v in res["summary"].items():
        print(f"{phase}: median ratio {v['median_ratio']:.2f}, worst {v['max_ratio']:.2f}")
    print_targets(res["targets"])
    paths = [write_json(output_json or output_dir / "kernel.json", res)]
    if make_plots:
        paths += _plots(res, output_dir)
    return paths


def _plots(res: dict[str, Any], output_dir: Path) -> list[Path]:
    rows = res["results"]
    sizes = sorted({r["block_size"] for r in rows})

    def ratios(plt: Any) -> None:
        for phase, style in (("decode", "-"), ("prefill", "--")):
            for bs in sizes:
                pts = [(r["context"], r["ratio"]) for r in rows
                       if r["phase"] == phase and r["block_size"] == bs]
                if pts:
                    plt.plot(*zip(*pts), style, marker="o", label=f"{phase}, block {bs}")
        plt.axhline(1.0, color="gray", lw=0.8)
        plt.xscale("log", base=2)
        plt.xlabel("context length (tokens)")
        plt.ylabel("paged / contiguous time")
        plt.legend(fontsize=8)
        plt.title("paged attention vs contiguous SDPA")

    def bandwidth(plt: Any) -> None:
        for bs in sizes:
            pts = [(r["context"], r["paged_GBps"]) for r in rows
                   if r["phase"] == "decode" and r["block_size"] == bs]
            if pts:
                plt.plot(*zip(*pts), marker="o", label=f"paged, block {bs}")
        ref = {"spec peak": res["peak_bandwidth_bytes_per_s"],
               "measured copy": res["copy_bandwidth"].get("bytes_per_s")}
        for (label, v), color in zip(ref.items(), ("red", "gray")):
            if v:
                plt.axhline(v / 1e9, color=color, lw=0.8, ls="--", label=label)
        plt.xscale("log", base=2)
        plt.xlabel("context length (tokens)")
        plt.ylabel("decode KV read bandwidth (GB/s)")
        plt.legend(fontsize=8)
        plt.title(f"paged decode bandwidth, {res['device_name'] or res['device']}")

    out = [plot(output_dir / "kernel.png", ratios)]
    if any(r["phase"] == "decode" for r in rows):
        out.append(plot(output_dir / "kernel-bandwidth.png", bandwidth))
    return [p for p in out if p is not None]
