"""The GPU side of the benchmarks, exercised on CPU: bandwidth / FLOP arithmetic, the GPU peak
bandwidth table, the kernel bench on the Triton kernels in Triton's interpreter (the code path
``--device cuda`` takes, minus the GPU), HF on the engine's device and dtype, clocks read after
a device sync, the 1b random-model preset, and scripts/gpu_check.sh (syntax and its summary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pagedllm.bench import kernel_case as kernel_case_mod
from pagedllm.bench.device import (
    attention_flops,
    decode_kv_bytes,
    measure_copy_bandwidth,
    peak_memory_bandwidth,
    synchronize,
)
from pagedllm.bench.kernel import _rates, kernel_defaults
from pagedllm.bench.kernel_case import case as _case
from pagedllm.bench.random_model import PRESETS, build_random_model, llama_param_count
from pagedllm.bench.workload import BenchRequest
from pagedllm.entrypoints.cli import main

ROOT = Path(__file__).resolve().parents[2]
TINY_KERNEL = ["--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16", "--contexts", "16,40",
               "--block-sizes", "16", "--batch", "2", "--rounds", "1", "--iters", "1", "--no-plot"]


# -- arithmetic ---------------------------------------------------------------------------------
def test_decode_kv_bytes_and_attention_flops_are_exact() -> None:
    # 32 requests x 32768 tokens x 8 KV heads x 128 x (K and V) x 2 bytes = 4 GiB
    assert decode_kv_bytes(32, 32768, 8, 128, 2) == 2**32
    assert decode_kv_bytes(2, 40, 2, 16, 4) == 2 * 40 * 2 * 16 * 2 * 4 == 20480
    # full causal prefill: rows see 1, 2, ..., L keys -> L(L+1)/2 pairs, 4 * Hq * D FLOPs each
    assert attention_flops(32, 128, 4, 4) == 4 * 32 * 128 * 10 == 163840
    assert attention_flops(32, 128, 32768, 32768) == 4 * 32 * 128 * 32768 * 32769 // 2
    assert attention_flops(8, 64, 1, 100) == 4 * 8 * 64 * 100  # decode: one row, all keys
    assert attention_flops(1, 1, 3, 10) == 4 * (8 + 9 + 10)  # a chunk after 7 cached tokens
    with pytest.raises(ValueError, match="query_len"):
        attention_flops(1, 1, 5, 4)


def test_rates_from_times() -> None:
    d = _rates("decode", 2, 1000, 8, 2, 64, 2, paged_s=1e-3, cont_s=2e-3, peak=1e9, copy_bw=5e8)
    assert d["kv_bytes"] == 2 * 1000 * 2 * 64 * 2 * 2 == 1024000
    assert d["paged_GBps"] == pytest.approx(1.024) and d["contiguous_GBps"] == pytest.approx(0.512)
    assert d["frac_peak"] == pytest.approx(1.024) and d["frac_copy"] == pytest.approx(2.048)
    none = _rates("decode", 2, 1000, 8, 2, 64, 2, 1e-3, 2e-3, peak=None, copy_bw=None)
    assert none["frac_peak"] is None and none["frac_copy"] is None
    p = _rates("prefill", 1, 1000, 8, 2, 64, 2, paged_s=0.5, cont_s=0.25, peak=None, copy_bw=None)
    assert p["flops"] == 4 * 8 * 64 * 1000 * 1001 // 2 == 1025024000
    assert p["paged_TFLOPs"] == pytest.approx(1025024000 / 0.5 / 1e12)
    assert p["contiguous_TFLOPs"] == pytest.approx(2 * p["paged_TFLOPs"])


@pytest.mark.parametrize(("name", "bw"), [
    ("NVIDIA H200", 4.8e12),
    ("NVIDIA H200 NVL", 4.8e12),
    ("NVIDIA H100 80GB HBM3", 3.35e12),
    ("NVIDIA H100 PCIe", 2.0e12),
    ("NVIDIA H100 NVL", 3.9e12),
    ("NVIDIA A100-SXM4-80GB", 2.039e12),
    ("NVIDIA A100 80GB PCIe", 1.935e12),
    ("NVIDIA A100-SXM4-40GB", 1.555e12),
    ("NVIDIA A100-PCIE-40GB", 1.555e12),
    ("NVIDIA L4", 3.0e11),
    ("NVIDIA A10", 6.0e11),
    ("NVIDIA GeForce RTX 4090", 1.008e12),
    ("NVIDIA L40S", None),  # "l4" must not match "l40s"
    ("Tesla T4", None),
    ("", None),
    (None, None),
])
def test_peak_bandwidth_table(name: str | None, bw: float | None) -> None:
    assert peak_memory_bandwidth(name) == bw


def test_copy_bandwidth_and_sync_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    c = measure_copy_bandwidth("cpu", nbytes=2**20, iters=2)
    assert c["bytes_per_copy"] == 2**20 and c["counted"] == "read + write" and c["bytes_per_s"] > 0
    import torch

    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append(d))
    synchronize("cpu")
    assert calls == []
    synchronize("cuda:1")
    assert calls == [torch.device("cuda:1")]


def test_kernel_defaults_by_device() -> None:
    cpu, cuda = kernel_defaults("cpu"), kernel_defaults("cuda:0")
    assert (cpu["backend"], cpu["dtype"], cpu["heads"], cpu["batch"]) == ("cpu", "float32", None, 16)
    assert cpu["contexts"] == (128, 512, 2048)
    assert (cuda["backend"], cuda["dtype"], cuda["heads"], cuda["batch"]) == (
        "triton", "bfloat16", (32, 8, 128), 32)
    assert cuda["contexts"] == (1024, 4096, 16384, 32768) and cuda["block_sizes"] == (16, 64, 256)


# -- kernel bench paths -------------------------------------------------------------------------
def test_prefill_falls_back_to_expanded_kv_without_a_fused_gqa_kernel(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CUDA, where SDPA has no fused GQA kernel for the dtype, the contiguous prefill keeps K/V
    expanded to the query heads (and still agrees with the paged backend)."""
    import torch
    import torch.nn.functional as F

    sdpa = F.scaled_dot_product_attention

    def no_gqa(*args: Any, enable_gqa: bool = False, **kw: Any) -> Any:
        if enable_gqa:
            raise RuntimeError("No available kernel")
        return sdpa(*args, **kw)

    monkeypatch.setattr(kernel_case_mod, "is_cuda", lambda device: True)
    monkeypatch.setattr(F, "scaled_dot_product_attention", no_gqa)
    with torch.inference_mode():  # torch_ref: a paged side that does not call SDPA
        c = _case("prefill", 1, 24, 8, 4, 2, 16, "torch_ref", 0)
        assert c.contiguous_impl == "sdpa-expanded-kv" and c.max_abs_diff < 1e-4
        assert c.contiguous().shape == (24, 4, 16)
        c = _case("prefill", 1, 24, 8, 4, 4, 16, "torch_ref", 0)  # no GQA: SDPA as is
        assert c.contiguous_impl == "sdpa"


