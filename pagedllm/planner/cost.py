"""The step-cost model: how long one engine step takes, from what the scheduler put in it.

A step's wall time (``LLMEngine.step()``: schedule, prepare, forward, sample, update, outputs) is
modelled from five numbers of its stats record (``StepStats``, ``step_features``)::

    tokens             T  new tokens in the step
    seqs               S  requests in the step
    decode_context     D  sum of the context lengths of its 1-token (decode) requests
    decode_shared      Ds of D, the tokens in blocks shared with other requests (prefix hits,
                          forks): one copy serves every holder, so they mostly come from cache
    prefill_attention  A  sum over its multi-token chunks of n * (start + (n + 1) / 2): the
                          query x key pairs of causal attention over n new tokens after
                          ``start`` cached ones

    step_s = dense(T) + per_seq * S + per_decode_context * (D - Ds)
             + per_decode_shared_context * Ds + per_prefill_pair * A

``dense(T)`` (linear layers, norms, the fixed cost of a step) is a table of seconds at a few token
counts (``knots``), interpolated linearly between them and extrapolated from the last two: on a
CPU a matmul over 1 row and over 4 rows take very different paths, so no straight line fits both
small decode batches and long prefill chunks. ``per_seq`` covers per-request work (batch
building, the LM head row, sampling, per-request attention set-up), the attention terms the work
that grows with context.

Every term is linear in its coefficient (the interpolation weights of T are fixed), so ``fit``
is a least-squares problem: minimise the *relative* error over timed steps (they range from a
millisecond to seconds; each should be predicted to a percentage), every coefficient >= 0 (an
active-set loop pins a negative one to zero and refits). Pure Python; a dozen unknowns are a
12x12 solve.

Two checks keep a fit honest. ``unpinned_terms``: a term whose column the timed steps never vary
apart from the others (or never have) could take any value at no cost to the fit, so the
calibration refuses rather than fit it. ``holdout_errors``: each step predicted by the fit of all
the others (leave-one-out), the error on steps the fit did not see; a fit with as many free terms
as steps is exact in-sample and says nothing.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedllm.sched.stats import StepStats

# (tokens, seqs, decode_context, decode_shared_context, prefill_attention)
Features = tuple[float, float, float, float, float]
LINEAR_TERMS = ("per_seq_s", "per_decode_context_s", "per_decode_shared_context_s",
                "per_prefill_pair_s")


def step_features(stats: StepStats) -> Features:
    """(T, S, D, Ds, A) of a step, from its record (``StepStats.open`` right after
    ``schedule()``)."""
    return (float(stats.num_scheduled_tokens), float(stats.num_scheduled_requests),
            float(stats.decode_context_tokens), float(stats.decode_shared_context_tokens),
            stats.prefill_attention_pairs)


def default_knots(max_tokens: int) -> tuple[int, ...]:
    """Token counts 1, 4, 16, 64, ... below ``max_tokens`` (a step's token budget), and it."""
    knots = [k for k in (1, 4, 16, 64, 256, 1024, 4096, 16384) if k < max_tokens]
    return (*knots, max_tokens)


def _hat(knots: Sequence[int], t: float) -> list[float]:
    """Weights of the knot values whose sum is the piecewise-linear interpolation at ``t``
    (beyond the ends: the nearest segment extended)."""
    w = [0.0] * len(knots)
    if len(knots) == 1:
        w[0] = t / knots[0]  # one knot: a line through the origin
        return w
    j = min(max(bisect.bisect_right(knots, t) - 1, 0), len(knots) - 2)
    lo, hi = knots[j], knots[j + 1]
    x = (t - lo) / (hi - lo)
    w[j], w[j + 1] = 1.0 - x, x
    return w


@dataclass(frozen=True)
class StepCostModel:
    """``dense_s[i]``: seconds of the dense part of a step of ``knots[i]`` tokens; the linear
    terms in seconds per unit (module docstring)."""

    knots: tuple[int, ...]
    dense_s: tuple[float, ...]
    per_seq_s: float = 0.0
    per_decode_context_s: float = 0.0
    per_decode_shared_context_s: float = 0.0
    per_prefill_pair_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.knots or list(self.knots) != sorted(set(self.knots)) or self.knots[0] < 1:
            raise ValueError(f"knots={self.knots} must be increasing token counts >= 1")
        if len(self.dense_s) != len(self.knots):
            raise ValueError(f"dense_s has {len(self.dense_s)} values for {len(self.knots)} knots")

    @property
    def coefficients(self) -> tuple[float, ...]:
        return (*self.dense_s, self.per_seq_s, self.per_decode_context_s,
                self.per_decode_shared_context_s, self.per_prefill_pair_s)

    def predict(self, f: Features) -> float:
        return sum(c * x for c, x in zip(self.coefficients, design_row(self.knots, f)))

    def as_dict(self) -> dict[str, object]:
        return {"knots": list(self.knots), "dense_s": list(self.dense_s),
                **{k: getattr(self, k) for k in LINEAR_TERMS}}

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> StepCostModel:
        try:
            return cls(tuple(int(k) for k in d["knots"]),  # type: ignore[attr-defined]
                       tuple(float(v) for v in d["dense_s"]),  # type: ignore[attr-defined]
                       **{k: float(d[k]) for k in LINEAR_TERMS})  # type: ignore[arg-type]
        except (KeyError, TypeError) as e:
            raise ValueError(f"a step-cost model needs knots, dense_s and "
                             f"{', '.join(LINEAR_TERMS)}: {e}") from None


def design_row(knots: Sequence[int], f: Features) -> list[float]:
    tokens, seqs, dctx, shared, pairs = f
    return [*_hat(knots, tokens), seqs, dctx - shared, shared, pairs]


def term_names(knots: Sequence[int]) -> list[str]:
    """The model's free terms, in design-row order: the dense part at each knot, then
    ``LINEAR_TERMS``."""
    return [*(f"dense_s@{k}" for k in knots), *LINEAR_TERMS]


def fit(samples: Sequence[tuple[Features, float]], knots: Sequence[int],
        fixed: Sequence[str] = ()) -> StepCostModel:
    """Non-negative least squares on relative error: minimise sum ((pred - t) / t)^2 over
    ``(features, seconds)`` samples, every coefficient >= 0. Knots no sample comes near (and
    terms no sample has) get 0, as do the ``fixed`` terms (``term_names``: terms the settings
    hold constant); shared decode context, without samples or fixed, costs what private context
    does."""
    system = _System(samples, knots, fixed)
    return system.model(system.nnls(system.free()))


def holdout_errors(samples: Sequence[tuple[Features, float]], knots: Sequence[int],
                   fixed: Sequence[str] = ()) -> list[float]:
    """Leave-one-out: each sample's |pred - t| / t under the fit of all the others (the error on
    a step the fit did not see; a term only one sample pins shows up as that sample's error)."""
    system = _System(samples, knots, fixed)
    errs = []
    for i, (_, t) in enumerate(system.rows):
        model = system.model(system.nnls(system.free(without=i), without=i), without=i)
        errs.append(abs(model.predict(system.features[i]) - t) / t)
    return errs


PIN_TOL = 0.05  # a term is pinned if its column is at least this far out of the others' span


def unpinned_terms(samples: Sequence[tuple[Features, float]], knots: Sequence[int],
                   fixed: Sequence[str] = ()) -> list[tuple[str, float]]:
    """The free terms the samples do not determine, with how far each one's column (scaled as the
    fit sees it) lies outside the span of the other columns: 0 when no sample has the term, near
    0 when the samples only ever vary it together with others (the fit could trade one for the
    others at no cost). Pinned terms have a distance of at least ``PIN_TOL``."""
    system = _System(samples, knots, fixed)
    names = term_names(knots)
    free = [j for j in range(len(names)) if names[j] not in system.fixed]
    out = []
    for j in free:
        if system.ata[j][j] == 0.0:
            out.append((names[j], 0.0))
            continue
        others = [o for o in free if o != j and system.ata[o][o] > 0.0]
        beta = _solve([[system.ata[a][b] for b in others] for a in others],
                      [system.ata[a][j] for a in others])
        resid = system.ata[j][j] - sum(b * system.ata[a][j] for a, b in zip(others, beta))
        dist = math.sqrt(max(resid, 0.0) / system.ata[j][j])
        if dist < PIN_TOL:
            out.append((names[j], dist))
    return out


class _System:
    """The fit's normal equations over ``samples``: rows scaled by 1/t (relative error) and
    columns by their largest value, so that features in the millions do not swamp the solve;
    one row's share can be taken out (``without``) for leave-one-out."""

    def __init__(self, samples: Sequence[tuple[Features, float]], knots: Sequence[int],
                 fixed: Sequence[str]) -> None:
        names = term_names(knots)
        unknown = set(fixed) - set(names)
        if unknown:
            raise ValueError(f"fixed terms {sorted(unknown)} are not among {names}")
        kept = [(f, t) for f, t in samples if t > 0]
        if not kept:
            raise ValueError("no timed steps to fit a step-cost model to")
        self.knots, self.fixed = tuple(knots), frozenset(fixed)
        self.features = [f for f, _ in kept]
        self.rows = [(design_row(knots, f), t) for f, t in kept]
        k = len(names)
        self.scale = [max(abs(r[j]) / t for r, t in self.rows) or 1.0 for j in range(k)]
        self.xs = [[r[j] / t / self.scale[j] for j in range(k)] for r, t in self.rows]
        self.ata = [[sum(x[a] * x[b] for x in self.xs) for b in range(k)] for a in range(k)]
        self.atb = [sum(x[a] for x in self.xs) for a in range(k)]  # target: t / t = 1
        self.shared_j = k - 2

    def free(self, without: int | None = None) -> list[int]:
        """Columns to solve for: not fixed, and some sample (other than ``without``) has them."""
        names = term_names(self.knots)
        return [j for j in range(len(names)) if names[j] not in self.fixed
                and any(x[j] for i, x in enumerate(self.xs) if i != without)]

    def nnls(self, active: list[int], without: int | None = None) -> list[float]:
        """Coefficients (unscaled) of the least squares over ``active`` columns; a negative one
        is pinned to zero and the rest refit, until none is."""
        ata, atb = self.ata, self.atb
        if without is not None:
            x = self.xs[without]
            ata = [[v - x[a] * x[b] for b, v in enumerate(row)] for a, row in enumerate(ata)]
            atb = [v - x[a] for a, v in enumerate(atb)]
        active = list(active)
        coef = [0.0] * len(atb)
        while active:
            sol = _solve([[ata[a][b] for b in active] for a in active], [atb[a] for a in active])
            coef = [0.0] * len(atb)
            for a, j in enumerate(active):
                coef[j] = sol[a] / self.scale[j]
            neg = [j for j in active if coef[j] < 0]
            if not neg:
                break
            active.remove(min(neg, key=lambda j: coef[j]))
        return coef

    def model(self, coef: list[float], without: int | None = None) -> StepCostModel:
        n = len(self.knots)
        per_seq, private, shared, pairs = coef[n:]
        if not any(x[self.shared_j] for i, x in enumerate(self.xs) if i != without) \
                or "per_decode_shared_context_s" in self.fixed:
            shared = private
        return StepCostModel(self.knots, tuple(coef[:n]), per_seq, private, shared, pairs)


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; a tiny ridge keeps collinear columns finite."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for i in range(n):
        m[i][i] += 1e-9 * (1.0 + abs(m[i][i]))
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        if m[c][c] == 0.0:
            continue
        for r in range(c + 1, n):
            q = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= q * m[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        if m[r][r] != 0.0:
            x[r] = (m[r][n] - sum(m[r][j] * x[j] for j in range(r + 1, n))) / m[r][r]
    return x


def relative_errors(model: StepCostModel,
                    samples: Sequence[tuple[Features, float]]) -> list[float]:
    """|pred - t| / t per sample."""
    return [abs(model.predict(f) - t) / t for f, t in samples if t > 0]


def quantile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else math.nan
