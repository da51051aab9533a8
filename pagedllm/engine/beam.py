"""Beam search above the engine core (as vLLM v1 does it): the front end runs rounds of ordinary
1-token requests and picks the next beams itself; the core knows nothing of beams.

Scoring convention: a beam's score is the sum of the raw log-probabilities (log-softmax of the
logits, no temperature, no length normalisation) of its generated tokens, which is what HF
``generate(num_beams=W, do_sample=False, length_penalty=0.0)`` ranks by when no EOS is set. Every
beam runs to ``max_tokens`` (EOS is not special). Each round keeps the W best (score + logprob)
continuations over all beams' top-W tokens, ties broken by beam order then token rank.

A round: one ``EngineCoreRequest`` per beam (prompt = the search's prompt + the beam's tokens,
greedy, ``max_tokens=1``, ``logprobs=W``: the top-W suffice, EOS being no different from other
tokens). When all of a round's requests have finished, ``_select`` keeps the W best
continuations and the next round starts. KV is not recomputed: each round's request asks the
core to hold its blocks (``keep_kv_s``) and each next-round request starts on its parent's
(``fork_of``: the prefix shared by reference, the partial last block copied on write,
``pagedllm.sched.holds``), so a round costs one decode per beam, as a step of the old in-core
search did. Once a round is submitted, the holds of the one before (pruned parents included) are
released by an abort of their ids. Round requests are ordinary requests: preempted (recomputed or
swapped) and scheduled like any other; a fork whose hold has expired is simply recomputed.

Everything crosses to the core as messages (``submit``: an ``EngineCoreRequest``; ``release``:
the ids to abort), so the driver can sit in front of a core in another process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pagedllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from pagedllm.sampling_params import SamplingParams

MAX_BEAM_WIDTH = 20  # the most logprobs a request may ask for (``max_logprobs``' default)
KEEP_KV_S = 30.0  # a round's holds outlive any gap to the next round; released sooner anyway

Beam = tuple[list[int], float]  # generated token ids, score


@dataclass
class _Search:
    request_id: str
    prompt: list[int]
    width: int
    max_tokens: int
    arrival: float
    beams: list[Beam] = field(default_factory=lambda: [([], 0.0)])  # best first
    parents: list[str | None] = field(default_factory=lambda: [None])  # held request per beam
    round: int = 0
    pending: dict[str, int] = field(default_factory=dict)  # round request id -> beam index
    scored: dict[int, list[tuple[int, float]]] = field(default_factory=dict)  # beam -> top-W
    held: list[str] = field(default_factory=list)  # finished round requests still held

    @property
    def last_round(self) -> bool:
        return self.round + 1 >= self.max_tokens


class BeamSearchDriver:
    """The front end's beam searches. ``submit`` queues a request in the core (raises
    ValueError, nothing queued, if refused); ``release`` aborts ids there (live requests or
    holds)."""

    def __init__(self, submit: Callable[[EngineCoreRequest], object],
                 release: Callable[[list[str]], object]) -> None:
        self.submit = submit
        self.release = release
        self.searches: dict[str, _Search] = {}
        self._owner: dict[str, _Search] = {}  # live round request id -> its search

    def __len__(self) -> int:
        return len(self.searches)

    def owns(self, request_id: str) -> bool:
        """A live round request (in the core) of one of the searches."""
        return request_id in self._owner

    def add(self, request_id: str, prompt_ids: list[int], width: int, max_tokens: int,
            arrival: float) -> None:
        """Start a search (validated by the engine): its first round is the prompt alone."""
        s = _Search(request_id, list(prompt_ids), width, max_tokens, arrival)
        self._submit_round(s)
        self.searches[request_id] = s

    def abort(self, request_id: str) -> bool:
        """Stop a search: its live round requests and its holds end in the core."""
        s = self.searches.pop(request_id, None)
        if s is None:
            return False
        for rid in s.pending:
            del self._owner[rid]
        self.release([*s.pending, *s.held])
        return True

    def process(self, outputs: list[EngineCoreOutput]) -> list[tuple[str, list[Beam], str]]:
        """Take a step's outputs of round requests (others are ignored); start the next round
        of every search whose round is complete. Returns the searches that ended: (request id,
        sequences best first, finish reason)."""
        done = []
        for out in outputs:
            s = self._owner.get(out.request_id)
            if s is None or (out.finish_reason is None and out.error is None):
                continue
            del self._owner[out.request_id]
            b = s.pending.pop(out.request_id)
            if not out.new_logprobs:  # ended without a token: an error, an abort, a shutdown
                self.abort(s.request_id)
                done.append((s.request_id, s.beams, out.error or out.finish_reason or "error"))
                continue
            s.scored[b] = out.new_logprobs[-1].topk
            if not s.last_round:
                s.held.append(out.request_id)
            if not s.pending:
                self._select(s)
                if s.round >= s.max_tokens:
                    del self.searches[s.request_id]
                    done.append((s.request_id, s.beams, "length"))
                else:
                    released, s.held = s.held, []
                    self._submit_round(s)
                    self.release(released)  # the new round holds what it shares
        return done

    def _submit_round(self, s: _Search) -> None:
        params = SamplingParams(temperature=0.0, logprobs=s.width, max_tokens=1, ignore_eos=True)
        keep = None if s.last_round else KEEP_KV_S
        ids = []
        for b, ((tokens, _), parent) in enumerate(zip(s.beams, s.parents)):
            rid = f"{s.request_id}#r{s.round}b{b}"
            self.submit(EngineCoreRequest(
                request_id=rid, prompt_token_ids=s.prompt + tokens, sampling_params=params,
                arrival_time=s.arrival, keep_kv_s=keep, fork_of=parent))
            ids.append(rid)
            s.pending[rid] = b
            self._owner[rid] = s
        s.parents = list(ids)

    def _select(self, s: _Search) -> None:
        """The W best continuations, in the order the in-core search kept them (bit for bit)."""
        cands = []
        for b, (_, score) in enumerate(s.beams):
            for rank, (tid, lp) in enumerate(s.scored.pop(b)):
                cands.append((-(score + lp), b, rank, tid))
        cands.sort()
        children: dict[int, list[tuple[int, float]]] = {}
        for neg, b, _, tid in cands[:s.width]:
            children.setdefault(b, []).append((tid, -neg))
        new: list[tuple[Beam, str | None]] = []
        for b, ((tokens, _), parent) in enumerate(zip(s.beams, s.parents)):
            kids = children.get(b, [])
            # the first child continued its parent there; the extra ones were forked before it
            for tid, score in [*kids[1:], *kids[:1]]:
                new.append(((tokens + [tid], score), parent))
        new.sort(key=lambda bp: -bp[0][1])
        s.beams = [bp[0] for bp in new]
        s.parents = [bp[1] for bp in new]
        s.round += 1