def test_half_precision_case_uses_a_loose_tolerance() -> None:
    import torch

    with torch.inference_mode():
        c = _case("decode", 3, 40, 16, 4, 2, 16, "cpu", 0, dtype="bfloat16")
    assert c.masked is not None and c.gather is not None
    assert 0 <= c.max_abs_diff <= 2e-2


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.slow
def test_kernel_bench_triton_in_the_interpreter(tmp_path: Path) -> None:
    """``bench kernel --backend triton`` on CPU under TRITON_INTERPRET=1 (which must be set
    before triton is imported, hence a subprocess): the CUDA-shaped path with its rates; without
    the interpreter the triton backend refuses with a message that says what to do."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = tmp_path / "k.json"
    r = _cli(["bench", "kernel", "--backend", "triton", "--dtype", "bfloat16", *TINY_KERNEL,
              "--output-dir", str(tmp_path), "--output-json", str(out)],
             {**env, "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert (res["backend"], res["device"], res["shape"]["dtype"]) == ("triton", "cpu", "bfloat16")
    assert res["device_name"] is None and res["peak_bandwidth_bytes_per_s"] is None
    assert res["copy_bandwidth"]["bytes_per_s"] > 0
    dec = [x for x in res["results"] if x["phase"] == "decode"]
    pre = [x for x in res["results"] if x["phase"] == "prefill"]
    assert [x["kv_bytes"] for x in dec] == [decode_kv_bytes(2, n, 2, 16, 2) for n in (16, 40)]
    for x in dec:
        assert x["paged_GBps"] == pytest.approx(x["kv_bytes"] / x["paged_ms"] / 1e6)
        assert x["frac_peak"] is None and x["frac_copy"] > 0 and x["gather_ms"] is None
        assert x["contiguous_masked_ms"] > 0 and x["max_abs_diff"] <= 2e-2
    assert [x["flops"] for x in pre] == [attention_flops(4, 16, n, n) for n in (16, 40)]
    assert all(x["paged_TFLOPs"] > 0 and x["contiguous_masked_ms"] is None for x in pre)
    assert res["summary"]["decode"]["longest_context"] == 40
    assert res["summary"]["decode"]["frac_peak_at_longest"] == {"16": None}
    assert [t["target"] for t in res["targets"]] == [
        "paged/contiguous decode time (worst case) <= 1.3"]  # no bandwidth target without a peak
    assert "paged GB/s" in r.stdout and "paged TFLOP/s" in r.stdout

    bad = _cli(["bench", "kernel", "--backend", "triton", *TINY_KERNEL,
                "--output-dir", str(tmp_path)], env)
    assert bad.returncode == 2 and "TRITON_INTERPRET=1" in bad.stderr


def test_cuda_without_a_gpu_says_so(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    import torch

    from pagedllm.bench.baselines import HFBackend

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "kernel", "--device", "cuda", "--contexts", "16", "--no-plot",
                 "--output-dir", str(tmp_path)]) == 2
    with pytest.raises(ValueError, match="sees no CUDA GPU.*--device cpu"):
        HFBackend(str(tiny_models["llama"]), 2, "auto", "cuda")


# -- HF and engine backends on the engine's device ----------------------------------------------
def test_hf_backend_runs_on_the_engine_device_and_dtype(
    tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    from pagedllm.bench import baselines

    synced: list[str] = []
    monkeypatch.setattr(baselines, "synchronize", synced.append)
    hf = baselines.make_backend(
        "hf", {"model": str(tiny_models["llama"]), "device": "cpu", "dtype": "bfloat16"}, 2)
    assert (hf.device, hf.dtype) == ("cpu", "bfloat16")
    assert {(p.device.type, p.dtype) for p in hf.model.parameters()} == {("cpu", torch.bfloat16)}
    seen: list[tuple[str, str]] = []
    generate = hf.model.generate

    def spy(**kw: Any) -> Any:
        seen.append((kw["input_ids"].device.type, kw["attention_mask"].device.type))
        return generate(**kw)

    monkeypatch.setattr(hf.model, "generate", spy)
    reqs = [BenchRequest([5, 6, 7], 3), BenchRequest([8, 9], 2), BenchRequest([10], 4)]
    res = hf.run(reqs)
    assert [len(o) for o in res.outputs] == [3, 2, 4]
    assert res.stats == {"batch_size": 2, "device": "cpu", "dtype": "bfloat16"}
    assert seen == [("cpu", "cpu")] * 2 and synced == ["cpu", "cpu"]
    auto = baselines.HFBackend(str(tiny_models["llama"]), 2)  # "auto": the checkpoint's fp32
    assert (auto.device, auto.dtype) == ("cpu", "float32")

    eng = baselines.make_backend("pagedllm", {"model": str(tiny_models["llama"]), "device": "cpu",
                                              "max_model_len": 64, "block_size": 4}, 2)
    synced.clear()
    assert [len(o) for o in eng.run(reqs).outputs] == [3, 2, 4]
    assert eng.device == "cpu" and synced == ["cpu", "cpu"]


# -- the 1b preset ------------------------------------------------------------------------------
def test_1b_preset_parameter_count() -> None:
    """Counted on the meta device (no memory): ~0.99B with the shipped 4096-token vocab, and the
    closed form agrees with transformers for every preset."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.config import default_model_path
    from pagedllm.tokenizer import get_tokenizer

    vocab = len(get_tokenizer(default_model_path()))
    assert vocab == 4096
    for name, preset in PRESETS.items():
        shape = {"vocab_size": vocab, **preset}  # a preset may set its own vocabulary (125m)
        with torch.device("meta"):
            m = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **shape))
        assert sum(p.numel() for p in m.parameters()) == llama_param_count(**shape), name
    n = llama_param_count(vocab, **PRESETS["1b"])
    # 16 x (2048 x 64 x (2 x 32 + 2 x 8) + 3 x 2048 x 8192 + 2 x 2048) + 2 x 4096 x 2048 + 2048
    assert n == 989_923_328
    assert PRESETS["1b"]["max_position_embeddings"] == 4096


