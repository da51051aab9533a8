"""Seeded benchmark workloads: long-tailed synthetic, fixed lengths, multi-turn chat, JSONL traces.

A workload is a list of ``BenchRequest`` (prompt token ids, output length, optional arrival
time). Synthetic prompts are token ids drawn uniformly from the tokenizer's vocabulary (special
tokens excluded); requests run with ``ignore_eos`` so that output lengths are exactly the drawn
``max_tokens`` on every backend.

``longtail`` (chat-like traffic, the default): prompt and output lengths are log-normal,
``round(exp(N(log(median), sigma)))``, clipped to ``[min_len, ...]`` and so that
``prompt + output <= max_model_len``. Defaults: prompts median 96, sigma 0.8 (p90 ~ 270);
outputs median 64, sigma 0.9 (p90 ~ 200). Most requests are short, a few are long: the
shape of ShareGPT-style traces, which is what a max-length reservation wastes memory on.

``chat``: ``num_conversations`` conversations of ``turns`` turns, all starting with one shared
system prompt; turn k's prompt is system + (user, assistant) * (k-1) + user, the history made of
synthetic tokens, so later turns hit the prefix cache.

``code``: ``--input-len`` token windows from the middle of the shipped model's held-out source
files (``code_prompts``), ``--output-len`` tokens each: text that repeats its own
context, where speculative decoding's prompt lookup pays.

``multi-tenant``: ``num_tenants`` system prompts of ``system_len`` tokens (one per tenant),
each followed by the questions of ``users_per_tenant`` users (``user_len`` fresh tokens each,
``output_len`` output tokens): ``num_tenants x users_per_tenant`` requests (default: ``num_prompts``
spread over the tenants), in one seeded shuffle, so tenants interleave as in real traffic. What
a data-parallel router can save: every replica a tenant's requests reach computes its system
prompt once.

``trace``: JSONL lines ``{"prompt": str | "prompt_token_ids": [int], "max_tokens": int,
"arrival_time": float?, "n": int?, "output_token_ids": [int] | [[int]]?}`` (arrival: seconds
from the start; ``output_token_ids``: what a recorded run generated, one list per sequence, which
the planner replays token for token).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from dataclasses import asdict, dataclass, fields
from functools import partial
from pathlib import Path
from typing import Any

from pagedllm.flags import add_flags, setting

WORKLOADS = ("longtail", "fixed", "chat", "trace", "code", "multi-tenant")


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float | None = None  # seconds from the start; None = all at once
    prompt: str | None = None  # the text, when the workload came from text
    lora_id: int | None = None  # the LoRA adapter it runs (the planner's --lora-adapters)
    n: int = 1  # sequences per request (SamplingParams.n)
    # the tokens each of the n sequences generates (a recorded run), for the planner's replay:
    # speculative decoding accepts what they say (executor/simulated.py); None: stand-ins
    output_token_ids: list[list[int]] | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


W = "workload"  # the flags' help section


@dataclass(frozen=True)
class WorkloadSpec:
    """One workload, as ``bench`` and ``plan`` take it: each field with a help text is a flag
    (``add_cli_args``); ``seed`` and ``max_model_len`` are the engine's."""

    kind: str = setting("longtail", "what the requests look like", group=W, choices=WORKLOADS,
                        flag="--workload")
    num_prompts: int = setting(64, "requests in the workload", group=W)
    seed: int = 0
    max_model_len: int = 512
    # longtail
    prompt_median: float = setting(96.0, "longtail: median prompt length", group=W)
    prompt_sigma: float = setting(0.8, "longtail: log-normal sigma", group=W)
    output_median: float = setting(64.0, "longtail: median output length", group=W)
    output_sigma: float = setting(0.9, "longtail: log-normal sigma", group=W)
    min_len: int = 4
    # fixed
    input_len: int = setting(128, "fixed: prompt length", group=W)
    output_len: int = setting(128, "fixed / chat: output length", group=W)
    # chat
    system_len: int = setting(128, "chat / multi-tenant: shared system prompt length", group=W)
    turns: int = setting(4, "chat: turns per conversation", group=W)
    user_len: int = setting(32, "chat: tokens per user/assistant message; multi-tenant: per question", group=W)
    num_tenants: int = setting(8, "multi-tenant: system prompts", group=W)
    users_per_tenant: int | None = setting(
        None, "multi-tenant: requests per system prompt (default: --num-prompts spread over the "
        "tenants)", group=W)
    # trace
    trace: str | None = setting(None, "JSONL trace for --workload trace", group=W)
    # arrivals (only the commands that pass ``arrivals=True`` take the flag)
    request_rate: float | None = setting(
        None, "Poisson arrivals, requests/s; inf: all at once (unset: the trace's arrival_time, "
        "else all at once)", group=W)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, num_prompts: int,
                     arrivals: bool = False) -> None:
        """The workload flags, ``--num-prompts`` defaulting to ``num_prompts``; ``arrivals``:
        also ``--request-rate``."""
        names = [f.name for f in fields(WorkloadSpec) if "help" in f.metadata]
        add_flags(parser, WorkloadSpec, {W: "workload (seeded; see pagedllm.bench.workload)"},
                  only=names if arrivals else [n for n in names if n != "request_rate"])
        parser.set_defaults(num_prompts=num_prompts)

    @staticmethod
    def cli_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
        """The spec's fields ``add_cli_args`` put into ``ns``, and the engine's seed."""
        kw = {f.name: getattr(ns, f.name) for f in fields(WorkloadSpec)
              if "help" in f.metadata and hasattr(ns, f.name)}
        return {**kw, "seed": ns.seed}

    def arrivals(self, reqs: list[BenchRequest]) -> list[float]:
        return arrivals(reqs, self.request_rate, self.seed)

    def describe(self) -> dict[str, Any]:
        d = asdict(self)
        keep = {
            "longtail": ("prompt_median", "prompt_sigma", "output_median", "output_sigma", "min_len"),
            "fixed": ("input_len", "output_len"),
            "chat": ("system_len", "turns", "user_len", "output_len"),
            "trace": ("trace",),
            "code": ("input_len", "output_len"),
            "multi-tenant": ("num_tenants", "users_per_tenant", "system_len", "user_len",
                             "output_len"),
        }[self.kind]
        return {k: d[k] for k in ("kind", "num_prompts", "seed", "max_model_len", *keep)}


