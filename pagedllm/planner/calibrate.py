"""``pagedllm plan calibrate``: time real engine steps over a grid and fit the step-cost model.

The engine is the real one (``LLMEngine`` with the given flags); each step's features come from
the record it emits (``engine.stats``, ``StepStats``). Every timed unit is a whole
``engine.step()``, so the profile prices what a replayed step stands for: scheduling, batch
building, the forward, sampling, output processing and memory upkeep.

The grid, for decode batches of B requests at context C, mixed with a prefill of P tokens::

    B = 0                 P in 4, 16, 32, ... up to the token budget, in prompts as long as
                          max_model_len allows; P >= 256 also in 32-token prompts (pure prefill:
                          the same tokens with less attention, which tells the two apart)
    B = 0, C cached       P in 64, 512 after a prefix hit of C tokens         (chunked prefill)
    B in 1, 2, 4, .. 256  C in 64, 256, 512 (or max_model_len - 64), P = 0      (pure decode)
    B in 4, 16, 64        C = 256, P in 16, 128, 512                          (mixed steps)
    B in 4, 16, 64        C = 256 shared by all, + 16 tokens each, P = 0      (shared prefix)

Each cell runs ``reps`` times (more when fast) and keeps the mean without the slowest run (the
machine may be shared and interference only adds time; a replay sums steps, so the mean, not the
median, is what it needs); the steps that prefill the
decode batches are kept as samples too (multi-request prefill chunks, the first steps of any
offline workload). The fit then drops samples more than ``TRIM`` times slower than the first
fit predicts, and refits.

Re-running calibration is all that is needed when the engine gets faster: nothing here assumes
how the step time splits between its parts.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

from pagedllm.args import EngineArgs
from pagedllm.planner.cost import (
    Features,
    StepCostModel,
    default_knots,
    fit,
    quantile,
    relative_errors,
    step_features,
)
from pagedllm.planner.profile import Profile, describe_config, machine

logger = logging.getLogger(__name__)

CLOCKS = {
    # wall: seconds as they pass (what a user waits) -- on a shared machine this includes the
    # time other processes take the CPU away
    "wall": time.perf_counter,
    # cpu: this process's CPU seconds -- what the step costs on a dedicated core; reproducible
    # on a busy machine, meaningful with one torch thread only
    "cpu": time.process_time,
}
TRIM = 1.5  # a sample taking > (1 + TRIM) x the first fit's prediction is interference
SETUP_TOKEN_CAP = 32768  # at most this many context tokens per decode batch (B x C)


def calibrate(args: EngineArgs, reps: int = 3, max_seconds: float = 300.0,
              threads: int | None = None, clock: str = "wall",
              log: Callable[[str], None] = print) -> Profile:
    """Time the grid on the engine ``args`` describe and fit; stops adding cells after
    ``max_seconds`` on ``clock`` (see ``CLOCKS``; the fit uses what was measured): CPU seconds
    on a shared machine, where a wall-clock budget ends the grid early."""
    import torch

    from pagedllm.engine import LLMEngine

    if threads:
        torch.set_num_threads(threads)
    read = clock_reader(clock, torch.get_num_threads())

    t_start = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    cfg = engine.config
    run = _Runner(engine, cfg.model.vocab_size, read)
    budget = cfg.scheduler.max_num_batched_tokens
    max_len = cfg.scheduler.max_model_len
    max_seqs = cfg.scheduler.max_num_seqs
    run.prefill(min(64, max_len - 2))  # warm-up: first-call allocations, kernel selection

    groups = _grid(budget, max_len, max_seqs, cfg.cache.enable_prefix_caching,
                   engine.kv.num_blocks * engine.kv.block_size)
    deadline = read() + max_seconds
    for n, (kind, c, sizes) in enumerate(groups):
        late = False
        if kind in ("cached", "shared"):
            run.cache_context(c)
        for b, cells in sizes:
            late = read() > deadline
            if late:
                break
            if kind in ("decode", "shared"):
                run.grow_decodes(b, c, shared=kind == "shared")
            for p, chunk in cells:
                run.timed_cell(reps, p, chunk, cached=c if kind == "cached" else 0)
            ps = ",".join(f"{p}" + (f"/{k}" if k else "") for p, k in cells)
            log(f"  {kind:7s} C={c:<5d} B={b:<4d} P={ps:<40s} "
                f"{len(run.samples):4d} samples {time.perf_counter() - t_start:6.1f} s")
        run.reset()
        if late:
            log(f"calibration stopped at --max-seconds={max_seconds:g} in group {n + 1} of "
                f"{len(groups)}; the fit uses what was measured")
            break

    knots = default_knots(budget)
    samples = run.samples
    model = fit(samples, knots)
    kept = [(f, t) for f, t in samples if t <= (1 + TRIM) * model.predict(f)]
    if len(kept) >= len(samples) // 2:
        model = fit(kept, knots)
    errs = relative_errors(model, samples)
    made_on = {**describe_config(cfg), "max_num_batched_tokens": budget,
               "max_num_seqs": max_seqs, "max_model_len": max_len,
               "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
               "clock": clock,
               **machine(), "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
               "calibration_s": round(time.perf_counter() - t_start, 1)}
    try:
        with open("/proc/loadavg") as fh:
            made_on["loadavg"] = fh.read().split()[:3]
    except OSError:
        pass
    engine.shutdown()
    fit_stats = {"num_samples": len(samples), "num_kept": len(kept),
                 "median_rel_err": quantile(errs, 0.5), "p90_rel_err": quantile(errs, 0.9)}
    return Profile(model, made_on, fit_stats, [[*f, t] for f, t in samples])


Cell = tuple[int, int]  # (P prompt tokens, in prompts of at most this many; 0 = longest)
Group = tuple[str, int, list[tuple[int, list[Cell]]]]  # (kind, C, [(B, cells), ...])


def clock_reader(clock: str, threads: int) -> Callable[[], float]:
    if clock not in CLOCKS:
        raise ValueError(f"--clock {clock!r}: choose one of {', '.join(CLOCKS)}")
    if clock == "cpu" and threads != 1:
        raise ValueError(f"--clock cpu sums the CPU time of every thread; with {threads} torch "
                         f"threads that is not a step's duration; pass --threads 1")
    return CLOCKS[clock]


def _grid(budget: int, max_len: int, max_seqs: int, caching: bool, pool_tokens: int) -> list[Group]:
    """The cell groups in the order they run (module docstring). A decode group grows one batch
    at context C through the listed sizes B, timing the cells of each size on the way."""
    room = max_len - 64  # decode cells need some steps of headroom
    cap = min(SETUP_TOKEN_CAP, pool_tokens - budget)  # room left for a prefill cell
    top = min(budget, cap)
    prefills = [p for p in (4, 16, 32, 64, 128, 256, 512, 1024) if p < top] + [top]
    short = [(p, max(32, -(-p // max_seqs))) for p in prefills if p >= 256]
    groups: list[Group] = [("prefill", 0, [(0, [(p, 0) for p in prefills] + short)])]
    if caching:
        c = min(512, room // 2)
        ps = [(p, 0) for p in (64, 512) if c + p < max_len and p <= budget]
        if c >= 16 and ps:
            groups.append(("cached", c, [(0, ps)]))
    contexts = sorted({c for c in (64, 256, min(512, room)) if 0 < c <= room} or {max(1, room)})
    mixed_c = min(contexts, key=lambda c: abs(c - 256))
    for c in contexts:
        sizes = []
        for b in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            if b > max_seqs or b * (c + 64) > cap:
                break
            cells = [(0, 0)]
            if c == mixed_c and b in (4, 16, 64):
                cells += [(p, 0) for p in (16, 128, 512) if b + p <= budget and b < max_seqs]
            sizes.append((b, cells))
        if sizes:
            groups.append(("decode", c, sizes))
    if caching and mixed_c + 16 <= room:  # decodes whose context is mostly one shared prefix
        shared = [(b, [(0, 0)]) for b in (4, 16, 64) if b <= max_seqs and b * 64 <= cap]
        if shared:
            groups.append(("shared", mixed_c, shared))
    return groups


class _Runner:
    """Builds the grid's situations on the engine and times single steps."""

    def __init__(self, engine: Any, vocab: int, read: Callable[[], float]) -> None:
        self.engine, self.sched, self.read = engine, engine.scheduler, read
        self.rng = random.Random(0)
        self.vocab = vocab
        self.samples: list[tuple[Features, float]] = []
        self.ids = 0
        self.context: list[int] = []
        self.added: list[str] = []  # request ids to abort at the end of a group

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(4, self.vocab) for _ in range(n)]  # fresh: no prefix hits

    def _add(self, tokens: list[int], max_tokens: int) -> str:
        from pagedllm.sampling_params import SamplingParams

        self.ids += 1
        rid = f"cal{self.ids}"
        self.added.append(rid)
        self.engine.add_request(rid, {"prompt_token_ids": tokens},
                                SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                               ignore_eos=True))
        return rid

    def _step(self) -> tuple[Features, float]:
        t0 = self.read()
        self.engine.step()
        return step_features(self.engine.stats), self.read() - t0  # the step's own record

    def prefill(self, n: int) -> None:
        self._add(self._tokens(n), 4)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def cache_context(self, c: int) -> None:
        """Compute (and leave cached) a prompt of ``c`` tokens that cells then extend."""
        self.context = self._tokens(c)
        self._add(self.context, 1)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def grow_decodes(self, b: int, c: int, shared: bool = False) -> None:
        """Add ``c``-token prompts (``shared``: the cached context and 16 tokens of their own)
        until ``b`` requests run; step (those steps kept as samples) until every one of them
        decodes."""
        for _ in range(b - len(self.sched.running)):
            self._add(self.context + self._tokens(16) if shared else self._tokens(c), 10**6)
        while self.sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                        for r in self.sched.running):
            self.samples.append(self._step())

    def timed_cell(self, reps: int, p: int, chunk: int = 0, cached: int = 0) -> None:
        """Steps of the running decodes plus, when ``p``, ``p`` new prompt tokens (after the
        cached context when ``cached``) that finish in their one step: prompts of ``chunk``
        tokens (0: as long as max_model_len allows), as many as ``p`` needs. At least ``reps``
        steps, up to three times that while the cell has taken under 0.2 s (fast cells are the
        noisiest)."""
        room = self.engine.config.scheduler.max_model_len - 1 - cached
        if chunk:
            room = min(room, chunk)
        runs: list[tuple[Features, float]] = []
        spent = 0.0
        while len(runs) < reps or (len(runs) < 3 * reps and spent < 0.2):
            left = p
            while left > 0:
                n = min(left, room)
                self._add((self.context[:cached] if cached else []) + self._tokens(n), 1)
                left -= n
            runs.append(self._step())
            spent += runs[-1][1]
        feats = tuple(statistics.fmean(f[i] for f, _ in runs) for i in range(len(runs[0][0])))
        times = sorted(t for _, t in runs)
        kept = times[:-1] if len(times) >= 3 else times  # the slowest is most likely interference
        self.samples.append((feats, statistics.fmean(kept)))  # type: ignore[arg-type]

    def reset(self) -> None:
        for rid in self.added:
            self.engine.abort_request(rid)
        self.added.clear()
        self.engine.kv.reset_prefix_cache()


def summarize_fit(model: StepCostModel) -> str:
    """One line per term, for the calibrate command's output."""
    dense = ", ".join(f"{k}: {v * 1e3:.2f}" for k, v in zip(model.knots, model.dense_s))
    return (f"dense part (ms at T tokens) {dense}\n"
            f"per request {model.per_seq_s * 1e3:.3f} ms, decode attention "
            f"{model.per_decode_context_s * 1e9:.2f} ns per context token "
            f"({model.per_decode_shared_context_s * 1e9:.2f} shared), prefill attention "
            f"{model.per_prefill_pair_s * 1e9:.3f} ns per query-key pair")
