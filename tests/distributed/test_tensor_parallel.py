"""Tensor parallelism on CPU (gloo, 2 ranks): sharding, TP=2 == TP=1, supervision, clean-up."""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, EngineArgs, SamplingParams
from pagedllm.config import ModelConfig, ParallelConfig
from pagedllm.distributed.group import TPGroup, check_tp_size, shard_heads
from pagedllm.engine import LLMEngine
from pagedllm.executor.multiproc import WorkerFailure

REPO = Path(__file__).resolve().parents[2]
LP_TOL = 1e-4  # fp32: TP changes only the order of the o_proj / down_proj sums (seen: ~3e-6)
ENGINE = dict(block_size=4, num_kv_blocks=96, max_model_len=96)


def _state(pid: int) -> str | None:
    """Process state letter from /proc, None when it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return None


def _running(pid: int) -> bool:
    return _state(pid) not in (None, "Z", "X")


def _spawned_children() -> set[int]:
    """Live children of this process started by multiprocessing spawn (the resource tracker is not)."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"spawn_main" in cmd and fields[0] not in ("Z", "X"):
            out.add(int(d.name))
    return out


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_running(p) for p in pids):
        assert time.monotonic() < deadline, f"processes still running: {[p for p in pids if _running(p)]}"
        time.sleep(0.05)


def _prompts() -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": list(range(5 + 7 * i, 30 + 9 * i))} for i in range(5)]


# -- sharding arithmetic ----------------------------------------------------------------------------
def test_head_shards_cover_heads_and_replicate_kv_when_needed() -> None:
    # GQA 8 q / 4 kv heads over 2 ranks: disjoint halves
    assert [shard_heads(8, 4, TPGroup(r, 2)) for r in range(2)] == [
        dataclasses.replace(shard_heads(8, 4, None), num_heads=4, num_kv_heads=2),
        dataclasses.replace(shard_heads(8, 4, None), q_start=4, num_heads=4, kv_start=2, num_kv_heads=2),
    ]
    # 8 q / 2 kv heads over 4 ranks: each kv head kept by the two ranks whose q heads use it
    kv = [(s.kv_start, s.num_kv_heads) for s in (shard_heads(8, 2, TPGroup(r, 4)) for r in range(4))]
    assert kv == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match=r"tensor_parallel_size in \[1, 2, 4\]"):
        check_tp_size(4, 2, 128, 3)
    with pytest.raises(ValueError, match="intermediate_size=6"):
        check_tp_size(4, 4, 6, 4)