def vocab_ids(tokenizer: Any, vocab_size: int | None = None) -> list[int]:
    """Ids a synthetic prompt may use: the model vocabulary minus special tokens."""
    n = vocab_size if vocab_size is not None else len(tokenizer)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids = [i for i in range(n) if i not in special]
    if not ids:
        raise ValueError("the tokenizer has no non-special tokens to build prompts from")
    return ids


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(math.exp(rng.gauss(math.log(median), sigma)))))


def _tokens(rng: random.Random, ids: list[int], n: int) -> list[int]:
    return [ids[rng.randrange(len(ids))] for _ in range(n)]


def make_workload(spec: WorkloadSpec, vocab: list[int], tokenizer: Any = None) -> list[BenchRequest]:
    """Build the workload ``spec`` describes; same spec and vocabulary -> same requests."""
    rng = random.Random(spec.seed)
    limit = spec.max_model_len
    if spec.kind == "longtail":
        out = []
        for _ in range(spec.num_prompts):
            p = _lognormal(rng, spec.prompt_median, spec.prompt_sigma, spec.min_len, limit - spec.min_len)
            o = _lognormal(rng, spec.output_median, spec.output_sigma, 1, limit - p)
            out.append(BenchRequest(_tokens(rng, vocab, p), o))
        return out
    if spec.kind == "fixed":
        if spec.input_len + spec.output_len > limit:
            raise ValueError(f"--input-len {spec.input_len} + --output-len {spec.output_len} "
                             f"exceeds max_model_len={limit}; shorten them or raise --max-model-len")
        return [BenchRequest(_tokens(rng, vocab, spec.input_len), spec.output_len)
                for _ in range(spec.num_prompts)]
    if spec.kind == "chat":
        return _chat(spec, rng, vocab)
    if spec.kind == "multi-tenant":
        return _multi_tenant(spec, rng, vocab)
    if spec.kind == "code":  # the shipped model's held-out source: text that repeats itself
        if tokenizer is None or spec.input_len + spec.output_len > limit:
            raise ValueError("--workload code needs a tokenizer and --input-len + --output-len "
                             f"within max_model_len={limit}")
        return [BenchRequest(p, spec.output_len)
                for p in code_prompts(tokenizer, spec.num_prompts, spec.input_len)]
    if spec.kind == "trace":
        if not spec.trace:
            raise ValueError("--workload trace needs --trace FILE (JSONL)")
        return load_trace(spec.trace, tokenizer, spec.num_prompts)
    raise ValueError(f"unknown workload {spec.kind!r}; choose one of {', '.join(WORKLOADS)}")


