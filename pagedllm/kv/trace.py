"""The allocation event trace: what the KV manager did, one JSON object per line, and its replay.

Tracing is off by default; the manager then pays one ``is None`` check per operation. On
(``LLM(kv_trace_path=FILE)``, ``--kv-trace FILE``), every manager-level operation is written as
an *op* event, preceded by the *effect* events it caused::

    {"op": "init", "step": 0, "num_blocks": 64, "block_size": 4, ...}          the fresh pool
    {"op": "prefix_hit", "step": 3, "rid": "b", "blocks": [0, 1], "hashes": ["9f..", ".."]}
    {"op": "evict", "step": 3, "block": 7, "hash": "c1.."}                      effects ...
    {"op": "allocate", "step": 3, "rid": "b", "num_tokens": 9, "prefix": [0, 1], "ok": true,
     "new": [7]}                                                                ... then the op

Ops (re-executed by ``replay``): allocate, cache (block ids + hash values, with the tokens
needed to recompute them), free, fork, take_copies, swap_out, swap_in, compact, grow, shrink,
reset_prefix_cache. Effects (checked, not executed): prefix_hit, cow_copy, evict.

``replay(path)`` builds a fresh ``KVCacheManager`` from the init line (pure Python, no torch),
re-executes every op with a tracer of its own attached, and requires that the events it emits
(including block ids handed out, evictions and copies: the pool is deterministic) equal the
recorded ones, and that ``check_integrity()`` holds after each op. A mismatch raises
``TraceMismatch`` naming the line. From a shell: ``python -m pagedllm.kv.trace FILE``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pagedllm.kv.block_pool import hash_hex

if TYPE_CHECKING:
    from pagedllm.kv.block_pool import KVBlock
    from pagedllm.kv.manager import KVCacheManager

OPS = frozenset({"allocate", "cache", "free", "fork", "take_copies", "swap_out", "swap_in",
                 "compact", "grow", "shrink", "reset_prefix_cache"})
EFFECTS = frozenset({"prefix_hit", "cow_copy", "evict"})


class KVTracer:
    """Collects events: to a JSONL file (line-buffered, so a reader sees whole lines while the
    engine runs) or, with ``path=None``, to ``self.events`` in memory. The engine sets ``step``."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.step = 0
        self.events: list[dict[str, Any]] = []
        self._file: IO[str] | None = None
        if path is not None:
            self._file = open(path, "w", buffering=1)  # noqa: SIM115 - closed by close()

    def emit(self, op: str, **fields: Any) -> None:
        event = {"op": op, "step": self.step, **fields}
        if self._file is None:
            self.events.append(event)
        else:
            self._file.write(json.dumps(event, separators=(",", ":")) + "\n")

    def on_evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        self.emit("evict", block=block.block_id, hash=hash_hex(block.block_hash.value))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def attach(kv: KVCacheManager, tracer: KVTracer) -> None:
    """Start tracing ``kv`` (which must hold no blocks yet: replay starts from a fresh pool)."""
    if kv._tables or kv._swapped or kv.pool.cached:
        raise ValueError("attach a KV trace to a fresh manager (no requests, nothing cached)")
    tracer.emit("init", num_blocks=kv.num_blocks, block_size=kv.block_size,
                enable_prefix_caching=kv.enable_prefix_caching,
                num_host_blocks=kv.num_host_blocks,
                **({"contiguous_urgent": True} if kv.contiguous_urgent else {}))
    kv.tracer = tracer
    kv.pool.on_evict = tracer.on_evict


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


def replay(trace: str | Path | Iterable[dict[str, Any]]) -> KVCacheManager:
    """Re-execute a trace on a fresh manager; returns it (in its final state). Raises
    ``TraceMismatch`` at the first event that the replay does not reproduce exactly."""
    from pagedllm.kv.manager import KVCacheManager

    events = load(trace) if isinstance(trace, (str, Path)) else list(trace)
    if not events or events[0].get("op") != "init":
        raise TraceMismatch("line 1: a trace starts with an 'init' event")
    init = events[0]
    kv = KVCacheManager(init["num_blocks"], init["block_size"], init["enable_prefix_caching"],
                        num_host_blocks=init["num_host_blocks"],
                        contiguous_urgent=init.get("contiguous_urgent", False))
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
    if pending:
        raise TraceMismatch(f"trace ends with effects of no op: {pending}")
    return kv


def _execute(kv: KVCacheManager, ev: dict[str, Any]) -> None:
    from pagedllm.kv.manager import PrefixHit

    op = ev["op"]
    if op == "allocate":
        prefix = ev["prefix"]
        hit = PrefixHit(prefix, len(prefix) * kv.block_size) if prefix else None
        kv.allocate_slots(ev["rid"], ev["num_tokens"], hit, urgent=ev.get("urgent", False))
    elif op == "cache":
        # blocks before ``start`` are hashed already (the chain is on the request): pad them
        bs = kv.block_size
        tokens = [0] * (ev["start"] * bs) + ev["tokens"]
        extra = ev.get("extra_keys")
        kv.cache_blocks(ev["rid"], tokens, len(tokens), None if extra is None else tuple(extra))
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


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedllm.kv.trace FILE``: replay a trace; exit status 1 on a mismatch."""
    import sys
    from collections import Counter

    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m pagedllm.kv.trace TRACE.jsonl", file=sys.stderr)
        return 2
    try:
        kv = replay(args[0])
    except TraceMismatch as e:
        print(f"MISMATCH: {e}", file=sys.stderr)
        return 1
    ops = Counter(e["op"] for e in load(args[0]))
    print(f"replayed {sum(ops.values())} events exactly ({dict(ops)}); final pool: "
          f"{kv.num_blocks} blocks, {kv.num_free_blocks} free, {len(kv.pool.cached)} cached")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
