"""The OpenAI server over two replicas: ``/metrics`` has every replica's series under
``engine="i"`` (prompt tokens, computed prefill tokens, prefix-cache queries and hits, gauges),
and once a replica dies ``/health`` says "degraded" while the other serves on."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import pytest
from dp_helpers import PROMPTS, engine_args
from server_helpers import ServerThread

from pagedllm.args import EngineArgs
from pagedllm.entrypoints.cli import build_parser
from pagedllm.router.client import DPClient
from pagedllm.server.api import build_app
from pagedllm.server.args import ServerArgs


def _series(base: str) -> dict[tuple[str, str], float]:
    """/metrics as {(name, engine label): value}, summed over the other labels."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith("#") or 'engine="' not in line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        engine = name_labels.split('engine="', 1)[1].split('"', 1)[0]
        key = (name_labels.split("{", 1)[0], engine)
        out[key] = out.get(key, 0.0) + float(value)
    return out


def test_metrics_per_replica_and_a_degraded_health() -> None:
    dp = DPClient(engine_args(), size=2, policy="round_robin", num_threads=1)
    with ServerThread(build_app(dp, model_name="m")) as s:
        for p in PROMPTS[:4]:  # round robin: two on each replica
            r = httpx.post(s.base_url + "/v1/completions", json={
                "model": "m", "prompt": p, "max_tokens": 4, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        m = _series(s.base_url)
        for e in ("0", "1"):
            assert m[("pagedllm:prompt_tokens_total", e)] > 0
            assert m[("pagedllm:computed_prefill_tokens_total", e)] > 0
            assert m[("pagedllm:generation_tokens_total", e)] == 8
            assert m[("pagedllm:prefix_cache_queries_total", e)] > 0
            assert ("pagedllm:prefix_cache_hits_total", e) in m
            assert m[("pagedllm:num_requests_running", e)] == 0
        # PROMPTS[2] shares the system prompt of PROMPTS[0] on replica 0: a prefix-cache hit
        assert m[("pagedllm:prefix_cache_hits_total", "0")] > 0
        assert httpx.get(s.base_url + "/health").json() == {"status": "ok"}

        # a client that goes away: its replica (round robin: 0) aborts it and frees its blocks
        with httpx.stream("POST", s.base_url + "/v1/completions", json={
                "model": "m", "prompt": PROMPTS[5], "max_tokens": 400, "ignore_eos": True,
                "stream": True}, timeout=60) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 10
        while (m := _series(s.base_url))[("pagedllm:num_requests_running", "0")] or m[
                ("pagedllm:kv_cache_usage_perc", "0")]:
            assert time.monotonic() < deadline, "replica 0 still runs the request of a gone client"
            time.sleep(0.05)
        assert 8 < m[("pagedllm:generation_tokens_total", "0")] < 8 + 400
        assert m[("pagedllm:generation_tokens_total", "1")] == 8

        gen0 = m[("pagedllm:generation_tokens_total", "0")]
        dp.replicas[1].link.kill()  # type: ignore[attr-defined]
        deadline = time.monotonic() + 10
        while (h := httpx.get(s.base_url + "/health")).json()["status"] == "ok":
            assert time.monotonic() < deadline, "/health still ok 10 s after a replica died"
            time.sleep(0.05)
        assert h.status_code == 200 and h.json() == {
            "status": "degraded", "detail": "engine replica 1 of 2 down; 1 serving"}
        for p in PROMPTS[:2]:
            r = httpx.post(s.base_url + "/v1/completions", json={
                "model": "m", "prompt": p, "max_tokens": 4, "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
        m = _series(s.base_url)
        assert ("pagedllm:num_requests_running", "1") not in m  # out of the gauges
        assert m[("pagedllm:generation_tokens_total", "0")] == gen0 + 8


def _serve_args(*argv: str) -> tuple[ServerArgs, EngineArgs]:
    ns = build_parser().parse_args(["serve", *argv])
    return ServerArgs.from_cli(ns), EngineArgs.from_cli(ns)


def test_the_serve_flags_build_the_replicas() -> None:
    from pagedllm.engine.client_mp import MPClient
    from pagedllm.server.cli import make_engine

    srv, eng = _serve_args("-dp", "3", "--routing-policy", "least_load",
                           "--data-parallel-threads", "1", "--num-kv-blocks", "64")
    dp = make_engine(srv, eng, eng.create_engine_config())
    assert isinstance(dp, DPClient) and len(dp.replicas) == 3 and dp.policy.name == "least_load"
    assert [r.link.options.num_threads for r in dp.replicas] == [1, 1, 1]  # type: ignore[attr-defined]
    assert not dp.replicas[0].link.options.kv_events  # type: ignore[attr-defined]  # unread
    srv, eng = _serve_args("--num-kv-blocks", "64")
    assert isinstance(make_engine(srv, eng, eng.create_engine_config()), MPClient)
    srv, eng = _serve_args("-dp", "2", "--engine-in-process")
    with pytest.raises(ValueError, match="--engine-in-process runs one engine"):
        make_engine(srv, eng, eng.create_engine_config())


@pytest.mark.slow  # the real command: a server and two engine-core processes (~20 s)
def test_pagedllm_serve_with_two_replicas() -> None:
    from serve_process import child_pids, pid_alive, serve_process

    with serve_process("--data-parallel-size", "2", "--data-parallel-threads", "1",
                       "--num-kv-blocks", "128", "--max-model-len", "256") as (proc, base):
        cores = [p for p in child_pids(proc.pid)
                 if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(cores) == 2, cores
        # cache_aware (the default): the two of one system prompt together, the others apart
        for p in [PROMPTS[0], PROMPTS[5], PROMPTS[1], PROMPTS[6]]:
            r = httpx.post(base + "/v1/completions", json={"prompt": p, "max_tokens": 4}, timeout=60)
            assert r.status_code == 200, r.text
        m = _series(base)
        assert {e for (name, e) in m if name == "pagedllm:prompt_tokens_total"} == {"0", "1"}
        assert m[("pagedllm:prefix_cache_hits_total", "0")] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in cores):
            assert time.monotonic() < deadline, "an engine replica outlived the server"
            time.sleep(0.05)
