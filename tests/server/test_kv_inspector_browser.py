"""The /kv page in a real browser (Debian's chromium, driven by Playwright): it takes the key once,
updates live while requests run, its block map (the pixels drawn, and its legend) shows the same
counts as /kv/state and kv_stats(), clicking a block names its holders, screenshots are saved
(``$PAGEDLLM_SCREENSHOT_DIR``, default the temp dir); and the run's --kv-trace, rendered offline,
scrubs to the frames the Python timeline holds and ends where the live engine did.
Skips, saying why, where no chromium is installed (``.ci/run`` installs it; Playwright comes with
the dev extra and drives the system browser, so nothing is downloaded)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from kv_inspector_helpers import auth, inspector_app, paused, slowed, traffic
from server_helpers import API_KEY, ServerThread

from pagedllm.kv.snapshot import capture_kv, count_states
from pagedllm.kv.trace import build_timeline, write_html

CHROMIUM = os.environ.get("PAGEDLLM_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SCREENSHOT_DIR = Path(os.environ.get("PAGEDLLM_SCREENSHOT_DIR", tempfile.gettempdir()))
ERRORS: list[str] = []
COUNTS = ("num_blocks", "free_blocks", "cached_blocks", "used_blocks", "shared_blocks")

# reads the canvas back: the state of every cell from the colour at its centre
PIXEL_COUNTS = """() => {
  const v = window.kvView, g = v.geometry, cv = document.getElementById('blocks');
  const dpr = cv.width / (g.cols * g.cell), ctx = cv.getContext('2d');
  const img = ctx.getImageData(0, 0, cv.width, cv.height).data;
  const rgb = h => [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16));
  const want = Object.entries(v.colors).map(([k, h]) => [k, rgb(h)]);
  const n = {};
  for (let i = 0; i < g.n; i++) {
    const x = Math.floor(((i % g.cols) * g.cell + 1.5) * dpr);
    const y = Math.floor((Math.floor(i / g.cols) * g.cell + 1.5) * dpr);
    const p = (y * cv.width + x) * 4, px = [img[p], img[p + 1], img[p + 2]];
    let best = null, d = 1e9;
    for (const [k, c] of want) { const e = Math.abs(c[0]-px[0]) + Math.abs(c[1]-px[1]) + Math.abs(c[2]-px[2]);
      if (e < d) { d = e; best = k; } }
    n[best] = (n[best] || 0) + 1;
  }
  return n;
}"""


def _playwright() -> Any:
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no chromium at {CHROMIUM} (apt-get install -y chromium; or set "
                    "PAGEDLLM_CHROMIUM)")
    from playwright.sync_api import sync_playwright  # the dev extra

    return sync_playwright


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with _playwright()() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=FLAGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture()
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    try:
        ERRORS.clear()
        pg = context.new_page()
        pg.on("console", lambda m: m.type == "error" and ERRORS.append(m.text))
        pg.on("pageerror", lambda e: ERRORS.append(str(e)))
        yield pg
    finally:
        context.close()


def _wait(page: Any, js: str, what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := page.evaluate(js)):
        assert time.monotonic() < deadline, f"the page never showed {what}: " + page.evaluate(
            "JSON.stringify({step: kvView.step, seq: kvView.seq, updates: kvView.updates, "
            "requests: kvView.requests, status: document.getElementById('status').textContent})")
        time.sleep(0.05)
    return value


def _busy(engine: Any) -> bool:
    p, s = engine.kv.pool, engine.scheduler
    return (p.num_shared_blocks > 0 and p.num_cached_free_blocks > 0 and s.num_swapped > 0
            and sum(r.num_output_tokens > 0 for r in s.running) >= 2)


def test_page_live_counts_click_and_screenshot(chat_model: Path, page: Any,
                                               tmp_path: Path) -> None:
    trace = tmp_path / "kv.jsonl"
    app = inspector_app(chat_model, num_kv_blocks=512, max_model_len=512, trace=trace)
    with ServerThread(app) as server:
        page.goto(f"{server.base_url}/kv#key={API_KEY}")
        _wait(page, "window.kvView.updates > 0", "a first snapshot")
        assert "key=" not in page.url  # the key was taken once and dropped from the URL
        assert page.evaluate("sessionStorage.getItem('pagedllm-kv-key')") == API_KEY
        with slowed(server), traffic(server, num=12, max_tokens=300, urgent_tokens=400):
            with paused(server, _busy) as box:  # between two steps, every block state present
                snap, stats = box["snapshot"], box["kv_stats"]
                _wait(page, f"window.kvView.seq === {snap['seq']}", f"snapshot {snap['seq']}")
                page.wait_for_timeout(100)  # the frame after the data
                shown = page.evaluate("window.kvView.counts")
                drawn = page.evaluate(PIXEL_COUNTS)
                want = count_states(snap)
                for k in COUNTS:
                    assert shown[k] == want[k] == stats[k], (k, shown, stats)
                assert drawn == {c: n for c, n in shown["by_state"].items() if n}, (drawn, shown)
                assert {"c", "u", "h", "s"} <= set(drawn)
                assert shown["host_used_blocks"] == want["host_used_blocks"] > 0
                assert page.inner_text("#check").startswith("✓")
                legend = page.inner_text("#legend")
                assert f"shared (ref > 1) {stats['shared_blocks']}" in legend
                assert page.locator("#reqs tbody tr").count() == len(snap["requests"])
                shot = SCREENSHOT_DIR / "kv-inspector.png"
                page.screenshot(path=str(shot), full_page=True)
                assert shot.stat().st_size > 10_000
                # click a shared block: the detail names every table that holds it
                block = min(snap["refs"])
                g = page.evaluate("window.kvView.geometry")
                page.click("#blocks", position={"x": (block % g["cols"]) * g["cell"] + g["cell"] / 2,
                                                "y": (block // g["cols"]) * g["cell"] + g["cell"] / 2})
                detail = _wait(page, "(t => t.startsWith('block') && t)(document.getElementById("
                               "'detail').textContent)", "the clicked block's holders")
                holders = [rid for rid, t in snap["tables"].items() if block in t]
                assert f"block {block} · shared" in detail and len(holders) == snap["refs"][block]
                assert all(rid in detail for rid in holders)
                step = snap["step"]
            # live: the page follows the engine while the requests run on
            for _ in range(3):
                step = _wait(page, f"window.kvView.step > {step} && window.kvView.requests > 0 "
                             "&& window.kvView.step", "live updates while requests run")
        server.wait_idle()
        # idle: the page settles on what /kv/state and kv_stats() say (a snapshot may be up to
        # one interval old: wait for the first one taken at idle)
        stats = server.call(lambda e: e.kv_stats())
        deadline = time.monotonic() + 30
        while (state := httpx.get(server.base_url + "/kv/state", headers=auth(),
                                  timeout=30).json()["state"])["kv_stats"] != stats:
            assert time.monotonic() < deadline, "no idle snapshot"
            time.sleep(0.05)
        _wait(page, f"window.kvView.seq >= {state['seq']}", "the idle snapshot")
        shown = page.evaluate("window.kvView.counts")
        assert {k: shown[k] for k in COUNTS} == {k: count_states(state)[k] for k in COUNTS} \
            == {k: stats[k] for k in COUNTS}
        assert page.locator("#evlist > *").count() > 0  # --kv-trace: the allocation events
        assert not ERRORS, ERRORS
        page.goto("about:blank")  # close the stream before the server stops
        live_final = server.call(lambda e: capture_kv(e.kv))
    # the same run offline: its trace replayed as a timeline page, scrubbed
    out = tmp_path / "kv.html"
    final = write_html(trace, out)
    data, _ = build_timeline(trace)
    assert capture_kv(final)["blocks"] == live_final["blocks"]
    page.goto(out.as_uri())
    frames = _wait(page, "window.kvView.frames", "the timeline")
    assert frames == len(data["frames"]) > 10
    _wait(page, f"window.kvView.seq === {frames - 1}", "the last frame")
    shown = page.evaluate("window.kvView.counts")
    assert {k: shown[k] for k in COUNTS} == {k: count_states(live_final)[k] for k in COUNTS}
    page.wait_for_timeout(100)
    assert page.evaluate(PIXEL_COUNTS) == {c: n for c, n in shown["by_state"].items() if n}
    fields = data["history_fields"]
    busiest = max(range(frames), key=lambda k: data["history"][k][fields.index("host_used")])
    page.evaluate(f"window.kvView.goto({busiest + 1})")
    page.keyboard.press("ArrowLeft")  # one frame back, as a user scrubs
    _wait(page, f"window.kvView.seq === {busiest}", f"frame {busiest}")
    shown = page.evaluate("window.kvView.counts")
    row = dict(zip(fields, data["history"][busiest]))
    assert (shown["num_blocks"], shown["used_blocks"], shown["cached_blocks"],
            shown["shared_blocks"], shown["host_used_blocks"]) == (
        row["total"], row["used"], row["cached"], row["shared"], row["host_used"])
    assert row["host_used"] > 0 and page.inner_text("#frame") == str(busiest)
    page.wait_for_timeout(100)
    assert page.evaluate(PIXEL_COUNTS) == {c: n for c, n in shown["by_state"].items() if n}
    page.screenshot(path=str(SCREENSHOT_DIR / "kv-inspector-trace.png"), full_page=True)
    assert not ERRORS, ERRORS


def test_page_asks_for_the_key(chat_model: Path, page: Any) -> None:
    with ServerThread(inspector_app(chat_model)) as server:
        page.goto(f"{server.base_url}/kv")
        page.wait_for_selector("#auth", state="visible")
        page.fill("#key", "wrong")
        page.click("#authform button")
        _wait(page, "document.getElementById('autherr').textContent", "a refusal")
        page.fill("#key", API_KEY)
        page.click("#authform button")
        _wait(page, "window.kvView.updates > 0", "a snapshot after the key")
        assert page.evaluate("window.kvView.counts.num_blocks") == 256
        page.goto("about:blank")
