"""The offline inspector (``python -m pagedllm.kv.trace FILE --html OUT``): every frame of the
timeline, rebuilt from its deltas, equals the live engine's KV manager pictured after that step;
the counts charted equal the frame's; the page carries the data and no prompt tokens."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest

from pagedllm import SamplingParams
from pagedllm.engine import LLMEngine
from pagedllm.kv.snapshot import capture_kv, count_states
from pagedllm.kv.trace import build_timeline, main

SNAPSHOT_KEYS = ("blocks", "refs", "host", "tables", "host_tables", "prefix")


def apply_delta(s: dict[str, Any], d: dict[str, Any]) -> None:
    """The delta format of ``kv/timeline.py``, restated (the page's applyDelta does the same)."""
    if "blocks" in d:
        if isinstance(d["blocks"], str):
            s["blocks"] = d["blocks"]
        else:
            chars = list(s["blocks"])
            for i, c in d["blocks"]:
                chars[i] = c
            s["blocks"] = "".join(chars)
    for key in ("refs", "host"):
        if key in d:
            s[key] = d[key]
    for key in ("tables", "host_tables"):
        for rid, table in d.get(key, {}).items():
            if table is None:
                del s[key][rid]
            else:
                s[key][rid] = table
    prefix = {n[0]: n for n in s["prefix"]}
    for block, node in d.get("prefix", {}).items():
        if node is None:
            del prefix[int(block)]
        else:
            prefix[int(block)] = node
    s["prefix"] = list(prefix.values())


def _json(snap: dict[str, Any]) -> dict[str, Any]:
    """A snapshot as the page sees it (JSON keys are strings), prefix nodes by block."""
    s = json.loads(json.dumps({k: snap[k] for k in SNAPSHOT_KEYS}))
    s["prefix"] = sorted(s["prefix"])
    return s


def run_traced(model: Path, trace: Path) -> tuple[LLMEngine, dict[int, dict[str, Any]]]:
    """A swapping, prefix-sharing, forking run of the tiny model, traced; the KV manager
    pictured after every step, by step number."""
    engine = LLMEngine.from_args(
        model=str(model), block_size=4, num_kv_blocks=40, max_model_len=128,
        max_num_batched_tokens=48, reserved_fraction=0.0, kv_trace_path=str(trace),
        preemption_mode="swap", swap_space=0.002)
    rng = random.Random(0)
    system = [rng.randrange(4, 512) for _ in range(12)]
    for i in range(10):
        prompt = system + [rng.randrange(4, 512) for _ in range(rng.randrange(3, 20))]
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(
            n=2 if i % 4 == 0 else 1, temperature=1.0, seed=i, max_tokens=20, ignore_eos=True))
    after: dict[int, dict[str, Any]] = {0: capture_kv(engine.kv)}
    while engine.has_unfinished_requests():
        engine.step()
        after[engine.scheduler.num_steps] = capture_kv(engine.kv)
    return engine, after


@pytest.fixture(scope="module")
def traced(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    trace = tmp_path_factory.mktemp("timeline") / "kv.jsonl"
    engine, after = run_traced(tiny_models["llama"], trace)
    assert engine.num_preemptions > 0
    return trace, engine, after


def test_every_frame_equals_the_engine_after_its_step(traced: Any) -> None:
    trace, engine, after = traced
    data, final = build_timeline(trace)
    frames = data["frames"]
    assert frames[0]["step"] == 0 and len(frames) == len(data["history"])
    s = copy.deepcopy(data["first"])
    assert _json(s) == _json(after[0])
    states_seen: set[str] = set()
    for k, frame in enumerate(frames):
        if k:
            apply_delta(s, frame["d"])
        assert _json(s) == _json(after[frame["step"]]), f"frame {k} (step {frame['step']})"
        c = count_states(s)
        assert data["history"][k][:6] == [frame["step"], c["num_blocks"], c["used_blocks"],
                                          c["cached_blocks"], c["shared_blocks"],
                                          c["host_used_blocks"]]
        states_seen |= set(s["blocks"]) | set(s["host"])
    assert {".", "c", "u", "h", "s", "w"} <= states_seen  # every state shown at some step
    steps = [f["step"] for f in frames]
    assert steps == sorted(set(steps)) and steps[-1] == engine.scheduler.num_steps
    assert _json(capture_kv(final)) == _json(after[steps[-1]])
    for frame in frames:
        assert all("tokens" not in op and "hashes" not in op for op in frame["ops"])


def test_html_command_writes_the_page_with_the_timeline(traced: Any, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    trace = traced[0]
    out = tmp_path / "kv.html"
    assert main([str(trace), "--html", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    html = out.read_text()
    data, _ = build_timeline(trace)
    start = html.index("const DATA = ") + len("const DATA = ")
    embedded = json.JSONDecoder().raw_decode(html[start:])[0]
    assert embedded == json.loads(json.dumps(data))
    assert "http://" not in html.replace("http://www.w3.org/2000/svg", "")
