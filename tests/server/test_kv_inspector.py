"""The live KV inspector's data without a browser: /kv/state's shape and counts (equal to
kv_stats() at the same moment, and to the pool), the block tables against the scheduler, auth,
no prompt text unless asked, the SSE stream, the allocation events of --kv-trace, off by default."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kv_inspector_helpers import SYSTEM, auth, complete, inspector_app, paused, slowed, traffic
from server_helpers import ServerThread

from pagedllm.kv.snapshot import count_states

KV_STATS_COUNTS = ("num_blocks", "free_blocks", "cached_blocks", "used_blocks", "shared_blocks",
                   "lora_blocks")


@pytest.fixture(scope="module")
def inspected(chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    trace = tmp_path_factory.mktemp("kvtrace") / "kv.jsonl"
    with ServerThread(inspector_app(chat_model, trace=trace)) as s:
        yield s


def _state(server: ServerThread, **params: Any) -> dict[str, Any]:
    r = httpx.get(server.base_url + "/kv/state", headers=auth(), params=params, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _busy(engine: Any) -> bool:
    """Every block state at once: shared, cached-free, in use, and a request swapped out."""
    p, s = engine.kv.pool, engine.scheduler
    return (p.num_shared_blocks > 0 and p.num_cached_free_blocks > 0 and s.num_swapped > 0
            and s.num_running > 0)


def test_inspector_is_off_by_default(server: ServerThread) -> None:
    for path in ("/kv", "/kv/state", "/kv/stream"):
        assert httpx.get(server.base_url + path, headers=auth()).status_code == 404


def test_state_needs_the_api_key_but_the_page_has_no_data(inspected: ServerThread) -> None:
    base = inspected.base_url
    for path in ("/kv/state", "/kv/stream"):
        assert httpx.get(base + path).status_code == 401
        assert httpx.get(base + path, headers={"Authorization": "Bearer nope"}).status_code == 401
    page = httpx.get(base + "/kv")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "const DATA = /*KV_DATA*/null;" in page.text  # live mode: it fetches, with the key
    text = page.text.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace: a name
    assert "http://" not in text and "https://" not in text  # nothing loaded from a network


def test_snapshot_mid_run_equals_kv_stats_and_the_scheduler(inspected: ServerThread) -> None:
    with traffic(inspected), paused(inspected, _busy) as box:
        snap, stats = box["snapshot"], box["kv_stats"]
        assert snap["kv_stats"] == stats
        counts = count_states(snap)
        for k in KV_STATS_COUNTS:
            assert counts[k] == stats[k], k
        assert {"c", "s"} <= set(snap["blocks"]) and set(snap["blocks"]) & {"u", "h"}
        assert "w" in snap["host"] and counts["host_used_blocks"] == sum(
            len(t) for t in snap["host_tables"].values())
        # every shared block's ref count is the number of tables holding it
        holders: dict[int, int] = {}
        for table in snap["tables"].values():
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        assert {b: n for b, n in holders.items() if n > 1} == {int(b): n for b, n in snap["refs"].items()}
        for b, n in holders.items():
            assert snap["blocks"][b] in ("s" if n > 1 else "uh"), b
        # every block accounted for: in use exactly when some table holds it, the rest free
        assert {b for b, c in enumerate(snap["blocks"]) if c in "uhs"} == set(holders)
        assert counts == box["pool"] and len(snap["blocks"]) == snap["num_blocks"]
        assert set(snap["blocks"]) <= {".", "c", "u", "h", "s"}
        by_state = {r["state"] for r in snap["requests"]}
        assert {"running", "swapped"} <= by_state
        for r in snap["requests"]:
            assert (r["state"] == "swapped") == (r["id"] in snap["host_tables"])
            if r["state"] == "running":
                assert r["id"] in snap["tables"]
            assert "prompt" not in r and "output" not in r
        assert snap["num_swapped"] == sum(r["state"] == "swapped" for r in snap["requests"])
        hits = [n for n in snap["prefix"] if n[2] > 0]
        assert hits, "the shared system prompt was hit"
        assert all(snap["blocks"][n[0]] in "chs" for n in snap["prefix"])
    inspected.wait_idle()
    # idle: /kv/state, kv_stats() and the pool agree, every block is back
    state = _state(inspected)["state"]
    stats = inspected.call(lambda e: e.kv_stats())
    assert {k: count_states(state)[k] for k in KV_STATS_COUNTS} == {k: stats[k] for k in KV_STATS_COUNTS}
    assert state["kv_stats"] == stats and state["tables"] == {} and state["requests"] == []
    assert set(state["blocks"]) <= {".", "c"}


def _generating(engine: Any) -> bool:
    return any(r.num_output_tokens > 0 for r in engine.scheduler.running)


def test_no_prompt_text_unless_asked(inspected: ServerThread, chat_model: Path) -> None:
    # slowed: the engine's steps got fast enough that 3 x 60 tokens could finish between polls
    with slowed(inspected), traffic(inspected, num=3, max_tokens=60):
        deadline = time.monotonic() + 30
        while not (raw := httpx.get(inspected.base_url + "/kv/state", headers=auth(),
                                    timeout=30).text).count('"state":"running"'):
            assert time.monotonic() < deadline, "no running request seen"
    assert SYSTEM[:7] not in raw and '"prompt"' not in raw  # no prompt text anywhere
    with ServerThread(inspector_app(chat_model, show_text=True)) as shown:
        with traffic(shown, num=3, max_tokens=40), paused(shown, _generating) as box:
            reqs = box["snapshot"]["requests"]
        assert reqs and all(r["prompt"].startswith(SYSTEM) for r in reqs)
        assert any(r["output"] for r in reqs) and all(bool(r["output"]) == (r["output_tokens"] > 0)
                                                      for r in reqs)


def test_stream_sends_new_snapshots_while_requests_run(inspected: ServerThread) -> None:
    first = _state(inspected)
    history_after = first["history"][-1][0] if first["history"] else 0
    events_after = first["num_events"]
    seqs, steps, msgs = [], [], []
    with slowed(inspected), traffic(inspected, num=4, max_tokens=120):
        while len(set(steps)) < 4:  # each stream ends after a few seconds: reconnect, as the page
            assert not msgs or msgs[-1]["state"]["requests"], "the requests finished first"
            params = {"history_after": history_after, "events_after": events_after}
            with httpx.stream("GET", inspected.base_url + "/kv/stream", headers=auth(),
                              params=params, timeout=30) as s:
                assert s.headers["content-type"].startswith("text/event-stream")
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        msg = json.loads(line[6:])
                        msgs.append(msg)
                        seqs.append(msg["state"]["seq"])
                        steps.append(msg["state"]["step"])
                        if msg["history"]:
                            history_after = msg["history"][-1][0]
                        if msg["events"]:
                            events_after = msg["events"][-1][0]
    assert seqs == sorted(seqs) and len(set(steps)) >= 4
    # chart points and events arrive once each across messages (cursors move forward)
    ts = [p[0] for m in msgs for p in m["history"]]
    assert ts == sorted(set(ts))
    evs = [n for m in msgs for n, _ in m["events"]]
    assert evs == sorted(set(evs)) and all(n > first["num_events"] for n in evs)


def test_trace_events_reach_the_page(inspected: ServerThread) -> None:
    complete(inspected, f"{SYSTEM} t98 t99", 8)
    deadline = time.monotonic() + 20
    while True:
        msg = _state(inspected)
        ops = {e["op"] for _, e in msg["events"]}
        if {"allocate", "free", "cache"} <= ops:
            break
        assert time.monotonic() < deadline, f"events seen: {ops}"
        time.sleep(0.2)
    assert msg["trace"] is True and msg["num_events"] >= len(msg["events"])
    numbers = [n for n, _ in msg["events"]]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    assert msg["history_fields"][0] == "t" and len(msg["history"][-1]) == len(msg["history_fields"])
