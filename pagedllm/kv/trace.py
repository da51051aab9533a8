"""The allocation event trace: what the KV manager did, one JSON object per line, and its replay.

Tracing is off by default and then costs nothing (the manager builds no event while nobody
listens). On (``LLM(kv_trace_path=FILE)``, ``--kv-trace FILE``), ``attach`` subscribes a
``KVTracer`` to the manager's events (kv/events.py), and every manager-level operation is
written as an *op* event, preceded by the *effect* events it caused::

    {"op": "init", "step": 0, "num_blocks": 64, "block_size": 4, ...}          the fresh pool
    {"op": "evict", "step": 3, "block": 7, "hash": "c1.."}                      effects ...
    {"op": "prefix_hit", "step": 3, "rid": "b", "blocks": [0, 1], "hashes": ["9f..", ".."]}
    {"op": "allocate", "step": 3, "rid": "b", "num_tokens": 9, "prefix": [0, 1], "ok": true,
     "new": [7]}                                                                ... then the op

Ops (re-executed by ``replay``): allocate, cache (block ids + hash values, with the tokens
needed to recompute them), free_window (blocks freed behind a sliding window), free, fork,
take_copies, swap_out, swap_in, compact, grow, shrink, reset_prefix_cache, rollback
(speculative decoding's rejected tail). Block lists are by position; ``null`` marks a
position freed behind the sliding window. Effects (checked, not executed): evict (the pool's
``BlockRemoved``, a line per block), prefix_hit, cow_copy. ``step`` is the scheduler's step
count (the tracer's ``clock``).

``replay(path)`` builds a fresh ``KVCacheManager`` from the init line (pure Python, no torch),
re-executes every op with a tracer of its own attached, and requires that the events it emits
(including block ids handed out, evictions and copies: the pool is deterministic) equal the
recorded ones, and that ``check_integrity()`` holds after each op. A mismatch raises
``TraceMismatch`` naming the line. From a shell: ``python -m pagedllm.kv.trace FILE``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

import msgspec

from pagedllm.kv.events import BlockRemoved, KVEvent, KVOpEvent
from pagedllm.kv.manager import KVCacheManager, PrefixHit
from pagedllm.kv.timeline import TimelineRecorder, write_page

OPS = frozenset({"allocate", "cache", "free_window", "free", "fork", "take_copies", "swap_out",
                 "swap_in", "compact", "grow", "shrink", "reset_prefix_cache", "rollback"})
EFFECTS = frozenset({"prefix_hit", "cow_copy", "evict"})


class KVTracer:
    """Collects events: to a JSONL file (line-buffered, so a reader sees whole lines while the
    engine runs) or, with ``path=None``, to ``self.events`` in memory. Each event is stamped
    with ``clock()`` (the engine passes the scheduler's step count), else with ``self.step``.
    A subscriber of the manager's op events (``attach``); its lines are those events as dicts."""

    def __init__(self, path: str | Path | None = None,
                 clock: Callable[[], int] | None = None) -> None:
        self.step = 0
        self.clock = clock
        self.events: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        self._unsubscribe: Callable[[], None] | None = None
        if path is not None:
            self._file = open(path, "w", buffering=1)  # noqa: SIM115 - closed by close()

    def emit(self, op: str, **fields: Any) -> None:
        event = {"op": op, "step": self.step if self.clock is None else self.clock(), **fields}
        if self._file is None:
            self.events.append(event)
        else:
            self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def __call__(self, event: KVEvent) -> None:
        """The listener: an op event is one line (its tag is the op, its fields the keys); an
        eviction one ``evict`` line per block. Stored / cleared are implied by the ops."""
        if isinstance(event, KVOpEvent):
            fields = msgspec.to_builtins(event)
            self.emit(fields.pop("op"), **fields)
        elif isinstance(event, BlockRemoved):
            for block, h in zip(event.block_ids, event.block_hashes):
                self.emit("evict", block=block, hash=h)

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._file is not None:
            self._file.close()
            self._file = None


def attach(kv: KVCacheManager, tracer: KVTracer) -> None:
    """Start tracing ``kv`` (which must hold no blocks yet: replay starts from a fresh pool):
    write the init line, then subscribe ``tracer`` to the manager's events, ops included
    (``tracer.close()`` unsubscribes)."""
    if kv.num_requests or kv.pool.num_cached_blocks:
        raise ValueError("attach a KV trace to a fresh manager (no requests, nothing cached)")
    window = {} if kv.sliding_window is None else {"sliding_window": kv.sliding_window}
    tracer.emit("init", num_blocks=kv.num_blocks, block_size=kv.block_size,
                enable_prefix_caching=kv.enable_prefix_caching,
                num_host_blocks=kv.host.num_blocks, **window)
    tracer._unsubscribe = kv.events.subscribe(tracer, ops=True)


class TraceMismatch(AssertionError):
    """The replay diverged from the recorded trace (or broke an invariant)."""


def load(path: str | Path) -> list[dict[str, Any]]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise TraceMismatch(f"{path}:{n}: not JSON ({e})") from e
    return out


def replay(trace: str | Path | Iterable[dict[str, Any]],
           on_op: Callable[[KVCacheManager, int], None] | None = None) -> KVCacheManager:
    """Re-execute a trace on a fresh manager; returns it (in its final state). Raises
    ``TraceMismatch`` at the first event that the replay does not reproduce exactly.
    ``on_op(kv, i)`` runs after each op, event ``i`` of the trace (0 = the init line), checked."""
    events = load(trace) if isinstance(trace, (str, Path)) else list(trace)
    if not events or events[0].get("op") != "init":
        raise TraceMismatch("line 1: a trace starts with an 'init' event")
    init = events[0]
    kv = KVCacheManager(init["num_blocks"], init["block_size"], init["enable_prefix_caching"],
                        num_host_blocks=init["num_host_blocks"],
                        sliding_window=init.get("sliding_window"))
    mine = KVTracer()
    attach(kv, mine)
    mine.events.clear()
    pending: list[dict[str, Any]] = []
    for n, ev in enumerate(events[1:], start=2):
        op = ev.get("op")
        if op in EFFECTS:
            pending.append(ev)
            continue
        if op not in OPS:
            raise TraceMismatch(f"line {n}: unknown op {op!r}")
        mine.step = ev.get("step", 0)
        try:
            _execute(kv, ev)
        except (KeyError, ValueError, IndexError, TypeError) as e:
            raise TraceMismatch(f"line {n}: replaying {op} failed: {e!r}") from e
        want = [*pending, ev]
        if mine.events != want:
            raise TraceMismatch(f"line {n}: replay diverged at {op}:\n  recorded {want}\n"
                                f"  replayed {mine.events}")
        try:
            kv.check_integrity()
        except AssertionError as e:
            raise TraceMismatch(f"line {n}: integrity check failed after {op}: {e}") from e
        mine.events.clear()
        pending = []
        if on_op is not None:
            on_op(kv, n - 1)
    if pending:
        raise TraceMismatch(f"trace ends with effects of no op: {pending}")
    return kv


def _execute(kv: KVCacheManager, ev: dict[str, Any]) -> None:
    op = ev["op"]
    if op == "allocate":
        prefix, skipped = ev["prefix"], ev.get("skipped", 0)
        hit = PrefixHit(prefix, (skipped + len(prefix)) * kv.block_size, (),
                        skipped) if prefix else None
        kv.allocate_slots(ev["rid"], ev["num_tokens"], hit)
    elif op == "cache":
        # blocks before ``start`` are hashed already (the chain is on the request): pad them
        bs = kv.block_size
        tokens = [0] * (ev["start"] * bs) + ev["tokens"]
        extra = ev.get("extra_keys")
        kv.cache_blocks(ev["rid"], tokens, len(tokens), None if extra is None else tuple(extra))
    elif op == "free_window":
        kv.free_outside_window(ev["rid"], ev["num_computed"])
    elif op == "free":
        kv.free(ev["rid"])
    elif op == "fork":
        kv.fork(ev["parent"], ev["child"], ev["num_tokens"])
    elif op == "take_copies":
        kv.take_block_copies()
    elif op == "swap_out":
        kv.swap_out(ev["rid"])
    elif op == "swap_in":
        kv.swap_in(ev["rid"])
    elif op == "compact":
        kv.compact()
    elif op == "grow":
        kv.grow(ev["n"])
    elif op == "shrink":
        kv.shrink(ev["n"])
    elif op == "reset_prefix_cache":
        kv.reset_prefix_cache()
    elif op == "rollback":
        kv.rollback(ev["rid"], ev["num_tokens"])


def build_timeline(path: str | Path) -> tuple[dict[str, Any], KVCacheManager]:
    """Replay the trace at ``path`` with a frame per step (``kv/timeline.py``); returns (the
    inspector page's timeline data, the final manager)."""
    events = load(path)
    if not events or events[0].get("op") != "init":
        raise TraceMismatch("line 1: a trace starts with an 'init' event")
    recorder = TimelineRecorder(events)
    kv = replay(events, recorder.on_op)
    return recorder.data(Path(path).name), kv


def write_html(path: str | Path, out: str | Path) -> KVCacheManager:
    """Write the inspector page with the timeline of the trace at ``path``; the final manager."""
    data, kv = build_timeline(path)
    write_page(data, out)
    return kv


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedllm.kv.trace FILE [--html OUT]``: replay a trace (exit status 1 on a
    mismatch); ``--html`` also writes the inspector page with a scrubbable timeline of it."""
    import argparse
    import sys
    from collections import Counter

    parser = argparse.ArgumentParser(prog="python -m pagedllm.kv.trace",
                                     description="Replay a KV allocation trace exactly.")
    parser.add_argument("trace", metavar="TRACE.jsonl")
    parser.add_argument("--html", metavar="OUT.html", default=None,
                        help="write the KV inspector page with a timeline of the replay")
    args = parser.parse_args(argv)
    try:
        if args.html is not None:
            kv = write_html(args.trace, args.html)
        else:
            kv = replay(args.trace)
    except TraceMismatch as e:
        print(f"MISMATCH: {e}", file=sys.stderr)
        return 1
    ops = Counter(e["op"] for e in load(args.trace))
    print(f"replayed {sum(ops.values())} events exactly ({dict(ops)}); final pool: "
          f"{kv.num_blocks} blocks, {kv.num_free_blocks} free, {kv.pool.num_cached_blocks} cached")
    if args.html is not None:
        print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
