"""A picture of the KV manager's state as plain JSON-able data: the inspector page's block map,
block tables, host tier and prefix-cache tree (live from the server, or per step of a replayed
allocation trace). Pure Python; reads the manager's and the pool's state, never changes it
(the held block tables straight from ``kv.tables.held``, as ``check_integrity`` does).

One character per device block (``BLOCK_STATES``), in block id order::

    blocks  "uuhh.s..cca"     u = in use (ref 1)           h = in use and in the prefix index
                              s = shared (ref > 1)         c = free, cached prefix (evictable)
                              . = free                     a = a LoRA adapter's weights (ref 1)
    refs    {5: 3}            ref counts of the shared blocks
    host    "ww.."            w = holds a swapped-out request's KV   . = free host block
    adapters {"3": [9, 10]}   the resident LoRA adapters' blocks, by adapter id (kv/adapters.py)

The prefix tree is the pool's hash index: one node per cached block ``[block, parent, hits,
hash]`` where ``parent`` is the block holding the previous block of the chain, ``ROOT`` for a
chain's first block, or ``ORPHAN`` when that block was evicted (the chain below it can no longer
be hit). Cost: O(blocks + table entries), a few ms for 10,000 blocks.
"""

from __future__ import annotations

from typing import Any

from pagedllm.kv.block_pool import hash_hex
from pagedllm.kv.manager import KVCacheManager

BLOCK_STATES = {".": "free", "c": "cached", "u": "used", "h": "used_cached", "s": "shared",
                "a": "lora"}
ROOT, ORPHAN = -1, -2


def capture_kv(kv: KVCacheManager) -> dict[str, Any]:
    """The manager's blocks, tables, host tier and prefix tree now (see the module docstring)."""
    pool = kv.pool
    chars: list[str] = []
    refs: dict[int, int] = {}
    for b in pool.blocks:
        r = b.ref_cnt
        if r == 0:
            chars.append("." if b.block_hash is None else "c")
        elif r == 1:
            chars.append("u" if b.block_hash is None else "h")
        else:
            chars.append("s")
            refs[b.block_id] = r
    adapters = {str(i): kv.adapters.blocks_of(i) for i in kv.adapters.resident}
    for ids in adapters.values():
        for i in ids:
            chars[i] = "a"
    host = ["."] * kv.host.num_blocks
    host_tables = {}
    for rid in kv.host.requests:
        host_tables[rid] = kv.host.blocks_of(rid)
        for i in host_tables[rid]:
            host[i] = "w"
    prefix = []
    for value, b in pool.cached.items():
        assert b.block_hash is not None
        parent = b.block_hash.parent
        if parent is None:
            up = ROOT
        else:
            holder = pool.cached.get(parent)
            up = ORPHAN if holder is None else holder.block_id
        prefix.append([b.block_id, up, b.num_hits, hash_hex(value)[:8]])
    return {
        "block_size": kv.block_size,
        "num_blocks": pool.num_blocks,
        "blocks": "".join(chars),
        "refs": refs,
        "host": "".join(host),
        "tables": {rid: [b.block_id for b in t] for rid, t in kv.tables.held.items()},  # held
        "host_tables": host_tables,
        "adapters": adapters,
        "prefix": prefix,
    }


def count_states(snapshot: dict[str, Any]) -> dict[str, int]:
    """Blocks by state, named as ``LLMEngine.kv_stats()`` names them, from a snapshot's map."""
    blocks: str = snapshot["blocks"]
    n = {c: blocks.count(c) for c in BLOCK_STATES}
    return {
        "num_blocks": len(blocks),
        "free_blocks": n["."] + n["c"],
        "cached_blocks": n["c"],
        "used_blocks": n["u"] + n["h"] + n["s"] + n["a"],
        "shared_blocks": n["s"],
        "lora_blocks": n["a"],
        "host_used_blocks": snapshot["host"].count("w"),
    }
