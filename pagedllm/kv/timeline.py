"""A recorded allocation trace as the KV inspector page with a scrubbable timeline:
``python -m pagedllm.kv.trace FILE --html OUT.html``.

The trace is replayed exactly on a fresh manager (``trace.replay``); after the last op of each
engine step the manager is pictured (``snapshot.capture_kv``) and the frame keeps only what
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
from pagedllm.kv.trace import TraceMismatch, load, replay

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


def build_timeline(path: str | Path) -> tuple[dict[str, Any], KVCacheManager]:
    """Replay the trace at ``path``; returns (the page's timeline data, the final manager)."""
    events = load(path)
    if not events or events[0].get("op") != "init":
        raise TraceMismatch("line 1: a trace starts with an 'init' event")
    init = events[0]
    last_of_step = {i for i in range(1, len(events))
                    if i + 1 == len(events) or events[i + 1].get("step") != events[i].get("step")}
    frames: list[dict[str, Any]] = []
    history: list[list[int]] = []
    totals = {"hit_blocks": 0, "swapped_out": 0}
    done = 0  # events already in a frame
    prev = capture_kv(KVCacheManager(init["num_blocks"], init["block_size"],
                                     init["enable_prefix_caching"],
                                     num_host_blocks=init["num_host_blocks"]))
    first = prev

    def picture(snap: dict[str, Any], step: int, ops: list[dict[str, Any]]) -> dict[str, Any]:
        c = count_states(snap)
        history.append([step, c["num_blocks"], c["used_blocks"], c["cached_blocks"],
                        c["shared_blocks"], c["host_used_blocks"], totals["hit_blocks"],
                        totals["swapped_out"]])
        shown = [{k: v for k, v in e.items() if k not in DROPPED_FIELDS}
                 for e in ops[:MAX_OPS_PER_FRAME]]
        return {"step": step, "ops": shown, "num_ops": len(ops)}

    frames.append(picture(first, 0, [init]))

    def on_op(kv: KVCacheManager, i: int) -> None:
        nonlocal done, prev
        if i not in last_of_step:
            return
        ops = events[done + 1:i + 1]
        done = i
        for ev in ops:
            if ev["op"] == "prefix_hit":
                totals["hit_blocks"] += len(ev["blocks"])
            elif ev["op"] == "swap_out" and ev["pairs"]:
                totals["swapped_out"] += len(ev["pairs"])
        snap = capture_kv(kv)
        frame = picture(snap, events[i].get("step", 0), ops)
        frame["d"] = frame_delta(prev, snap)
        frames.append(frame)
        prev = snap

    kv = replay(events, on_op)
    data = {
        "mode": "trace", "source": Path(path).name, "init": init, "first": first,
        "frames": frames, "history_fields": HISTORY_FIELDS, "history": history,
    }
    return data, kv


def write_html(path: str | Path, out: str | Path) -> KVCacheManager:
    """Write the inspector page with the timeline of the trace at ``path``; the final manager."""
    data, kv = build_timeline(path)
    Path(out).write_text(page_html(data), encoding="utf-8")
    return kv