def _chat(spec: WorkloadSpec, rng: random.Random, vocab: list[int]) -> list[BenchRequest]:
    system = _tokens(rng, vocab, spec.system_len)
    turn_len = 2 * spec.user_len  # user message + the (synthetic) assistant reply before it
    max_turns = max(1, (spec.max_model_len - spec.system_len - spec.output_len) // turn_len)
    turns = min(spec.turns, max_turns)
    if spec.system_len + spec.user_len + spec.output_len > spec.max_model_len:
        raise ValueError(f"--system-len + --user-len + --output-len exceed max_model_len="
                         f"{spec.max_model_len}")
    convs = -(-spec.num_prompts // turns)
    out: list[BenchRequest] = []
    for k in range(turns):  # turn-major: every conversation's turn k before any turn k+1
        for c in range(convs):
            if len(out) == spec.num_prompts:
                break
            crng = random.Random(spec.seed * 100003 + c)  # a conversation's history is stable
            history: list[int] = []
            for _ in range(k):
                history += _tokens(crng, vocab, spec.user_len) + _tokens(crng, vocab, spec.user_len)
            user = _tokens(crng, vocab, spec.user_len)
            out.append(BenchRequest(system + history + user, spec.output_len))
    return out


def _multi_tenant(spec: WorkloadSpec, rng: random.Random, vocab: list[int]) -> list[BenchRequest]:
    if spec.num_tenants < 1 or (spec.users_per_tenant or 1) < 1:
        raise ValueError("--num-tenants and --users-per-tenant must be >= 1")
    if spec.system_len + spec.user_len + spec.output_len > spec.max_model_len:
        raise ValueError(f"--system-len + --user-len + --output-len exceed max_model_len="
                         f"{spec.max_model_len}")
    users = spec.users_per_tenant or -(-spec.num_prompts // spec.num_tenants)
    systems = [_tokens(rng, vocab, spec.system_len) for _ in range(spec.num_tenants)]
    out = [BenchRequest(s + _tokens(rng, vocab, spec.user_len), spec.output_len)
           for s in systems for _ in range(users)]
    rng.shuffle(out)
    return out if spec.users_per_tenant else out[:spec.num_prompts]


def load_trace(path: str | Path, tokenizer: Any = None, limit: int | None = None) -> list[BenchRequest]:
    out: list[BenchRequest] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if "prompt_token_ids" in rec:
            ids, text = [int(t) for t in rec["prompt_token_ids"]], None
        elif "prompt" in rec:
            if tokenizer is None:
                raise ValueError(f"{path}:{n}: a text prompt needs a tokenizer")
            text = rec["prompt"]
            ids = list(tokenizer.encode(text))
        else:
            raise ValueError(f"{path}:{n}: each line needs 'prompt' or 'prompt_token_ids'")
        if "max_tokens" not in rec:
            raise ValueError(f"{path}:{n}: each line needs 'max_tokens'")
        at = rec.get("arrival_time")
        out.append(BenchRequest(ids, int(rec["max_tokens"]), None if at is None else float(at), text,
                                n=int(rec.get("n", 1)),
                                output_token_ids=_outputs(rec.get("output_token_ids"), f"{path}:{n}")))
        if limit is not None and len(out) == limit:
            break
    return out


def _outputs(value: Any, where: str) -> list[list[int]] | None:
    """A trace's ``output_token_ids``: one list of ids (n=1) or one per sequence."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, (int, list)) for t in value):
        raise ValueError(f"{where}: 'output_token_ids' must be a list of token ids, or one per "
                         "sequence")
    seqs = value if value and isinstance(value[0], list) else [value]
    return [[int(t) for t in seq] for seq in seqs]


def write_trace(path: str | Path, reqs: list[BenchRequest],
                outputs: list[list[list[int]]] | None = None) -> None:
    """``reqs`` as trace JSONL (``load_trace`` reads it back), with each request's generated
    tokens, one list per sequence, where ``outputs`` gives them."""
    lines = []
    for i, r in enumerate(reqs):
        rec: dict[str, Any] = {"prompt_token_ids": r.prompt_token_ids, "max_tokens": r.max_tokens}
        if r.arrival_time is not None:
            rec["arrival_time"] = r.arrival_time
        if r.n != 1:
            rec["n"] = r.n
        if outputs is not None:
            rec["output_token_ids"] = outputs[i]
        lines.append(json.dumps(rec))
    Path(path).write_text("\n".join(lines) + "\n")


def code_prompts(tokenizer: Any, n: int, prompt_len: int) -> list[list[int]]:
    """``n`` windows of ``prompt_len`` tokens, one from the middle of each held-out file long
    enough (files reused when there are fewer)."""
    from pagedllm.bench.quant_eval import heldout_texts

    out = []
    for text in heldout_texts(limit=200):
        ids = tokenizer.encode(text)
        if len(ids) >= prompt_len:
            mid = (len(ids) - prompt_len) // 2
            out.append(ids[mid: mid + prompt_len])
    if not out:
        raise ValueError(f"no held-out file has --prompt-len {prompt_len} tokens; lower it")
    return [out[i % len(out)] for i in range(n)]


def submissions(engine: Any, reqs: list[BenchRequest], times: list[float] | None = None,
                prefix: str = "w", loras: dict[int, Any] | None = None,
                **params: Any) -> list[Any]:
    """``reqs`` as requests for ``drive``: greedy, ``ignore_eos`` (outputs of exactly
    ``max_tokens``), ``n`` sequences each, ids ``{prefix}{index}``, arriving at ``times`` (default: all at once), a
    request with a ``lora_id`` run by ``loras[lora_id]`` (a ``LoRARequest``); ``params``: more
    ``SamplingParams`` fields."""
    from pagedllm.engine.drive import Submission
    from pagedllm.sampling_params import SamplingParams

    at = times or [0.0] * len(reqs)
    return [Submission(f"{prefix}{i}", partial(
        engine.add_request, prompt={"prompt_token_ids": r.prompt_token_ids},
        params=SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True,
                              n=r.n, **params),
        lora_request=None if r.lora_id is None or loras is None else loras[r.lora_id]), at[i])
        for i, r in enumerate(reqs)]


def arrivals(reqs: list[BenchRequest], rate: float | None, seed: int) -> list[float]:
    """Arrival times (s from the start) of ``reqs``: Poisson at ``rate`` requests/s (inf: all
    at 0), or with ``rate`` None each request's ``arrival_time`` (a trace's), else 0."""
    if rate is None:
        return [r.arrival_time or 0.0 for r in reqs]
    return poisson_arrivals(len(reqs), rate, seed)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of a Poisson process of ``rate`` requests/s; rate=inf -> all at 0."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed + 7919)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def summarize(reqs: list[BenchRequest]) -> dict[str, Any]:
    p = [r.prompt_len for r in reqs]
    o = [r.max_tokens for r in reqs]

    def stats(xs: list[int]) -> dict[str, float]:
        s = sorted(xs)
        return {"mean": sum(s) / len(s), "p50": s[len(s) // 2], "p90": s[min(len(s) - 1, int(0.9 * len(s)))],
                "max": s[-1]} if s else {}

    return {"num_requests": len(reqs), "prompt_tokens": sum(p), "output_tokens": sum(o),
            "prompt_lens": stats(p), "output_lens": stats(o)}


def build_workload(engine_kwargs: dict[str, Any], spec_kwargs: dict[str, Any]) -> tuple[WorkloadSpec, list[BenchRequest], Any]:
    """The workload for the model named in ``engine_kwargs``: its tokenizer's vocabulary, its
    ``max_model_len``. Returns (spec, requests, engine config)."""
    from pagedllm.tokenizer import get_tokenizer

    cfg = engine_config(engine_kwargs)
    tok = get_tokenizer(cfg.tokenizer)
    spec = WorkloadSpec(max_model_len=cfg.scheduler.max_model_len, **spec_kwargs)
    vocab = vocab_ids(tok, min(len(tok), cfg.model.vocab_size))
    return spec, make_workload(spec, vocab, tok), cfg


def engine_config(engine_kwargs: dict[str, Any]) -> Any:
    """The frozen configs of the CLI's engine kwargs."""
    from pagedllm.args import EngineArgs

    return EngineArgs.from_kwargs(engine_kwargs).create_engine_config()
