"""A recorded allocation trace as the KV inspector page with a scrubbable timeline:
``python -m pagedllm.kv.trace FILE --html OUT.html``.

The trace is replayed exactly on a fresh manager (``trace.build_timeline`` runs ``trace.replay``
with a ``TimelineRecorder``); after the last op of each engine step the manager is pictured (``snapshot.capture_kv``) and the frame keeps only what
changed since the previous one::

    {"step": 7, "ops": [...the step's events...],
     "d": {"blocks": [[3, "u"], [9, "."]] | "full string",     changed blocks
           "refs": {...}, "host": "..w.",                       whole (small)
           "tables": {"r1": [0, 3], "r2": null}, "host_tables": {...},   changed / gone
           "prefix": {"3": [3, -1, 0, "9f2c.."], "8": null}}}            changed / gone

The page rebuilds step k by applying the deltas of frames 1..k to the first frame (it keeps a
checkpoint every few dozen frames, so scrubbing back is quick). Pure Python, no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedllm.kv.manager import KVCacheManager
from pagedllm.kv.page import page_html
from pagedllm.kv.snapshot import capture_kv, count_states

MAX_OPS_PER_FRAME = 200  # events of one step listed on the page (the rest are counted)
DROPPED_FIELDS = ("tokens", "hashes", "hash")  # bulky, and the tokens are prompt content

HISTORY_FIELDS = ("step", "total", "used", "cached", "shared", "host_used", "hit_blocks",
                  "swapped_out")


def _dict_delta(old: dict[Any, Any], new: dict[Any, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {str(k): v for k, v in new.items() if old.get(k) != v}
    out.update({str(k): None for k in old if k not in new})
    return out


def frame_delta(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """What changed from snapshot ``old`` to ``new`` (see the module docstring)."""
    d: dict[str, Any] = {}
    ob, nb = old["blocks"], new["blocks"]
    if len(ob) != len(nb):
        d["blocks"] = nb
    else:
        changed = [[i, c] for i, (a, c) in enumerate(zip(ob, nb)) if a != c]
        if changed:
            d["blocks"] = nb if len(changed) * 8 > len(nb) else changed
    for key in ("refs", "host"):
        if old[key] != new[key]:
            d[key] = new[key]
    for key in ("tables", "host_tables"):
        delta = _dict_delta(old[key], new[key])
        if delta:
            d[key] = delta
    prefix = _dict_delta({n[0]: n for n in old["prefix"]}, {n[0]: n for n in new["prefix"]})
    if prefix:
        d["prefix"] = prefix
    return d


class TimelineRecorder:
    """Collects the timeline while ``trace.replay(events, recorder.on_op)`` runs: a frame after
    the last op of each step. ``events[0]`` is the trace's init line."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.events = events
        self.init = events[0]
        self.last_of_step = {i for i in range(1, len(events)) if i + 1 == len(events)
                             or events[i + 1].get("step") != events[i].get("step")}
        self.frames: list[dict[str, Any]] = []
        self.history: list[list[int]] = []
        self.totals = {"hit_blocks": 0, "swapped_out": 0}
        self.done = 0  # events already in a frame
        init = self.init
        self.first = self.prev = capture_kv(KVCacheManager(
            init["num_blocks"], init["block_size"], init["enable_prefix_caching"],
            num_host_blocks=init["num_host_blocks"]))
        self.frames.append(self._picture(self.first, 0, [init]))

    def _picture(self, snap: dict[str, Any], step: int,
                 ops: list[dict[str, Any]]) -> dict[str, Any]:
        c = count_states(snap)
        self.history.append([step, c["num_blocks"], c["used_blocks"], c["cached_blocks"],
                             c["shared_blocks"], c["host_used_blocks"],
                             self.totals["hit_blocks"], self.totals["swapped_out"]])
        shown = [{k: v for k, v in e.items() if k not in DROPPED_FIELDS}
                 for e in ops[:MAX_OPS_PER_FRAME]]
        return {"step": step, "ops": shown, "num_ops": len(ops)}

    def on_op(self, kv: KVCacheManager, i: int) -> None:
        if i not in self.last_of_step:
            return
        ops = self.events[self.done + 1:i + 1]
        self.done = i
        for ev in ops:
            if ev["op"] == "prefix_hit":
                self.totals["hit_blocks"] += len(ev["blocks"])
            elif ev["op"] == "swap_out" and ev["pairs"]:
                self.totals["swapped_out"] += len(ev["pairs"])
        snap = capture_kv(kv)
        frame = self._picture(snap, self.events[i].get("step", 0), ops)
        frame["d"] = frame_delta(self.prev, snap)
        self.frames.append(frame)
        self.prev = snap

    def data(self, source: str) -> dict[str, Any]:
        """The page's timeline data (after the replay)."""
        return {"mode": "trace", "source": source, "init": self.init, "first": self.first,
                "frames": self.frames, "history_fields": HISTORY_FIELDS, "history": self.history}


def write_page(data: dict[str, Any], out: str | Path) -> None:
    Path(out).write_text(page_html(data), encoding="utf-8")
