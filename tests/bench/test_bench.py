"""The bench subcommands run end to end at tiny sizes and write the documented JSON; the
contiguous baseline really reserves max_model_len per request and matches paged outputs.
No timing assertions (speed targets live in the benchmarks themselves)."""

from __future__ import annotations

import json
import math
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_helpers import ServerThread, scrape

from pagedllm.bench.contiguous import ContiguousScheduler
from pagedllm.bench.probe import replay
from pagedllm.bench.report import format_table, percentiles
from pagedllm.bench.workload import (
    BenchRequest,
    WorkloadSpec,
    engine_config,
    load_trace,
    make_workload,
    poisson_arrivals,
    write_trace,
)
from pagedllm.entrypoints.cli import main
from pagedllm.sched import Scheduler

MML = 64  # max_model_len for every engine here
SMALL = ["--num-prompts", "6", "--prompt-median", "8", "--output-median", "6",
         "--max-model-len", str(MML), "--block-size", "4", "--max-num-seqs", "8", "--no-plot"]


@pytest.fixture(scope="module")
def model(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["llama"]  # tests/conftest.py: random weights, GQA, word tokenizer


def _engine_kwargs(model: Path, **kw: object) -> dict:
    return dict(model=str(model), block_size=4, max_model_len=MML, max_num_seqs=8, **kw)


def _reqs(n: int = 6, seed: int = 0) -> list[BenchRequest]:
    spec = WorkloadSpec(num_prompts=n, seed=seed, max_model_len=MML, prompt_median=8,
                        output_median=6)
    return make_workload(spec, list(range(4, 500)))


# -- workloads ------------------------------------------------------------------------------
def test_workloads_are_seeded_and_fit() -> None:
    vocab = list(range(10, 100))
    for kind in ("longtail", "fixed", "chat"):
        spec = WorkloadSpec(kind=kind, num_prompts=20, seed=3, max_model_len=256, input_len=20,
                            output_len=10, system_len=16, user_len=8, turns=3)
        a, b = make_workload(spec, vocab), make_workload(spec, vocab)
        assert a == b and len(a) == 20
        assert all(r.prompt_len + r.max_tokens <= 256 and r.max_tokens >= 1 for r in a)
        assert all(set(r.prompt_token_ids) <= set(vocab) for r in a)
    other = make_workload(WorkloadSpec(num_prompts=20, seed=4, max_model_len=256), vocab)
    assert other != make_workload(WorkloadSpec(num_prompts=20, seed=3, max_model_len=256), vocab)
    chat = make_workload(WorkloadSpec(kind="chat", num_prompts=6, max_model_len=256, system_len=16,
                                      user_len=8, turns=3, output_len=10), vocab)
    system = chat[0].prompt_token_ids[:16]
    assert all(r.prompt_token_ids[:16] == system for r in chat)
    # turn 2 of a conversation extends its turn 1 prompt (a prefix-cache hit)
    convs = 2
    assert chat[convs].prompt_token_ids[:24] == chat[0].prompt_token_ids


def test_trace_and_arrivals(tmp_path: Path) -> None:
    class Tok:
        def encode(self, text: str) -> list[int]:
            return [len(w) for w in text.split()]

    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt_token_ids": [5, 6, 7], "max_tokens": 4, "arrival_time": 0.5}\n\n'
                 '{"prompt": "ab cde", "max_tokens": 2}\n')
    reqs = load_trace(f, Tok())
    assert reqs == [BenchRequest([5, 6, 7], 4, 0.5), BenchRequest([2, 3], 2, None, "ab cde")]
    t = poisson_arrivals(50, 10.0, seed=1)
    assert t == sorted(t) and t == poisson_arrivals(50, 10.0, seed=1)
    assert poisson_arrivals(3, math.inf, 0) == [0.0, 0.0, 0.0]


