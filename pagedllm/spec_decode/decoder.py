"""SpecDecoder: the engine's speculative decoding, around its one step.

    step():  propose (here) -> schedule -> execute (verify) -> update (accept, roll back) -> outputs

``propose`` runs before ``schedule``: each decoding request the adaptive rule lets through gets
proposals from the proposer (n-gram lookup, or a draft model: spec_decode/draft.py), returned as
plain data (request id -> token ids) that the engine hands to ``Scheduler.schedule``; the
scheduler gives a request 1 + k query tokens inside the token budget
(spec_decode/schedule.py ``proposals_to_verify``: ``ScheduledRequest.spec_token_ids``), the
runner verifies them (``SeqInput.spec_token_ids``, spec_decode/verify.py), ``Scheduler.update``
appends the accepted ones and rolls the KV back past them (``KVCacheManager.rollback``), and
``record`` counts the step.

Requests that never propose (they run as plain decodes in the same step): requests with one
token left (beam search's rounds: ``max_tokens=1``), requests with presence / frequency / repetition penalties (the penalty of
row j would depend on the proposals before it), requests still under ``min_tokens``, and requests
with bad words (a word's ban at row j depends on the proposals before it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from pagedllm.request import Request
from pagedllm.sched.output import SchedulerOutput
from pagedllm.sched.stats import SpecDecodeCounts
from pagedllm.spec_decode.adaptive import AdaptiveRule
from pagedllm.spec_decode.config import SpeculativeConfig
from pagedllm.spec_decode.ngram import ngram_propose

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig


class Proposer(Protocol):
    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        """Up to ``ks[i]`` tokens to follow each request's ``token_ids`` (possibly none)."""
        ...

    def release(self, request_ids: Iterable[str]) -> None:
        """Forget finished (or preempted) requests, freeing what the proposer holds for them."""
        ...

    def check_integrity(self) -> None:
        """Assert the proposer's own invariants (a draft's KV pool)."""
        ...


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.n_max, self.n_min = config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        return [ngram_propose(r.token_ids, k, self.n_max, self.n_min)
                for r, k in zip(requests, ks)]

    def release(self, request_ids: Iterable[str]) -> None:
        pass

    def check_integrity(self) -> None:
        pass


def can_speculate(req: Request) -> bool:
    """Whether ``req``'s sampling lets its next tokens be verified together (module docstring)."""
    p = req.params
    # a grammar's mask holds for its next token only
    return (not p.uses_penalties and req.num_output_tokens >= p.min_tokens
            and p.structured_outputs is None and not req.bad_words_token_ids)


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.rule = AdaptiveRule(config)
        self.total = SpecDecodeCounts()

    def propose(self, running: Iterable[Request], owns: Callable[[str], bool],
                step: int) -> dict[str, list[int]]:
        """This step's proposals of the running requests that propose: request id -> tokens to
        follow its ``token_ids`` (non-empty; the requests are only read). ``owns``: whether a
        request may speculate (one of the core's requests)."""
        decoding = [r for r in running
                    if r.num_computed_tokens == r.num_tokens - 1 and owns(r.request_id)]
        if not decoding or not self.rule.batch_allows(len(decoding)):
            return {}
        reqs: list[Request] = []
        ks: list[int] = []
        for r in decoding:
            k = min(self.config.num_speculative_tokens, r.max_output_tokens - r.num_output_tokens - 1)
            if k > 0 and can_speculate(r) and self.rule.request_allows(r.request_id, step):
                reqs.append(r)
                ks.append(k)
        if not reqs:
            return {}
        return {r.request_id: p[:k] for r, k, p in zip(reqs, ks, self.proposer.propose(reqs, ks))
                if p}

    def record(self, out: SchedulerOutput, accepted: dict[str, int], step: int) -> SpecDecodeCounts:
        """The step's verifications (``accepted``: proposals kept per verifying request)."""
        counts = SpecDecodeCounts()
        for s in out.scheduled:
            k = len(s.spec_token_ids)
            if not k:
                continue
            a = accepted.get(s.request.request_id, 0)
            counts.num_drafts += 1
            counts.num_draft_tokens += k
            counts.num_accepted_tokens += a
            self.rule.record(s.request.request_id, k, a, step)
        if out.preempted:  # a draft frees their KV; it recomputes when they resume
            self.proposer.release(out.preempted)
        self.total.add(counts)
        return counts

    def release(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        for rid in ids:
            self.rule.forget(rid)
        self.proposer.release(ids)

    def check_integrity(self) -> None:
        self.proposer.check_integrity()


def build_spec_decoder(config: EngineConfig, tokenizer: Any, num_blocks: int) -> SpecDecoder | None:
    """The engine's SpecDecoder for ``config.speculative`` (None: no speculation);
    ``num_blocks``: the target's KV pool, a draft model's default pool size."""
    spec = config.speculative
    if spec is None:
        return None
    if spec.method == "draft_model":
        from pagedllm.spec_decode.draft import build_draft_proposer

        return SpecDecoder(spec, build_draft_proposer(config, tokenizer, num_blocks))
    return SpecDecoder(spec, NgramProposer(spec))