def test_random_model_dtype(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from pagedllm.config import ModelConfig

    tok = str(tiny_models["llama"])
    n = build_random_model(tmp_path / "bf16", "tiny", tok, dtype="bfloat16")
    assert n == llama_param_count(512, **PRESETS["tiny"])
    assert ModelConfig.from_hf(str(tmp_path / "bf16")).dtype == "bfloat16"
    build_random_model(tmp_path / "fp32", "tiny", tok)
    assert ModelConfig.from_hf(str(tmp_path / "fp32")).dtype == "float32"
    import torch

    assert torch.get_default_dtype() == torch.float32  # restored after the build
    with pytest.raises(ValueError, match="dtype"):
        build_random_model(tmp_path / "x", "tiny", tok, dtype="int8")


# -- scripts/gpu_check.sh -----------------------------------------------------------------------
def test_gpu_check_script_syntax_and_summary(tmp_path: Path) -> None:
    """The script parses, and its summary step reads the kernel / throughput JSON (written here by
    the CPU benchmarks; the steps that need a GPU are not run)."""
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    out = tmp_path / "out"
    assert main(["bench", "kernel", *TINY_KERNEL, "--output-dir", str(out)]) == 0
    tp = {"workload": {"num_requests": 2, "output_tokens": 8}, "device_name": "NVIDIA H200",
          "reps": 2, "results": [{"backend": "pagedllm", "output_tokens_per_s": 1000.0,
                                  "requests_per_s": 5.0, "elapsed_s_all": [0.01, 0.02]}],
          "ratios": {"pagedllm/hf": {"output_tokens_per_s": 4.0}},
          "greedy_output_agreement": {"pagedllm/hf": 1.0}, "targets": []}
    (out / "throughput.json").write_text(json.dumps(tp))
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_STEPS": "summary",
           "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "decode ctx 40 block 16" in r.stdout and "prefill best TFLOP/s" in r.stdout
    assert "pagedllm: 1000 output tok/s" in r.stdout and "pagedllm/hf: output tok/s x4.00" in r.stdout
    assert "throughput-eager.json: missing" in r.stdout
    assert "decode ctx 40" in (out / "summary.txt").read_text()
