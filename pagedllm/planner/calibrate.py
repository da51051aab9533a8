"""``pagedllm plan calibrate``: time real engine steps over a grid and fit the step-cost model.

The engine is the real one (``LLMEngine`` with the given flags); each step's features come from
the record it emits (``engine.stats``, ``StepStats``). Every timed unit is a whole
``engine.step()``, so the profile prices what a replayed step stands for: scheduling, batch
building, the forward, sampling, output processing and memory upkeep.

The grid (``grid.py``) is sized to what the pool, the token budget, max_model_len and
max_num_seqs let run together; a cell that still does not run as planned (a prefill left
waiting, a preemption) is dropped and reported.

Each cell runs ``reps`` times (more when fast) and keeps the mean without the slowest run (the
machine may be shared and interference only adds time; a replay sums steps, so the mean, not the
median, is what it needs); the steps that prefill the
decode batches are kept as samples too (multi-request prefill chunks, the first steps of any
offline workload). The fit then drops samples more than ``TRIM`` times slower than the first
fit predicts, and refits.

Before fitting, every term of the cost model must be pinned by the steps that ran
(``cost.unpinned_terms``), or calibrate refuses with the flag to change (``grid.refusal``):
a fit with a free term nothing measured would fit the samples and predict nonsense. Terms the
settings hold constant are fixed instead (one request per step: ``per_seq_s`` is 0, the dense
part carries it; no prefix caching: shared context costs what private context does). The fit's
quality is measured on steps it did not see: each kept sample predicted by the fit of all the
others (leave-one-out), printed and stored in the profile.

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
from pagedllm.bench.report import loadavg
from pagedllm.planner.cost import (
    Features,
    StepCostModel,
    default_knots,
    fit,
    holdout_errors,
    quantile,
    relative_errors,
    step_features,
    unpinned_terms,
)
from pagedllm.planner.grid import Grid, Settings, plan_grid, refusal
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


class CalibrationError(ValueError):
    """The grid these settings allow cannot pin the cost model (the message names the flag)."""


def calibrate(args: EngineArgs, reps: int = 3, max_seconds: float = 300.0,
              threads: int | None = None, clock: str = "wall",
              log: Callable[[str], None] = print) -> Profile:
    """Time the grid on the engine ``args`` describe and fit; stops adding cells after
    ``max_seconds`` on ``clock`` (see ``CLOCKS``): CPU seconds on a shared machine, where a
    wall-clock budget ends the grid early. Raises ``CalibrationError`` if the steps that ran do
    not pin every term of the model."""
    import torch

    from pagedllm.engine import LLMEngine

    if threads:
        torch.set_num_threads(threads)
    read = clock_reader(clock, torch.get_num_threads())

    t_start = time.perf_counter()
    engine = LLMEngine.from_engine_args(args)
    try:
        cfg = engine.config
        settings = Settings.of(cfg, engine.kv.max_num_blocks)
        grid = plan_grid(settings)
        log(f"grid: {grid.describe()}")
        run = _Runner(engine, cfg.model.vocab_size, read, reps)
        run.prefill(min(64, settings.max_len - 2))  # warm-up: first-call allocations, kernels
        stopped = _run_grid(run, grid, read() + max_seconds, max_seconds, t_start, log)
    finally:
        engine.shutdown()
    if run.dropped:
        log(f"{len(run.dropped)} cell(s) did not run as planned and were dropped: "
            + "; ".join(run.dropped))
    profile = fit_profile(run.samples, settings, grid, stopped)
    f = profile.fit
    profile.made_on.update({
        **describe_config(cfg), **settings.facts(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "clock": clock, **machine(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "calibration_s": round(time.perf_counter() - t_start, 1)})
    f["num_dropped_cells"] = len(run.dropped)
    if (load := loadavg()) is not None:
        profile.made_on["loadavg"] = load
    return profile


def _run_grid(run: _Runner, grid: Grid, deadline: float, max_seconds: float, t_start: float,
              log: Callable[[str], None]) -> str | None:
    """Time the grid's cells until done or ``deadline`` (on the run's clock); None, or where
    the deadline stopped it."""
    groups = grid.groups
    for n, (kind, c, sizes) in enumerate(groups):
        late = False
        if kind in ("cached", "shared"):
            run.cache_context(c)
        for b, cells in sizes:
            late = run.read() > deadline
            if late:
                break
            if kind in ("decode", "shared"):
                run.grow_decodes(b, c, shared=kind == "shared")
            for p, chunk in cells:
                run.timed_cell(run.reps, p, chunk, cached=c if kind == "cached" else 0,
                               label=f"{kind} C={c} B={b} P={p}" + (f"/{chunk}" if chunk else ""))
            ps = ",".join(f"{p}" + (f"/{k}" if k else "") for p, k in cells)
            log(f"  {kind:7s} C={c:<5d} B={b:<4d} P={ps:<40s} "
                f"{len(run.samples):4d} samples {time.perf_counter() - t_start:6.1f} s")
        run.reset()
        if late:
            where = (f"calibration stopped at --max-seconds={max_seconds:g} in group {n + 1} "
                     f"of {len(groups)} ({kind} C={c})")
            log(f"{where}; the fit uses what was measured")
            return where
    return None


def fit_profile(samples: list[tuple[Features, float]], settings: Settings, grid: Grid,
                stopped: str | None = None) -> Profile:
    """The fit of ``samples`` (refused if a term is unpinned), trimmed of interference, with its
    in-sample and leave-one-out errors."""
    if not samples:
        raise CalibrationError(refusal([("dense_s@1", 0.0)], grid, settings, stopped))
    knots = default_knots(max(1, int(max(f[0] for f, _ in samples))))  # the largest step run
    fixed = fixed_terms(settings)
    unpinned = unpinned_terms(samples, knots, fixed)
    if unpinned:
        raise CalibrationError(refusal(unpinned, grid, settings, stopped))
    model = fit(samples, knots, fixed)
    kept = [(f, t) for f, t in samples if t <= (1 + TRIM) * model.predict(f)]
    if len(kept) >= len(samples) // 2 and not unpinned_terms(kept, knots, fixed):
        model = fit(kept, knots, fixed)
    else:
        kept = list(samples)
    errs = relative_errors(model, samples)
    held = holdout_errors(kept, knots, fixed)
    stats: dict[str, Any] = {
        "num_samples": len(samples), "num_kept": len(kept),
        "num_terms": len(model.coefficients) - len(fixed), "fixed_terms": sorted(fixed),
        "median_rel_err": quantile(errs, 0.5), "p90_rel_err": quantile(errs, 0.9),
        "holdout": "leave-one-out over the kept samples",
        "holdout_median_rel_err": quantile(held, 0.5), "holdout_p90_rel_err": quantile(held, 0.9),
        "holdout_max_rel_err": max(held)}
    if stopped:
        stats["stopped"] = stopped
    return Profile(model, {"largest_timed_step": knots[-1]}, stats,
                   [[*f, t] for f, t in samples])


def fixed_terms(s: Settings) -> tuple[str, ...]:
    """Terms these settings hold constant, fixed rather than fitted (module docstring)."""
    fixed = []
    if s.max_seqs == 1:
        fixed.append("per_seq_s")
    if not s.caching:
        fixed.append("per_decode_shared_context_s")
    return tuple(fixed)


def clock_reader(clock: str, threads: int) -> Callable[[], float]:
    if clock not in CLOCKS:
        raise ValueError(f"--clock {clock!r}: choose one of {', '.join(CLOCKS)}")
    if clock == "cpu" and threads != 1:
        raise ValueError(f"--clock cpu sums the CPU time of every thread; with {threads} torch "
                         f"threads that is not a step's duration; pass --threads 1")
    return CLOCKS[clock]


class _Runner:
    """Builds the grid's situations on the engine and times single steps."""

    def __init__(self, engine: Any, vocab: int, read: Callable[[], float], reps: int) -> None:
        self.engine, self.sched, self.read, self.reps = engine, engine.scheduler, read, reps
        self.dropped: list[str] = []  # cells that did not run as planned, and why
        self.rng = random.Random(0)
        self.vocab = vocab
        self.samples: list[tuple[Features, float]] = []
        self.ids = 0
        self.context: list[int] = []
        self.added: list[str] = []  # request ids to abort at the end of a group

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(4, self.vocab) for _ in range(n)]  # fresh: no prefix hits

    def _add(self, tokens: list[int], max_tokens: int) -> str:
        from pagedllm.bench.workload import BenchRequest, submissions

        self.ids += 1
        (sub,) = submissions(self.engine, [BenchRequest(tokens, max_tokens)],
                             prefix=f"cal{self.ids}-")
        self.added.append(sub.request_id)
        sub.add(sub.request_id)  # queued now: the cell times the step that takes it
        return sub.request_id

    def _step(self) -> tuple[Features, float]:
        """One step of the situation the cell built, timed (a drive would add and finish
        requests around it; calibration times single steps of chosen compositions)."""
        t0 = self.read()
        self.engine.step()
        return step_features(self.engine.stats), self.read() - t0  # the step's own record

    def prefill(self, n: int) -> None:
        """Run one prompt of ``n`` tokens (4 output tokens) to the end: warm-up."""
        self._run_one(self._tokens(n), 4)

    def cache_context(self, c: int) -> None:
        """Compute (and leave cached) a prompt of ``c`` tokens that cells then extend."""
        self.context = self._tokens(c)
        self._run_one(self.context, 1)

    def _run_one(self, tokens: list[int], max_tokens: int) -> None:
        from pagedllm.bench.workload import BenchRequest, submissions
        from pagedllm.engine.drive import drive

        self.ids += 1
        drive(self.engine, submissions(self.engine, [BenchRequest(tokens, max_tokens)],
                                       prefix=f"cal{self.ids}-"))

    def grow_decodes(self, b: int, c: int, shared: bool = False) -> None:
        """Add ``c``-token prompts (``shared``: the cached context and 16 tokens of their own)
        until ``b`` requests run; step (those steps kept as samples) until every one of them
        decodes."""
        for _ in range(b - len(self.sched.running)):
            self._add(self.context + self._tokens(16) if shared else self._tokens(c), 10**6)
        budget = self.engine.config.scheduler.max_num_batched_tokens
        for _ in range(4 * (b + b * (c + 16) // budget) + 64):  # bounded: each step prefills
            if not (self.sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in self.sched.running)):
                return
            self.samples.append(self._step())
        raise RuntimeError(f"calibration could not bring {b} requests of {c} tokens to decode "
                           f"(the pool holds {self.engine.kv.num_blocks} blocks); this is a bug "
                           f"in the grid's sizing (pagedllm/planner/grid.py)")

    def timed_cell(self, reps: int, p: int, chunk: int = 0, cached: int = 0,
                   label: str = "") -> None:
        """Steps of the running decodes plus, when ``p``, ``p`` new prompt tokens (after the
        cached context when ``cached``) that finish in their one step: prompts of ``chunk``
        tokens (0: as long as max_model_len allows), as many as ``p`` needs. At least ``reps``
        steps, up to three times that while the cell has taken under 0.2 s (fast cells are the
        noisiest). A step that does not run as planned (not all ``p`` tokens beside every
        decode, or a preemption) drops the cell: its leftover prompts are aborted."""
        room = self.engine.config.scheduler.max_model_len - 1 - cached
        if chunk:
            room = min(room, chunk)
        runs: list[tuple[Features, float]] = []
        spent = 0.0
        while len(runs) < reps or (len(runs) < 3 * reps and spent < 0.2):
            want, preempted = len(self.sched.running) + p, self.engine.num_preemptions
            left, rids = p, []
            while left > 0:
                n = min(left, room)
                rids.append(self._add((self.context[:cached] if cached else []) + self._tokens(n), 1))
                left -= n
            feats, t = self._step()
            if feats[0] != want or self.engine.num_preemptions != preempted:
                for rid in rids:
                    self.engine.abort_request(rid)  # False for those that finished
                self.dropped.append(f"{label}: ran {int(feats[0])} of {want} tokens"
                                    + (", preempted" if self.engine.num_preemptions != preempted
                                       else ""))
                return
            runs.append((feats, t))
            spent += t
        feats_mean = tuple(statistics.fmean(f[i] for f, _ in runs) for i in range(len(runs[0][0])))
        times = sorted(t for _, t in runs)
        kept = times[:-1] if len(times) >= 3 else times  # the slowest is most likely interference
        self.samples.append((feats_mean, statistics.fmean(kept)))  # type: ignore[arg-type]

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
