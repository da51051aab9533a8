"""Benchmarks: workloads, baselines (HF transformers, contiguous reservation), reports, plots.

``pagedllm bench throughput | memory | block-size | kernel | serve``; each subcommand prints a
table and writes JSON (and PNG plots when matplotlib is importable) into ``--output-dir``.
Nothing here is imported by the engine; heavy imports (torch, transformers, httpx, matplotlib)
happen inside the functions that need them.
"""
