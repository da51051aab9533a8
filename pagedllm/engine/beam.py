"""Beam search as a kind of engine request: its beams run in ``LLMEngine.step()`` beside every
other request and share their common prefix's KV blocks by fork.

Scoring convention: a beam's score is the sum of the raw log-probabilities (log-softmax of the
logits, no temperature, no length normalisation) of its generated tokens, which is what HF
``generate(num_beams=W, do_sample=False, length_penalty=0.0)`` ranks by when no EOS is set. Every
beam runs to ``max_tokens`` (EOS is not special). Each step keeps the W best (score + logprob)
continuations over all beams' top-W tokens, ties broken by beam order then token rank.

How a step treats a beam (a greedy sequence with ``logprobs=W``): ``take`` keeps its top-W
candidates instead of appending the sampled token, so the beam parks (nothing left to compute)
until every beam of its search has been scored; then ``select`` appends each beam's chosen token,
forks a parent that has several surviving children (``Scheduler.fork_request``: shared blocks,
the partial last block copied on write) and finishes parents that have none. A beam preempted
meanwhile recomputes and is scored again; beams are never swapped (``Request.swappable``): one
swapped out after scoring would come back with nothing to compute, never scored again, and a
swap-in needs the whole block table back unshared (the host tier keeps no sharing), while a
recomputed beam finds its siblings' blocks in the prefix cache. Forked beams keep their search's
place in line (``Scheduler.fork_request``), so requests that arrive later cannot starve them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from pagedllm.engine.messages import BeamSequence
from pagedllm.request import Request, RequestStatus
from pagedllm.runner.model_runner import SampledToken
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched import Scheduler, SchedulerOutput

MAX_BEAM_WIDTH = 20  # the sampler's largest logprobs


@dataclass
class _Search:
    request_id: str
    prompt: list[int]
    width: int
    max_tokens: int
    max_model_len: int
    arrival: float
    beams: list[tuple[Request, float]] = field(default_factory=list)
    scored: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # beam -> top-W
    ids: Iterator[int] = field(default_factory=itertools.count)

    def new_beam(self, token_ids: list[int]) -> Request:
        params = SamplingParams(temperature=0.0, logprobs=self.width, max_tokens=None,
                                ignore_eos=True)
        req = Request(f"{self.request_id}#beam{next(self.ids)}", self.prompt, params,
                      max_model_len=self.max_model_len, arrival_time=self.arrival)
        req.token_ids = list(token_ids)
        req.swappable = False
        return req


class BeamSearch:
    """The engine's beam searches; the scheduler holds their beams like any sequence, and
    ``finish`` (the core's one way to end a sequence) ends them."""

    def __init__(self, scheduler: Scheduler, finish: Callable[[str, RequestStatus], object],
                 max_model_len: int) -> None:
        self.scheduler = scheduler
        self.finish = finish
        self.max_model_len = max_model_len
        self.searches: dict[str, _Search] = {}
        self._owner: dict[str, _Search] = {}  # beam id -> its search

    def __len__(self) -> int:
        return len(self.searches)

    def owns(self, seq_id: str) -> bool:
        return seq_id in self._owner

    def add(self, request_id: str, prompt_ids: list[int], width: int, max_tokens: int,
            arrival: float) -> None:
        """Start a search (validated by the engine); its first beam is the prompt."""
        s = _Search(request_id, list(prompt_ids), width, max_tokens, self.max_model_len, arrival)
        first = s.new_beam(s.prompt)
        self.scheduler.add_request(first)
        s.beams.append((first, 0.0))
        self.searches[request_id] = s
        self._owner[first.request_id] = s

    def abort(self, request_id: str) -> list[str]:
        """Stop a search; returns the ids of its live beams (empty if unknown)."""
        s = self.searches.pop(request_id, None)
        if s is None:
            return []
        ids = [r.request_id for r, _ in s.beams]
        for rid in ids:
            self.finish(rid, RequestStatus.FINISHED_ABORTED)
            self._owner.pop(rid, None)
        return ids

    def take(self, out: SchedulerOutput, sampled: dict[str, SampledToken]) -> dict[str, int]:
        """The token to append for every sequence of the step but the beams, whose candidates
        are kept for ``select`` instead."""
        if not self._owner:
            return {rid: t.token_id for rid, t in sampled.items()}
        for rid in out.preempted:
            s = self._owner.get(rid)
            if s is not None:
                s.scored.pop(rid, None)
        tokens: dict[str, int] = {}
        for rid, t in sampled.items():
            s = self._owner.get(rid)
            if s is None:
                tokens[rid] = t.token_id
            else:
                s.scored[rid] = t.topk
        return tokens

    def select(self) -> list[tuple[str, list[BeamSequence]]]:
        """Advance every search whose beams are all scored. Returns the searches that finished,
        each with its sequences best first."""
        outputs = []
        for s in list(self.searches.values()):
            if len(s.scored) == len(s.beams):
                self._select(s)
                if s.request_id not in self.searches:
                    outputs.append((s.request_id, [BeamSequence(r.output_token_ids, score)
                                                   for r, score in s.beams]))
        return outputs

    def _select(self, s: _Search) -> None:
        cands = []
        for b, (req, score) in enumerate(s.beams):
            for rank, (tid, lp) in enumerate(s.scored.pop(req.request_id)):
                cands.append((-(score + lp), b, rank, tid))
        cands.sort()
        children: dict[int, list[tuple[int, float]]] = {}
        for neg, b, _, tid in cands[:s.width]:
            children.setdefault(b, []).append((tid, -neg))
        new: list[tuple[Request, float]] = []
        for b, (req, _) in enumerate(s.beams):
            kids = children.get(b)
            if not kids:
                continue
            for tid, score in kids[1:]:  # extra children fork the parent's blocks
                child = s.new_beam(req.token_ids + [tid])
                self.scheduler.fork_request(req, child)
                self._owner[child.request_id] = s
                new.append((child, score))
            req.append_token(kids[0][0])
            new.append((req, kids[0][1]))
        ended = [r.request_id for b, (r, _) in enumerate(s.beams) if b not in children]
        for rid in ended:  # parents without surviving children
            self.finish(rid, RequestStatus.FINISHED_ABORTED)
            self._owner.pop(rid, None)
        new.sort(key=lambda rs: -rs[1])
        s.beams = new
        if new[0][0].num_output_tokens >= s.max_tokens:
            del self.searches[s.request_id]
            for req, _ in new:  # keep the Request objects (for token ids); release their blocks
                self.finish(req.request_id, RequestStatus.FINISHED_LENGTH)
                self._owner.pop(req.request_id, None)
