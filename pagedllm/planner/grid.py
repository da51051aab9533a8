"""The calibration grid: which steps ``pagedllm plan calibrate`` times, sized to what the KV pool,
the token budget, ``max_model_len`` and ``max_num_seqs`` let run together (pure arithmetic, no
torch), and the error that says which flag to change when they leave a term of the step-cost
model unpinned.

The cells, for decode batches of B requests at context C, mixed with a prefill of P tokens::

    B = 0                 P in 4, 16, 32, ... up to the largest prefill that runs in one step
                          (the token budget, or less: what the pool holds, in prompts as long as
                          max_model_len allows); P >= 256 also in 32-token prompts (pure prefill:
                          the same tokens with less attention, which tells the two apart)
    B = 0, C cached       P in 64, 512 after a prefix hit of C tokens         (chunked prefill)
    B in 1, 2, 4, .. 256  C in 64, 256, 512 (or max_model_len - 64), P = 0      (pure decode)
    B in 4, 16, 64        C = 256, P in 16, 128, 512                          (mixed steps)
    B in 4, 16, 64        C = 256 (or the full blocks that leave room) shared by all,
                          + 16 tokens each, P = 0                             (shared prefix)

A cell is planned only if its blocks fit the pool (a decode request is counted at C + HEADROOM
tokens: it grows while its group runs) and its requests fit ``max_num_seqs``; the calibration
still checks that each one ran as planned and drops any that did not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

SETUP_TOKEN_CAP = 32768  # at most this many context tokens per decode batch (B x C)
HEADROOM = 64  # tokens a decode request may grow by while its group's cells run
PREFILLS = (4, 16, 32, 64, 128, 256, 512, 1024)
POOL_FLAGS = "--num-kv-blocks (or --kv-cache-memory)"

Cell = tuple[int, int]  # (P prompt tokens, in prompts of at most this many; 0 = longest)
Group = tuple[str, int, list[tuple[int, list[Cell]]]]  # (kind, C, [(B, cells), ...])


@dataclass(frozen=True)
class Settings:
    """What bounds the grid (from the engine's configs)."""

    budget: int  # max_num_batched_tokens
    max_len: int
    max_seqs: int
    caching: bool
    num_blocks: int
    block_size: int

    @classmethod
    def of(cls, config: Any, num_blocks: int) -> Settings:
        """From an ``EngineConfig`` and the pool's size in blocks."""
        sc = config.scheduler
        return cls(sc.max_num_batched_tokens, sc.max_model_len, sc.max_num_seqs,
                   config.cache.enable_prefix_caching, num_blocks, config.cache.block_size)

    def facts(self) -> dict[str, int]:
        """The ``made_on`` keys of the pool and budget (``Profile.mismatches`` compares them)."""
        return {"max_num_batched_tokens": self.budget, "max_num_seqs": self.max_seqs,
                "max_model_len": self.max_len, "num_kv_blocks": self.num_blocks,
                "pool_tokens": self.pool_tokens}

    @property
    def pool_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def pieces(self, p: int, chunk: int = 0, cached: int = 0) -> list[int]:
        """The prompts a cell of ``p`` new tokens is added as (``_Runner.timed_cell``)."""
        room = self.max_len - 1 - cached
        if chunk:
            room = min(room, chunk)
        if room < 1:
            return []
        return [room] * (p // room) + ([p % room] if p % room else [])

    def fits(self, p: int, chunk: int = 0, b: int = 0, held: int = 0, cached: int = 0) -> bool:
        """Whether ``p`` new tokens (after a ``cached`` prefix) run in one step beside ``b``
        decodes holding ``held`` blocks: blocks, seats and budget."""
        pieces = self.pieces(p, chunk, cached)
        need = held + sum(self.blocks(cached + n) for n in pieces)
        return bool(pieces) and b + len(pieces) <= self.max_seqs and b + p <= self.budget \
            and need <= self.num_blocks


@dataclass
class Grid:
    groups: list[Group]
    top: int  # the largest one-step prefill planned
    batches: dict[int, int] = field(default_factory=dict)  # decode context -> largest batch
    bounds: dict[str, str] = field(default_factory=dict)  # term -> what limits its cells

    def describe(self) -> str:
        dec = ", ".join(f"B <= {b} at C={c}" for c, b in self.batches.items()) or "none"
        shared = [b for kind, _, sizes in self.groups if kind == "shared" for b, _ in sizes]
        return (f"prefills up to {self.top} tokens (bounded by {self.bounds.get('dense_s', 'the settings')}), "
                f"decode batches {dec}, shared-prefix decode batches "
                f"{'B <= ' + str(max(shared)) if shared else 'none'}")


def plan_grid(s: Settings) -> Grid:
    """The cell groups in the order they run (module docstring). A decode group grows one batch
    at context C through the listed sizes B, timing the cells of each size on the way."""
    room = s.max_len - 64  # decode cells need some steps of headroom
    top, bound = _top_prefill(s)
    prefills = [p for p in PREFILLS if p < top] + ([top] if top > 0 else [])
    cells = [(p, 0) for p in prefills]
    cells += [(p, k) for p in prefills if p >= 256
              and s.fits(p, k := max(32, -(-p // s.max_seqs)))]
    groups: list[Group] = [("prefill", 0, [(0, cells)])] if cells else []
    if s.caching:
        c = min(512, room // 2)
        ps = [(p, 0) for p in (64, 512) if c + p < s.max_len and s.fits(p, cached=c)]
        if c >= 16 and ps:
            groups.append(("cached", c, [(0, ps)]))
    contexts = sorted({c for c in (64, 256, min(512, room)) if 0 < c <= room} or {max(1, room)})
    mixed_c = min(contexts, key=lambda c: abs(c - 256))
    batches = {}
    for c in contexts:
        sizes = []
        per_req = s.blocks(c + HEADROOM)
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            if b > s.max_seqs or b * (c + HEADROOM) > SETUP_TOKEN_CAP \
                    or b * per_req > s.num_blocks:
                break
            cs = [(0, 0)]
            if c == mixed_c and b in (4, 16, 64):
                cs += [(p, 0) for p in (16, 128, 512) if s.fits(p, b=b, held=b * per_req)]
            sizes.append((b, cs))
        if sizes:
            groups.append(("decode", c, sizes))
            batches[c] = sizes[-1][0]
    # decodes whose context is mostly one shared prefix: C full blocks, as many as leave room
    shared_c = mixed_c if mixed_c + 16 <= room else (room - 16) // s.block_size * s.block_size
    if s.caching and shared_c >= s.block_size:
        common = shared_c // s.block_size  # full blocks every request shares
        own = s.blocks(shared_c + 16 + HEADROOM) - common
        shared = [(b, [(0, 0)]) for b in (4, 16, 64) if b <= s.max_seqs
                  and b * HEADROOM <= SETUP_TOKEN_CAP and common + b * own <= s.num_blocks]
        if shared:
            groups.append(("shared", shared_c, shared))
    pool = f"the pool: {POOL_FLAGS}, {s.num_blocks} blocks of {s.block_size} tokens"
    contexts_bound = pool if len(contexts) > 1 else \
        f"--max-model-len={s.max_len}: one decode context fits below it (two need > 128)"
    bounds = {"dense_s": bound, "per_prefill_pair_s": bound,
              # at one context a decode batch's S and D grow together
              "per_seq_s": contexts_bound if s.max_seqs > 1 else "--max-num-seqs",
              "per_decode_context_s": contexts_bound,
              "per_decode_shared_context_s":
              (pool if shared_c >= s.block_size else f"--max-model-len={s.max_len}: a "
               f"shared block and room to decode need {s.block_size + 80}")
              + " (or calibrate with --no-enable-prefix-caching if the planned engine runs "
              "without prefix caching)"}
    return Grid(groups, top, batches, bounds)


def _top_prefill(s: Settings) -> tuple[int, str]:
    """The largest prefill (no more than the budget) that runs in one step on an empty pool, in
    prompts as long as max_model_len allows; and the flag that bounds it."""
    cap = min(s.budget, SETUP_TOKEN_CAP)
    lo, hi = 0, cap  # fits(p) only turns false as p grows
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if s.fits(mid) else (lo, mid - 1)
    if lo == s.budget:
        return lo, "--max-num-batched-tokens"
    if lo == cap:
        return lo, f"the grid's cap of {SETUP_TOKEN_CAP} tokens"
    pieces = s.pieces(lo + 1)
    if len(pieces) > s.max_seqs:
        return lo, f"--max-num-seqs={s.max_seqs} prompts of --max-model-len={s.max_len}"
    return lo, f"the pool: {POOL_FLAGS}, {s.num_blocks} blocks of {s.block_size} tokens"


NEEDS = {
    "dense_s": "steps of about that many tokens",
    "per_seq_s": "steps of many requests beside steps of one request at the same token count "
                 "(decode batches of 2+, or prefills in several prompts)",
    "per_decode_context_s": "decode batches at two or more context lengths",
    "per_decode_shared_context_s": "decode batches of 4+ requests on one shared cached prefix",
    "per_prefill_pair_s": "prefills of the same size in long and in short prompts, or after a "
                          "cached prefix",
}


def refusal(unpinned: Sequence[tuple[str, float]], grid: Grid, s: Settings,
            stopped: str | None) -> str:
    """The error of a calibration that cannot pin every term: which terms, what would pin them,
    what bounds those cells (the flag to change), and what these settings let the grid run."""
    by_base: dict[str, list[tuple[str, float]]] = {}
    for name, dist in unpinned:
        base, _, k = name.partition("@")
        by_base.setdefault(base, []).append((k, dist))
    terms, flags = [], []
    for base, items in by_base.items():
        label = f"{base} at {', '.join(k for k, _ in items)} tokens" if base == "dense_s" else base
        why = "no timed step has it" if all(d == 0 for _, d in items) else \
            "the timed steps never vary it apart from the other terms"
        bound = stopped or grid.bounds.get(base, "the settings")
        terms.append(f"{label} ({why}; it needs {NEEDS[base]}, bounded by {bound})")
        flag = "--max-seconds" if stopped else next(
            (f for f in (POOL_FLAGS, "--max-num-batched-tokens", "--max-model-len",
                         "--max-num-seqs") if f.split()[0] in bound), bound)
        if flag not in flags:
            flags.append(flag)
    return (f"plan calibrate cannot pin the step-cost model: {'; '.join(terms)}. With "
            f"--max-num-batched-tokens={s.budget}, --max-model-len={s.max_len}, --max-num-seqs="
            f"{s.max_seqs} and a pool of {s.pool_tokens} tokens the grid runs {grid.describe()}. "
            f"Raise {' and '.join(flags)}: a fit with a term no step pinned predicts steps it "
            f"never saw")