def test_each_rank_reads_only_its_slices(tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank shards put side by side are the unsharded weights; sharded tensors are read with
    get_slice, never whole."""
    import pagedllm.models.loader as loader
    from pagedllm.attention import get_backend

    whole: list[str] = []
    real_open = loader.safe_open

    class Recording:
        def __init__(self, *a: object, **k: object) -> None:
            self.f = real_open(*a, **k)

        def __enter__(self) -> Recording:
            self.f.__enter__()
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.__exit__(*exc)

        def keys(self) -> list[str]:
            return list(self.f.keys())

        def get_tensor(self, name: str) -> torch.Tensor:
            whole.append(name)
            return self.f.get_tensor(name)

        def get_slice(self, name: str) -> object:
            return self.f.get_slice(name)

    monkeypatch.setattr(loader, "safe_open", Recording)
    for arch in ("llama", "qwen2", "qwen3"):
        cfg = ModelConfig.from_hf(str(tiny_models[arch]))
        backend = get_backend(None, "cpu")
        full = loader.load_model(cfg, backend).state_dict()
        whole.clear()
        shards = [loader.load_model(cfg, backend, tp=TPGroup(r, 2)).state_dict() for r in range(2)]
        assert not [n for n in whole if n.rpartition(".")[0].endswith(("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "down_proj"))]
        attn = "model.layers.1.self_attn."
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for leaf in ("weight", "bias") if arch == "qwen2" else ("weight",):
            w = full[attn + "qkv_proj." + leaf]
            parts = [s[attn + "qkv_proj." + leaf] for s in shards]
            qs, ks, vs = zip(*(p.split([q // 2, kv // 2, kv // 2]) for p in parts))
            assert torch.equal(torch.cat([*qs, *ks, *vs]), w)
        assert torch.equal(torch.cat([s[attn + "o_proj.weight"] for s in shards], 1), full[attn + "o_proj.weight"])
        mlp = "model.layers.0.mlp."
        assert torch.equal(torch.cat([s[mlp + "down_proj.weight"] for s in shards], 1), full[mlp + "down_proj.weight"])
        i = cfg.intermediate_size // 2
        gates, ups = zip(*(s[mlp + "gate_up_proj.weight"].split([i, i]) for s in shards))
        assert torch.equal(torch.cat([*gates, *ups]), full[mlp + "gate_up_proj.weight"])
        assert all(torch.equal(s["model.embed_tokens.weight"], full["model.embed_tokens.weight"]) for s in shards)
        for norm in ("q_norm.weight", "k_norm.weight") if arch == "qwen3" else ():  # per head_dim: replicated
            assert all(torch.equal(s[attn + norm], full[attn + norm]) for s in shards)


# -- TP=2 generates what TP=1 does -------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", pytest.param("qwen2", marks=pytest.mark.slow),
                                  pytest.param("mistral", marks=pytest.mark.slow), "qwen3"])  # head_dim != hidden/heads; GQA + bias + tied; MQA; q/k norms
def test_tp2_greedy_matches_tp1(tiny_models: dict[str, Path], arch: str) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        llm = LLM(model=str(tiny_models[arch]), tensor_parallel_size=tp, **ENGINE)
        outs[tp] = llm.generate(_prompts(), sp, use_tqdm=False)
        if tp == 2:
            runner = llm.engine.executor
            kv = llm.engine.runner.kv_cache.storage.shape[-2]  # this rank's KV heads
            assert kv == max(1, ModelConfig.from_hf(str(tiny_models[arch])).num_key_value_heads // 2)
            assert runner.comm_stats.allreduce_calls == 2 * 2 * runner.comm_stats.steps  # 2 layers
            pids = [w.pid for w in runner.workers]
            assert all(_running(p) for p in pids)
            del llm, runner  # garbage collection stops the workers
            gc.collect()
            _wait_gone(pids, 15)
    assert len(outs[1]) == len(outs[2]) == len(_prompts())
    for a, b in zip(outs[1], outs[2], strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert len(ca.token_ids) == 12 and ca.token_ids == cb.token_ids
        assert len(ca.logprobs) == len(cb.logprobs) == 12
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for pa, pb, t in zip(ca.logprobs, cb.logprobs, ca.token_ids, strict=True):
            assert pa.keys() == pb.keys()
            assert abs(pa[t].logprob - pb[t].logprob) < LP_TOL
        for pa, pb in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert max(abs(pa[k].logprob - pb[k].logprob) for k in pa) < LP_TOL


@pytest.mark.slow
def test_tp2_block_moves_match_tp1(tiny_models: dict[str, Path]) -> None:
    """Swap preemption, copy-on-write (n=2), an elastic pool that grows and compacts: every KV block
    move reaches every rank, so outputs still match."""
    kw = dict(block_size=4, num_kv_blocks=28, initial_num_kv_blocks=12, grow_chunk=4,
              max_model_len=64, preemption_mode="swap", swap_space=0.002, compact_every_n_steps=3)
    sp = SamplingParams(n=2, temperature=0.0, max_tokens=14, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = LLM(model=str(tiny_models["qwen2"]), tensor_parallel_size=tp, **kw)
        outs = llm.generate(_prompts() * 2, sp, use_tqdm=False)
        eng = llm.engine
        results[tp] = [[c.token_ids for c in o.outputs] for o in outs]
        assert len(results[tp]) == 10 and all(len(c) == 14 for r in results[tp] for c in r)
        assert all(len(r) == 2 for r in results[tp])
        assert eng.num_preemptions > 0 and eng.memory.num_grows > 0 and eng.memory.num_compactions > 0
        assert eng.scheduler.preemptions_by_kind.get("swap", 0) > 0
        eng.shutdown()
    assert results[1] == results[2]


# -- supervision ------------------------------------------------------------------------------------
def _engine(model: Path, timeout_s: float = 120.0) -> LLMEngine:
    cfg = EngineArgs(model=str(model), tensor_parallel_size=2, **ENGINE).create_engine_config()
    return LLMEngine(dataclasses.replace(cfg, parallel=ParallelConfig(2, "mp", timeout_s)))


def _add_work(engine: LLMEngine) -> None:
    sp = SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True)
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}-{engine.get_num_unfinished_requests()}", p, sp)


def _step_until_failure(engine: LLMEngine, max_steps: int) -> WorkerFailure:
    """Step (adding work when idle) until the engine raises WorkerFailure, within max_steps."""
    with pytest.raises(WorkerFailure) as info:
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                _add_work(engine)
            engine.step()
    return info.value


def _warm(engine: LLMEngine) -> None:
    for i in range(3):
        engine.add_request(f"warm{i}", _prompts()[i], SamplingParams(max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()


@pytest.mark.parametrize("when", ["between-steps", pytest.param("inside-a-step", marks=pytest.mark.slow)])
def test_killed_worker_fails_the_engine_at_once_and_leaves_no_process(
        tiny_models: dict[str, Path], when: str) -> None:
    before = _spawned_children()
    engine = _engine(tiny_models["llama"])
    executor = engine.executor
    pid = executor.workers[0].pid
    assert pid in _spawned_children()
    _warm(engine)
    _add_work(engine)
    if when == "between-steps":  # and reaped: the pre-step health check must see it
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while executor.workers[0].exitcode() is None:
            assert time.monotonic() < deadline, "the killed worker was never reaped"
            time.sleep(0.02)
    else:  # after rank 0 sent the step to the worker, before rank 0's first all-reduce
        real_send = executor._send

        def send_then_kill(msg: tuple) -> None:
            real_send(msg)
            if msg[:2] == ("call", "run_step"):
                os.kill(pid, signal.SIGKILL)
                _wait_gone([pid], 10)

        executor._send = send_then_kill
    err = _step_until_failure(engine, max_steps=1)  # the very next step fails
    assert "rank 1" in str(err) and "SIGKILL" in str(err) and "Start a new engine" in str(err)
    # at once: a dead peer closes its sockets; the collective did not wait out timeout_s=120
    assert "timed out" not in str(err).lower() and "stopped answering" not in str(err)
    if when == "between-steps":  # seen by the health check before the step: no send or
        assert "Error" not in str(err)  # collective failed (BrokenPipeError, gloo's RuntimeError)
    assert not _running(pid) and _spawned_children() <= before
    with pytest.raises(WorkerFailure):
        engine.step()  # and again, without touching the dead group


@pytest.mark.slow  # ~15 s
def test_hung_worker_hits_the_collective_timeout(tiny_models: dict[str, Path]) -> None:
    engine = _engine(tiny_models["llama"], timeout_s=3)
    pid = engine.executor.workers[0].pid
    os.kill(pid, signal.SIGSTOP)  # alive but silent
    try:
        err = _step_until_failure(engine, max_steps=1)  # the first collective waits timeout_s
    finally:
        if _running(pid):
            os.kill(pid, signal.SIGKILL)
    assert "timeout" in str(err).lower()
    _wait_gone([pid], 5)


@pytest.mark.slow
def test_workers_exit_when_the_engine_process_dies(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(
        "import os, signal\n"
        "from pagedllm import LLM\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM(model={str(tiny_models['llama'])!r}, tensor_parallel_size=2, block_size=4,\n"
        "              num_kv_blocks=32, max_model_len=64)\n"
        "    print(llm.engine.executor.workers[0].pid, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "PAGEDLLM_LOG_LEVEL": "WARNING"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    _wait_gone([int(proc.stdout.split()[0])], 10)


# -- pagedllm serve --tensor-parallel-size 2 ---------------------------------------------------------
def _children_of(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.slow  # ~15 s
def test_serve_tp2_matches_tp1(tiny_models: dict[str, Path]) -> None:
    import httpx
    from serve_process import serve_process

    model = str(tiny_models["llama"])
    prompt = " ".join(f"t{i}" for i in range(20, 44))
    ref = LLM(model=model, **ENGINE).generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    with serve_process(model, "--tensor-parallel-size", "2", "--block-size", "4", "--num-kv-blocks", "96",
                       "--max-model-len", "96", "--log-level", "warning") as (proc, base):
        workers = [p for p in _children_of(proc.pid) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 1
        body = {"model": model, "prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 2,
                "ignore_eos": True}
        choice = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert len(ref.token_ids) == 10 and choice["text"].split() == ref.text.split()
        lps = choice["logprobs"]["token_logprobs"]
        assert len(lps) == 10
        assert max(abs(a - b[t].logprob)
                   for a, b, t in zip(lps, ref.logprobs, ref.token_ids, strict=True)) < LP_TOL
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        _wait_gone(workers, 10)


# -- Ray ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ray_backend_tp2_matches_tp1(tiny_models: dict[str, Path]) -> None:
    ray = pytest.importorskip("ray")
    model = str(tiny_models["qwen2"])
    sp = SamplingParams(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
    ref = LLM(model=model, **ENGINE).generate(_prompts(), sp, use_tqdm=False)
    ray.init(num_cpus=2, include_dashboard=False)
    try:
        llm = LLM(model=model, tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
        assert "Ray actor" in llm.engine.executor.workers[0].describe()
        outs = llm.generate(_prompts(), sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        llm.engine.shutdown()
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_default_model_tp2_matches_tp1() -> None:
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, logprobs=1)
    outs = {tp: LLM(tensor_parallel_size=tp, max_model_len=256, dtype="float32").generate(prompts, sp, use_tqdm=False)
            for tp in (1, 2)}
    assert len(outs[1]) == len(outs[2]) == len(prompts)
    for a, b in zip(outs[1], outs[2], strict=True):
        assert len(a.outputs[0].token_ids) > 0
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        lps = zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids, strict=True)
        assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in lps) < LP_TOL
