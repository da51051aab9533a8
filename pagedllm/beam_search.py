"""Beam search on the paged engine: beams share their common prefix's KV blocks by fork.

Scoring convention: a beam's score is the sum of the raw log-probabilities (log-softmax of the
logits, no temperature, no length normalisation) of its generated tokens, which is what HF
``generate(num_beams=W, do_sample=False, length_penalty=0.0)`` ranks by when no EOS is set. Every
beam runs to ``max_tokens`` (EOS is not special). Each step keeps the W best (score + logprob)
continuations over all beams' top-W tokens, ties broken by beam order then token rank.

How it drives the engine: each beam is a greedy request with ``logprobs=W``. After a beam's
forward the driver does *not* append the sampled token, so the beam parks (nothing left to
compute) until every beam of its prompt has been scored; then the driver appends each beam's
chosen token, forks a parent that has several surviving children (``Scheduler.fork_request``:
shared blocks, the partial last block copied on write) and finishes parents that have none. A beam
preempted meanwhile simply recomputes and is scored again.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.request import Request, RequestStatus
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine import LLMEngine


@dataclass
class BeamSequence:
    token_ids: list[int]  # generated tokens only
    cumulative_logprob: float
    text: str = ""


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]  # best first, beam_width of them


@dataclass
class _Group:
    prompt: list[int]
    beams: list[tuple[Request, float]] = field(default_factory=list)
    done: list[tuple[Request, float]] | None = None


def beam_search(engine: LLMEngine, prompts: list[list[int]], beam_width: int,
                max_tokens: int) -> list[BeamSearchOutput]:
    if beam_width < 1 or beam_width > 20:
        raise ValueError(f"beam_width={beam_width} must be in [1, 20]")
    if max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens} must be >= 1")
    if engine.has_unfinished_requests():
        raise RuntimeError("beam_search needs an idle engine; finish or abort other requests")
    sched, runner = engine.scheduler, engine.runner
    params = SamplingParams(temperature=0.0, logprobs=beam_width, max_tokens=None,
                            ignore_eos=True)
    ids = (f"beam-{i}" for i in itertools.count())
    max_len = engine.config.scheduler.max_model_len
    groups: list[_Group] = []
    for p in prompts:
        if len(p) + max_tokens > max_len:
            raise ValueError(f"a prompt of {len(p)} tokens + max_tokens={max_tokens} exceeds "
                             f"max_model_len={max_len}")
        sched.check_fits(len(p))
    owner: dict[str, _Group] = {}
    try:
        for p in prompts:
            g = _Group(list(p))
            req = Request(next(ids), list(p), params, max_model_len=max_len)
            sched.add_request(req)
            g.beams.append((req, 0.0))
            owner[req.request_id] = g
            groups.append(g)
        pending: dict[str, list[tuple[int, float]]] = {}
        while any(g.done is None for g in groups):
            out = sched.schedule()
            result = runner.execute(out)
            sched.update(out, {})  # beams park: tokens are appended after selection
            for rid in out.preempted:
                pending.pop(rid, None)
            for rid, tok in result.sampled.items():
                pending[rid] = tok.topk
            for g in groups:
                if g.done is None and all(r.request_id in pending for r, _ in g.beams):
                    _select(g, pending, sched, ids, owner, beam_width, max_tokens)
    finally:
        for rid in list(owner):
            sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    tokenizer = engine.tokenizer
    return [BeamSearchOutput(g.prompt, [
        BeamSequence(r.output_token_ids, s, str(tokenizer.decode(r.output_token_ids)))
        for r, s in g.done or []
    ]) for g in groups]


def _select(g: _Group, pending: dict[str, list[tuple[int, float]]], sched, ids, owner,  # type: ignore[no-untyped-def]
            width: int, max_tokens: int) -> None:
    cands = []
    for b, (req, score) in enumerate(g.beams):
        for rank, (tid, lp) in enumerate(pending.pop(req.request_id)):
            cands.append((-(score + lp), b, rank, tid))
    cands.sort()
    children: dict[int, list[tuple[int, float]]] = {}
    for neg, b, _, tid in cands[:width]:
        children.setdefault(b, []).append((tid, -neg))
    new: list[tuple[Request, float]] = []
    for b, (req, _) in enumerate(g.beams):
        kids = children.get(b)
        if not kids:
            continue
        for tid, score in kids[1:]:  # extra children fork the parent's blocks
            child = Request(next(ids), req.prompt_token_ids, req.params,
                            max_model_len=req.max_model_len)
            child.token_ids = req.token_ids + [tid]
            sched.fork_request(req, child)
            owner[child.request_id] = g
            new.append((child, score))
        req.append_token(kids[0][0])
        new.append((req, kids[0][1]))
    for req, _ in g.beams:  # parents without surviving children
        if req.request_id not in children_ids(new):
            sched.finish_request(req.request_id, RequestStatus.FINISHED_ABORTED)
            owner.pop(req.request_id, None)
    new.sort(key=lambda rs: -rs[1])
    g.beams = new
    if new[0][0].num_output_tokens >= max_tokens:
        g.done = new
        for req, _ in new:  # keep the Request objects (for token ids); release their blocks
            sched.finish_request(req.request_id, RequestStatus.FINISHED_LENGTH)
            owner.pop(req.request_id, None)


def children_ids(beams: list[tuple[Request, float]]) -> set[str]:
    return {r.request_id for r, _ in beams}