def test_a_recorded_trace_reads_back_and_bad_outputs_are_refused(tmp_path: Path) -> None:
    """``write_trace`` / ``load_trace``: n and each sequence's tokens survive the round trip; a
    flat list is one sequence; anything else is refused with the line named."""
    reqs = [BenchRequest([5, 6], 3, 0.25, n=2, output_token_ids=[[1, 2, 3], [4, 5]]),
            BenchRequest([7], 1, output_token_ids=[[9]])]
    f = tmp_path / "t.jsonl"
    write_trace(f, reqs, [r.output_token_ids for r in reqs])  # type: ignore[misc]
    assert load_trace(f) == reqs
    f.write_text('{"prompt_token_ids": [5], "max_tokens": 2, "output_token_ids": [8, 9]}\n')
    assert load_trace(f)[0].output_token_ids == [[8, 9]]
    f.write_text('{"prompt_token_ids": [5], "max_tokens": 2, "output_token_ids": "ab"}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:1: 'output_token_ids' must be a list"):
        load_trace(f)


def test_record_trace_without_an_engine_backend_fails_before_running(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # type: ignore[type-arg]
    assert main(["bench", "throughput", "--backends", "hf", "--record-trace", str(tmp_path / "t"),
                 "--output-dir", str(tmp_path), *SMALL]) == 2
    assert "--record-trace needs a pagedllm backend" in capsys.readouterr().err
    assert not (tmp_path / "t").exists() and not list(tmp_path.glob("*.json"))  # nothing ran


def test_the_spec_gives_the_arrivals() -> None:
    reqs = [BenchRequest([5], 1, 0.5), BenchRequest([6], 1, None)]
    assert WorkloadSpec().arrivals(reqs) == [0.5, 0.0]  # unset rate: the trace's, else 0
    assert WorkloadSpec(request_rate=math.inf).arrivals(reqs) == [0.0, 0.0]
    assert WorkloadSpec(seed=1, request_rate=10.0).arrivals(reqs) == poisson_arrivals(2, 10.0, 1)


def test_the_workload_flags_are_the_spec_fields() -> None:
    """``WorkloadSpec.add_cli_args`` makes one flag per spec field with help; ``cli_kwargs``
    reads them back, so a field added to the spec is a flag of every command that takes one."""
    import argparse

    p = argparse.ArgumentParser()
    WorkloadSpec.add_cli_args(p, 7, arrivals=True)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args(["--workload", "chat", "--turns", "2", "--request-rate", "3", "--seed", "5"])
    spec = WorkloadSpec(**WorkloadSpec.cli_kwargs(ns))
    assert (spec.kind, spec.turns, spec.request_rate, spec.seed, spec.num_prompts) == \
        ("chat", 2, 3.0, 5, 7)
    plain = argparse.ArgumentParser()
    WorkloadSpec.add_cli_args(plain, 7)
    with pytest.raises(SystemExit):  # offline commands take no arrivals
        plain.parse_args(["--request-rate", "3"])


def test_every_bench_subcommand_is_a_module_with_its_own_flags() -> None:
    """``bench/cli.py`` registers ``pagedllm.bench.<module>`` for each subcommand (``COMMAND``,
    ``HELP``, ``add_cli_args``, ``run``), and building the parser imports no torch."""
    import importlib
    import os
    import subprocess
    import sys

    from pagedllm.bench.cli import SUBCOMMANDS

    for name in SUBCOMMANDS:
        mod = importlib.import_module(f"pagedllm.bench.{name}")
        assert callable(mod.add_cli_args) and callable(mod.run) and mod.COMMAND and mod.HELP
    code = ("import sys; from pagedllm.entrypoints.cli import build_parser; build_parser(); "
            "assert 'torch' not in sys.modules, 'building the CLI imported torch'")
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0, res.stderr


def test_report_helpers() -> None:
    p = percentiles([1.0, 2.0, 3.0, 4.0])
    assert p["mean"] == 2.5 and p["p50"] == 2.5 and p["p99"] == pytest.approx(3.97)
    table = format_table([{"a": 1, "b": 0.123456}], ["a", "b"])
    assert "0.1235" in table.splitlines()[2]


# -- the contiguous baseline ------------------------------------------------------------------
def test_contiguous_reserves_max_model_len_and_batches_statically(model: Path) -> None:
    from pagedllm.engine import LLMEngine
    from pagedllm.sampling_params import SamplingParams

    class Checked(ContiguousScheduler):
        """Logs (running ids, blocks held, table lengths) right after each schedule()."""

        log: list[tuple[set[str], int, set[int]]] = []

        def schedule(self, proposals=None):  # type: ignore[no-untyped-def]
            out = super().schedule(proposals)
            ids = {r.request_id for r in self.running}
            held = self.kv.num_blocks - self.kv.num_free_blocks
            self.log.append((ids, held, {len(self.kv.block_table(i)) for i in ids}))
            return out

    eng = LLMEngine.from_args(scheduler_cls=Checked,
                              **_engine_kwargs(model, num_kv_blocks=3 * MML // 4 + 2))
    per_req = -(-MML // 4)
    for i, r in enumerate(_reqs(7)):
        eng.add_request(f"r{i}", {"prompt_token_ids": r.prompt_token_ids},
                        SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_integrity()
    batches = []
    prev: set[str] = set()
    for running, held, table_lens in Checked.log:
        assert held == per_req * len(running)  # a full max_model_len reservation each
        assert table_lens <= {per_req}
        if not running <= prev:  # a new batch only once the previous one is gone entirely
            assert not running & prev
            batches.append(running)
        prev = running
    assert [len(b) for b in batches] == [3, 3, 1]  # the pool holds 3 reservations
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_contiguous_greedy_outputs_equal_paged(model: Path) -> None:
    from pagedllm.bench.baselines import EngineBackend

    reqs = _reqs(6, seed=5)
    paged = EngineBackend("pagedllm", _engine_kwargs(model), "paged").run(reqs)
    cont = EngineBackend("contiguous", _engine_kwargs(model, num_kv_blocks=2 * MML // 4),
                         "contiguous").run(reqs)
    assert paged.outputs == cont.outputs
    assert [len(o) for o in paged.outputs] == [r.max_tokens for r in reqs]
    assert cont.stats["peak_running"] == 2


def test_memory_replay_paged_admits_more(model: Path) -> None:
    reqs = _reqs(16)
    nb = 4 * MML // 4  # four full reservations
    cfg = engine_config({**_engine_kwargs(model), "max_num_seqs": 16,
                         "max_num_batched_tokens": 256, "num_kv_blocks": nb})
    paged = replay(reqs, Scheduler, cfg)
    cont = replay(reqs, ContiguousScheduler, cfg)
    assert cont.summary()["peak_running"] == 4
    # paged: the 16 requests' real lengths (232 tokens) fit the 256-token pool all at once
    assert paged.summary()["peak_running"] == 16
    assert paged.summary()["steps"] < cont.summary()["steps"]
    assert paged.summary()["kv_utilization"] > cont.summary()["kv_utilization"]
    assert all(0 < u <= 1 for u in paged.utilization if u)


# -- the subcommands, end to end ------------------------------------------------------------
def _run(argv: list[str], path: Path) -> dict:
    assert main(argv) == 0
    return json.loads(path.read_text())


def test_bench_throughput_cli(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    res = _run(["bench", "throughput", "--model", str(model), "--backends",
                "pagedllm,hf,contiguous", "--reps", "1", "--warmup", "1", "--hf-batch-size", "4",
                "--output-dir", str(tmp_path), "--output-json", str(out), *SMALL], out)
    assert [r["backend"] for r in res["results"]] == ["pagedllm", "hf", "contiguous"]
    assert (res["device"], res["device_name"], res["engine"]["device"]) == ("cpu", None, "cpu")
    for r in res["results"]:
        for k in ("requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
            assert r[k] > 0
        assert r["output_tokens"] == res["workload"]["output_tokens"]
    assert set(res["ratios"]) == {"pagedllm/hf", "pagedllm/contiguous"}
    by = {r["backend"]: r for r in res["results"]}
    for name in ("pagedllm", "contiguous"):  # CPU time of the engine's process, all threads
        assert by[name]["cpu_s"] > 0 and by[name]["output_tokens_per_cpu_s"] > 0
        assert isinstance(by[name]["minor_faults"], int) and by[name]["minor_faults"] >= 0
    assert res["ratios"]["pagedllm/contiguous"]["output_tokens_per_cpu_s"] > 0
    assert res["greedy_output_agreement"]["pagedllm/contiguous"] == 1.0
    assert main(["bench", "throughput", "--backends", "nope", "--model", str(model)]) == 2


def test_bench_throughput_variants(model: Path, tmp_path: Path) -> None:
    """pagedllm[name=value,...] runs the engine with those settings, interleaved, as its own row."""
    out = tmp_path / "tp.json"
    variant = "pagedllm[max_num_seqs=2,fused_ops=false,enable-prefix-caching=false]"
    res = _run(["bench", "throughput", "--model", str(model), "--backends", f"pagedllm,{variant}",
                "--reps", "1", "--warmup", "1", "--output-dir", str(tmp_path),
                "--output-json", str(out), *SMALL], out)
    rows = {r["backend"]: r for r in res["results"]}
    assert list(rows) == ["pagedllm", variant]
    assert rows[variant]["peak_running"] <= 2 < rows["pagedllm"]["peak_running"]
    assert res["greedy_output_agreement"][f"pagedllm/{variant}"] == 1.0
    for bad in ("pagedllm[max_num_sqs=2]", "hf[max_num_seqs=2]", "pagedllm[max_num_seqs]"):
        assert main(["bench", "throughput", "--backends", bad, "--model", str(model)]) == 2


def test_bench_memory_cli(model: Path, tmp_path: Path) -> None:
    for mode in ("real", "replay"):
        out = tmp_path / f"mem-{mode}.json"
        res = _run(["bench", "memory", "--mode", mode, "--model", str(model), "--full-requests",
                    "2", "--output-dir", str(tmp_path), "--output-json", str(out), *SMALL], out)
        by = {r["policy"]: r for r in res["results"]}
        # paged runs all 6 short requests at once in the pool of 2 full-length reservations
        assert by["paged"]["peak_running"] == 6 and by["contiguous"]["peak_running"] == 2
        assert res["num_kv_blocks"] == 2 * MML // 4
        assert set(res["series"]["paged"]) == {"t", "running", "live", "reserved", "pool",
                                                 "utilization"}
        assert 0 < by["paged"]["kv_utilization"] <= 1


def test_bench_memory_sliding_window_ring_vs_all_blocks(make_model: Any, tmp_path: Path) -> None:
    windowed = make_model("mistral", sliding_window=8)
    for mode in ("replay", "real"):
        out = tmp_path / f"mem-window-{mode}.json"
        res = _run(["bench", "memory", "--mode", mode, "--model", str(windowed), "--workload",
                    "fixed", "--input-len", "6", "--output-len", "48", "--full-requests", "2",
                    "--output-dir", str(tmp_path), "--output-json", str(out),
                    *SMALL[:2], *SMALL[6:]], out)
        by = {r["policy"]: r for r in res["results"]}
        assert set(by) == {"paged", "paged, all blocks", "contiguous"}
        assert by["paged"]["mean_running"] > by["paged, all blocks"]["mean_running"]
        assert res["ratios"]["window_mean_running"] > 1
        assert 0 < by["paged"]["kv_utilization"] <= 1


def test_bench_block_size_cli(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "bs.json"
    res = _run(["bench", "block-size", "--model", str(model), "--block-sizes", "1,4,64",
                "--reps", "1", "--output-dir", str(tmp_path), "--output-json", str(out),
                *SMALL], out)
    assert [r["block_size"] for r in res["results"]] == [1, 4, 64]
    assert res["best_block_size"] in (1, 4, 64)
    r1 = res["results"][0]
    assert r1["kv_utilization"] == 1.0 and r1["internal_fragmentation"] == 0.0
    for r in res["results"]:
        assert r["num_blocks"] * r["block_size"] == res["budget_tokens"]
        assert r["prepare_ms_per_step"] > 0 and r["attention_ms_per_step"] > 0


def test_bench_kernel_cli(tmp_path: Path) -> None:
    out = tmp_path / "k.json"
    res = _run(["bench", "kernel", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
                "--contexts", "8,33", "--block-sizes", "1,16", "--batch", "3", "--rounds", "1",
                "--iters", "1", "--no-plot", "--output-dir", str(tmp_path), "--output-json",
                str(out)], out)
    assert len(res["results"]) == 2 * 2 * 2
    assert set(res["summary"]) == {"decode", "prefill"}
    assert all(r["paged_ms"] > 0 and r["contiguous_ms"] > 0 for r in res["results"])


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_bench_kernel_quantized_kv(tmp_path: Path, kv: str) -> None:
    """--kv-cache-dtype: the paged side reads the quantized pool, the contiguous SDPA its values
    dequantized; the case's own agreement check passes (it raises otherwise), and the bytes a
    decode reads are 1 per element plus the bf16 scale per row."""
    out = tmp_path / "k.json"
    res = _run(["bench", "kernel", "--num-heads", "4", "--num-kv-heads", "2", "--head-dim", "16",
                "--contexts", "8,33", "--block-sizes", "16", "--batch", "3", "--rounds", "1",
                "--iters", "1", "--no-plot", "--kv-cache-dtype", kv, "--output-dir",
                str(tmp_path), "--output-json", str(out)], out)
    assert res["shape"]["kv_cache_dtype"] == {"int8": "int8", "fp8": "fp8_e4m3"}[kv]
    assert len(res["results"]) == 2 * 2
    decode = [r for r in res["results"] if r["phase"] == "decode"]
    assert [r["kv_bytes"] for r in decode] == [2 * 3 * c * 2 * 16 * (1 + 2 / 16) for c in (8, 33)]
    assert all(r["max_abs_diff"] < 1e-3 for r in res["results"])


@pytest.fixture(scope="module")
def live_server(model: Path) -> Iterator[ServerThread]:
    """The real OpenAI server (uvicorn + the in-process EngineClient) in-process on a loopback port."""
    from pagedllm.engine import LLMEngine
    from pagedllm.server.api import ServerLimits, build_app

    engine = LLMEngine.from_args(**_engine_kwargs(model, num_kv_blocks=128))
    with ServerThread(build_app(engine, model_name="tiny-bench", limits=ServerLimits())) as s:
        yield s


def test_bench_serve_cli_against_the_real_server(model: Path, tmp_path: Path,
                                                 live_server: ServerThread) -> None:
    out = tmp_path / "serve.json"
    before = scrape(live_server)
    res = _run(["bench", "serve", "--base-url", live_server.base_url, "--model", str(model),
                "--request-rate", "200", "--max-concurrency", "3", "--num-prompts", "5",
                "--prompt-median", "8", "--output-median", "6", "--max-model-len", str(MML),
                "--slo-ttft-ms", "600000", "--no-plot", "--output-dir", str(tmp_path),
                "--output-json", str(out)], out)
    assert res["completed"] == 5 and res["failed"] == 0
    assert res["model"] == "tiny-bench"  # from the server's /v1/models
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(res[m]) == {"mean", "p50", "p90", "p99"}
    assert res["output_throughput"] > 0 and res["goodput"] == pytest.approx(res["request_throughput"])
    assert sum(r["output_tokens"] for r in res["per_request"]) == res["workload"]["output_tokens"]
    # the server really ran the workload: its own counters moved by exactly the workload's tokens
    live_server.wait_idle()
    after = scrape(live_server)
    for name, key in (("prompt_tokens_total", "prompt_tokens"),
                      ("generation_tokens_total", "output_tokens")):
        moved = after[f"pagedllm:{name}"] - before.get(f"pagedllm:{name}", 0)
        assert moved == res["workload"][key], name


def test_random_model_cli(model: Path, tmp_path: Path) -> None:
    from pagedllm.config import ModelConfig

    out = tmp_path / "rm"
    assert main(["bench", "random-model", str(out), "--preset", "tiny", "--tokenizer",
                 str(model)]) == 0
    cfg = ModelConfig.from_hf(str(out))
    assert cfg.num_hidden_layers == 2 and cfg.num_key_value_heads == 2
    assert (out / "tokenizer.json").is_file()


def test_bench_serve_without_a_server_says_what_to_do(model: Path, capsys: pytest.CaptureFixture) -> None:
    with socket.socket() as held:  # bound, never listening: connections are refused, and no
        held.bind(("127.0.0.1", 0))  # other process can take the port while the test runs
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        assert main(["bench", "serve", "--base-url", url, "--model", str(model),
                     "--num-prompts", "1", "--max-model-len", str(MML), "--no-plot"]) == 2
    assert "start `pagedllm serve` first" in capsys.readouterr().err


def test_bench_prefix_cli(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "prefix.json"
    res = _run(["bench", "prefix", "--model", str(model), "--reps", "2", "--warmup", "1",
                "--num-prompts", "8", "--system-len", "16", "--user-len", "4", "--turns", "2",
                "--output-len", "4", "--max-model-len", str(MML), "--block-size", "4",
                "--max-num-seqs", "8", "--max-num-batched-tokens", "24", "--no-plot", "--output-dir", str(tmp_path),
                "--output-json", str(out)], out)
    assert res["benchmark"] == "prefix" and res["workload"]["kind"] == "chat"
    on, off = res["results"]
    assert (on["prefix_caching"], off["prefix_caching"]) == ("on", "off")
    for r in (on, off):
        for k in ("ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "computed_prompt_tokens",
                  "prompt_tokens", "prefix_cache_hit_rate", "requests_per_s",
                  "output_tokens_per_s"):
            assert k in r
        assert r["ttft_mean_ms"] > 0 and r["requests_per_s"] > 0
        assert r["prompt_tokens"] == res["workload"]["prompt_tokens"]
    assert off["computed_prompt_tokens"] == off["prompt_tokens"]  # nothing cached: all computed
    assert on["computed_prompt_tokens"] < off["computed_prompt_tokens"]
    assert on["prefix_cache_hit_rate"] > 0 == off["prefix_cache_hit_rate"]
    assert res["greedy_output_agreement"] == 1.0
    assert set(res["ratios"]) >= {"ttft_mean_off/on", "computed_prompt_tokens_on/off"}


def test_bench_kv_quant_cli(model: Path, tmp_path: Path) -> None:
    """The KV-quantization eval runs end to end and its numbers are consistent."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{4 + (i * 7) % 300}" for i in range(400)))
    out = tmp_path / "q.json"
    assert main(["bench", "kv-quant", "--model", str(model), "--text", str(text), "--windows", "2",
                 "--window-len", "32", "--greedy", "2", "--greedy-tokens", "4", "--json", str(out)]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    assert set(rows) >= {"auto", "int8", "K auto + V int8", "fp8_e4m3"}
    ref, q = rows["auto"], rows["int8"]
    # random weights, 62 teacher-forced positions: int8 measured 61 / 62 = 98.4 % (one near-tie
    # flip); the bound allows two more. The shipped model's figure is the slow test below.
    assert ref["top1_agreement"] == 1.0 and q["top1_agreement"] >= 0.95
    assert q["kv_bytes_per_token"] < ref["kv_bytes_per_token"] and q["tokens_in_budget"] > ref["tokens_in_budget"]


@pytest.mark.slow  # ~30 s: eight KV layouts on the shipped model
def test_kv_quant_on_the_shipped_model_holds_the_readme_figures(tmp_path: Path) -> None:
    """README: int8 keeps 99.6 % top-1 agreement (32 x 384 positions) and the perplexity. Here
    4 x 128 held-out positions; measured int8 99.41 %, K or V alone 99.41 %, fp8_e4m3 97.24 %,
    |Δppl| <= 0.11 %, mean |Δlogprob| int8 0.0050. Bounds: a few near-tie flips of margin."""
    out = tmp_path / "q.json"
    assert main(["bench", "kv-quant", "--windows", "4", "--window-len", "128", "--greedy", "2",
                 "--greedy-tokens", "8", "--json", str(out)]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    assert rows["auto"]["top1_agreement"] == 1.0
    for label in ("int8", "K auto + V int8", "K int8 + V auto"):
        assert rows[label]["top1_agreement"] >= 0.98, label
        assert abs(rows[label]["ppl_change_pct"]) < 0.5, label
    assert rows["int8"]["mean_abs_dlogprob"] < 0.01
    assert rows["fp8_e4m3"]["top1_agreement"] >= 0.95


def test_bench_linear_cli(model: Path, tmp_path: Path) -> None:
    import torch

    from pagedllm.bench.linear import layer_kinds
    from pagedllm.config import ModelConfig
    from pagedllm.layers.linear import gemm_runs, onednn_dtypes

    out = tmp_path / "linear.json"
    res = _run(["bench", "linear", "--model", str(model), "--warmup", "1", "--output-dir",
                str(tmp_path), "--output-json", str(out), *SMALL], out)
    kinds = set(layer_kinds(ModelConfig.from_hf(str(model))).values())
    rows = {r["layer"]: r for r in res["results"]}
    assert set(rows) == kinds | {"all linears"}
    everything = rows.pop("all linears")
    assert everything["calls"] == sum(r["calls"] for r in rows.values())
    assert everything["calls"] % 9 == 0  # 2 layers x 4 linears, 1 lm_head: every step runs all
    for r in [everything, *rows.values()]:
        assert r["engine_total_s"] > 0 and r["efficiency"] > 0 and r["onednn_alone_gflops"] > 0
    # the tiny model's widths are multiples of 32: every layer on pagedllm's GEMM where it runs
    want = "gemm" if gemm_runs(torch.empty(32, 1)) else "onednn" if onednn_dtypes() else "torch"
    assert res["engine_paths"] == [want]
    if want == "gemm":
        assert all(r["gemm_alone_gflops"] > 0 for r in [everything, *rows.values()])
    assert 0 < res["linear_share_of_run"] < 1
    # the peak FMA rate at the kernels' ISA, and every kind's share of it
    assert res["isa"] == res["machine"]["pagedllm_isa"] and res["fma_peak_gflops"] > 0
    assert all(0 < r["of_peak"] < 1.5 for r in [everything, *rows.values()])
    # the memory read rate, and every kind's time at the roofline over its time (above 1 only
    # where weights come from cache, faster than the read rate: a tiny model's can)
    assert res["read_bandwidth_gbps"] > 0
    assert all(0 < r["of_roofline"] < float("inf") for r in [everything, *rows.values()])
    from pagedllm import kernels

    assert res["machine"]["cpu_flags"] == " ".join(sorted(kernels.cpu_flags()))
