"""The live KV inspector (``pagedllm serve --kv-inspector``): a page at ``/kv``, its data at
``/kv/state`` (JSON) and ``/kv/stream`` (server-sent events, one message per snapshot).

Who does what::

    engine core                           event loop (uvicorn)
    ───────────                           ────────────────────
    kv_snapshot between two steps    ◀──  fresh(): at most one snapshot per interval, shared by
      (a named utility call of the          every viewer, and only while someone is looking
      EngineClient: plain data back)      sampler task (2/s): one chart point from the client's
                                            ``stats``, the core's latest StepStats record
                                          trace tail: new lines of the --kv-trace file

Only the core reads the KV manager and the scheduler (``pagedllm.engine.snapshot``); this
module sees plain data: the snapshots, the records the core sends with each step, and the trace
file. Prompt and output text is left out unless ``--kv-inspector-show-text``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

from pagedllm.engine.client import EngineClient

HISTORY_FIELDS = ("t", "step", "total", "used", "cached", "shared", "host_used", "running",
                  "waiting", "swapped", "preemptions", "hits", "queries")
MAX_EVENTS = 300  # allocation events kept for the page
MAX_TRACE_READ = 4 << 20  # bytes of new trace read per tick (the rest waits for the next)
STREAM_LIFETIME_S = 3.0  # a stream ends after this and the page reconnects: a drain never waits long


class KVInspector:
    def __init__(self, client: EngineClient, show_text: bool = False,
                 interval_s: float = 0.25, sample_s: float = 0.5, history_s: float = 600.0) -> None:
        self.client = client
        self.show_text = show_text
        self.interval_s = interval_s
        self.sample_s = sample_s
        self.latest: dict[str, Any] | None = None
        self.num_captures = 0
        self._asked_at = -1e9
        self._pending: asyncio.Task[None] | None = None  # the snapshot asked for
        self.history: deque[list[float]] = deque(maxlen=max(1, int(history_s / sample_s)))
        self.events: deque[tuple[int, dict[str, Any]]] = deque(maxlen=MAX_EVENTS)
        self.num_events = 0
        self._trace_path = client.config.cache.kv_trace_path
        self._trace_pos = 0
        self._trace_rest = b""
        self._task: asyncio.Task[None] | None = None

    async def _capture(self) -> None:
        snap = await self.client.kv_snapshot(self.show_text)
        self.num_captures += 1
        snap["seq"] = self.num_captures
        self.latest = snap

    def refresh(self) -> None:
        """Ask the core for a new snapshot if the latest is older than the interval; one
        request at a time, shared by every viewer. Does not wait for it."""
        if self._pending is not None and not self._pending.done():
            return
        if time.monotonic() - self._asked_at < self.interval_s:
            return
        self._asked_at = time.monotonic()
        self._pending = asyncio.ensure_future(self._capture())

    async def fresh(self) -> dict[str, Any]:
        """A snapshot at most one interval old (waits for the capture if one is due)."""
        self.refresh()
        pending = self._pending
        if pending is not None and not pending.done():
            # wait without cancelling: other viewers share this capture
            await asyncio.wait({pending}, timeout=30)
        if pending is not None and pending.done() and pending.exception() is not None:
            raise RuntimeError("the KV snapshot failed") from pending.exception()
        if self.latest is None:
            raise RuntimeError("the engine core gave no KV snapshot within 30 s")
        return self.latest

    def start(self) -> None:
        """Start sampling chart points (in the app's lifespan)."""
        if self._task is None:
            self._task = asyncio.ensure_future(self._sample_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def _sample_loop(self) -> None:
        while True:
            self.sample()
            self.read_trace()
            await asyncio.sleep(self.sample_s)

    def sample(self) -> None:
        """One chart point from the core's latest record."""
        s = self.client.stats
        self.history.append([
            round(time.time(), 3), s.step, s.kv.total, s.kv.used, s.kv.cached, s.kv.shared,
            s.kv.host_used, s.num_running, s.num_waiting, s.num_swapped, s.num_preemptions,
            s.prefix_cache_hits, s.prefix_cache_queries,
        ])

    def read_trace(self) -> None:
        """Take the new whole lines of the --kv-trace file (written line by line)."""
        if self._trace_path is None:
            return
        try:
            with open(self._trace_path, "rb") as f:
                f.seek(self._trace_pos)
                chunk = f.read(MAX_TRACE_READ)
        except OSError:
            return
        self._trace_pos += len(chunk)
        data = self._trace_rest + chunk
        lines = data.split(b"\n")
        self._trace_rest = lines.pop()
        skipped = max(0, len(lines) - MAX_EVENTS)
        self.num_events += skipped
        for line in lines[skipped:]:
            if line.strip():
                self.num_events += 1
                self.events.append((self.num_events, json.loads(line)))

    def message(self, state: dict[str, Any], history_after: float = 0.0,
                events_after: int = 0) -> dict[str, Any]:
        """What the page gets: a snapshot, the chart points after ``history_after`` (a time) and
        the allocation events after ``events_after`` (a sequence number)."""
        return {
            "state": state,
            "history_fields": HISTORY_FIELDS,
            "history": [p for p in self.history if p[0] > history_after],
            "events": [[n, e] for n, e in self.events if n > events_after],
            "num_events": self.num_events,
            "trace": self._trace_path is not None,
            "show_text": self.show_text,
            "interval_s": self.interval_s,
        }

    async def stream(self, history_after: float, events_after: int) -> AsyncIterator[str]:
        """Server-sent events: a message per new snapshot, for ``STREAM_LIFETIME_S``."""
        end = time.monotonic() + STREAM_LIFETIME_S
        seq = -1
        while time.monotonic() < end and self.client.is_running:
            self.refresh()
            state = self.latest
            if state is not None and state["seq"] != seq:
                seq = state["seq"]
                msg = self.message(state, history_after, events_after)
                if msg["history"]:
                    history_after = msg["history"][-1][0]
                if msg["events"]:
                    events_after = msg["events"][-1][0]
                yield f"data: {json.dumps(msg, separators=(',', ':'))}\n\n"
            await asyncio.sleep(self.interval_s / 2)
        yield ": the stream ends here; reconnect for more\n\n"  # an SSE comment

