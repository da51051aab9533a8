"""Output processing: sampled tokens become text (incremental detokenization, stop strings),
logprobs with their token texts, and ``RequestOutput``s in the kind each request asked for
(``RequestOutputKind``: cumulative, delta, or final only).

The processor decides nothing for the scheduler: it reports which sequences a stop string ended
(the engine finishes them) and which requests are done (the engine releases them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.request import Logprob, PositionLogprobs, Request, RequestStatus
from pagedllm.runner.model_runner import PromptLogprobsChunk, SampledToken
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.sched import ScheduledRequest
from pagedllm.sched.stats import StepStats
from pagedllm.tokenizer import IncrementalDetokenizer


@dataclass
class _Seq:
    """One child sequence and what of it was already handed out (DELTA)."""

    request: Request
    detok: IncrementalDetokenizer
    sent_tokens: int = 0
    sent_text: int = 0
    done: bool = False
    num_seen: int = 0  # output tokens processed (more than one a step with speculation)

    @property
    def finish_reason(self) -> str | None:
        if self.request.is_finished:
            return self.request.status.value
        return RequestStatus.FINISHED_STOPPED.value if self.detok.stopped_by is not None else None

    def visible_text(self, finished: bool) -> str:
        """The text so far, less what may begin a stop string while the sequence runs."""
        text = self.detok.text
        return text if finished else text[: len(text) - self.detok.holdback()]


@dataclass
class _Group:
    """The user's request: n child sequences sharing one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_Seq]
    arrival_time: float
    kind: RequestOutputKind
    sent_prompt_logprobs: bool = False
    last_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass
class ProcessedStep:
    outputs: list[RequestOutput] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)  # sequences a stop string ended
    finished: list[str] = field(default_factory=list)  # sequences of requests now done


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self._seqs: dict[str, tuple[_Group, _Seq]] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int],
            children: list[Request], arrival: float) -> None:
        params = children[0].params
        seqs = [_Seq(c, IncrementalDetokenizer(
            self.tokenizer, prompt_ids, c.params.stop, c.params.include_stop_str_in_output,
            c.params.skip_special_tokens)) for c in children]
        group = _Group(request_id, prompt, prompt_ids, seqs, arrival, params.output_kind)
        self.groups[request_id] = group
        for s in seqs:
            self._seqs[s.request.request_id] = (group, s)

    def remove(self, request_id: str) -> list[str]:
        """Forget a request; returns its sequences' ids (empty if unknown)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return []
        ids = [s.request.request_id for s in group.seqs]
        for rid in ids:
            self._seqs.pop(rid, None)
        return ids

    def owns(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def group_of(self, seq_id: str) -> str | None:
        """The request a sequence belongs to (None: not a generate request, e.g. a beam)."""
        entry = self._seqs.get(seq_id)
        return None if entry is None else entry[0].request_id

    def seq_ids(self, request_id: str) -> list[str]:
        return [s.request.request_id for s in self.groups[request_id].seqs]

    def finish(self, request_id: str, stats: StepStats) -> RequestOutput | None:
        """The last output of a request the engine ended itself (its sequences are finished in
        the scheduler already; their finish reasons go to ``stats``); the request is forgotten."""
        group = self.groups[request_id]
        stats.finish_reasons += [s.finish_reason or "abort" for s in group.seqs]
        out = self._output(group, time.monotonic(), finished=True)
        self.remove(request_id)
        return out

    def process(self, scheduled: list[ScheduledRequest], sampled: dict[str, SampledToken],
                prompt_lps: dict[str, PromptLogprobsChunk], stats: StepStats,
                accepted: dict[str, list[SampledToken]] | None = None) -> ProcessedStep:
        """Outputs of the step; its request events (tokens, latencies, finishes) go to
        ``stats``. ``accepted``: speculative decoding's accepted proposals, which precede a
        request's ``sampled`` token (as many of them as the scheduler appended)."""
        step = ProcessedStep()
        touched: dict[str, _Group] = {}
        now = time.monotonic()
        for s in scheduled:
            req = s.request
            entry = self._seqs.get(req.request_id)
            if entry is None:
                continue  # not a generate request (e.g. a beam)
            group, seq = entry
            chunk = prompt_lps.get(req.request_id)
            if chunk is not None:
                self._record_prompt_logprobs(req, chunk)
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            touched[group.request_id] = group
            # a token-level stop among accepted proposals ended the request early
            toks = [*accepted.get(req.request_id, ()), tok] if accepted else [tok]
            toks = toks[: req.num_output_tokens - seq.num_seen]
            seq.num_seen += len(toks)
            if req.first_token_time is None:
                req.first_token_time = now
            for j, t in enumerate(toks):
                stats.num_generation_tokens += 1
                if t.logprob is not None:
                    self._record_logprobs(req, t)
                last = j == len(toks) - 1
                stop_token = last and req.stopped_on_token  # not a stop string or a grammar
                if not stop_token or req.params.include_stop_str_in_output:
                    seq.detok.add_tokens([t.token_id])
                if seq.detok.stopped_by is not None and not req.is_finished:
                    req.stop_reason = seq.detok.stopped_by
                    req.drop_last_tokens(len(toks) - 1 - j)  # past the stop string
                    seq.num_seen -= len(toks) - 1 - j
                    step.stopped.append(req.request_id)
                    break
        for group in touched.values():
            finished = group.finished
            _record_events(group, now, finished, stats)
            out = self._output(group, now, finished)
            if out is not None:
                step.outputs.append(out)
            if finished:
                step.finished += self.remove(group.request_id)
        return step

    # -- logprobs -------------------------------------------------------------------------------
    def _record_logprobs(self, req: Request, tok: SampledToken) -> None:
        """A token sampled with its logprob (``tok.logprob`` is not None)."""
        assert tok.logprob is not None
        req.cumulative_logprob += tok.logprob
        if req.logprobs is None:
            return
        pos: PositionLogprobs = {}
        for rank, (tid, lp) in enumerate(tok.topk, start=1):
            pos[tid] = Logprob(lp, rank, self._token_text(tid))
        pos[tok.token_id] = Logprob(tok.logprob, tok.rank, self._token_text(tok.token_id))
        req.logprobs.append(pos)

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _record_prompt_logprobs(self, req: Request, chunk: PromptLogprobsChunk) -> None:
        assert req.prompt_logprobs is not None
        # A recomputation after preemption repeats positions already recorded, in chunks that
        # need not start where the first pass's did: only the positions past them are new.
        skip = len(req.prompt_logprobs) - chunk.start
        if skip < 0:
            return
        for j, (lp, rank) in enumerate(zip(chunk.chosen[skip:], chunk.ranks[skip:]), skip):
            tid = req.prompt_token_ids[chunk.start + j]
            pos: PositionLogprobs = {
                t: Logprob(v, r, self._token_text(t))
                for r, (t, v) in enumerate(chunk.topk[j], start=1)
            }
            pos[tid] = Logprob(lp, rank, self._token_text(tid))
            req.prompt_logprobs.append(pos)

    # -- outputs --------------------------------------------------------------------------------
    def _output(self, group: _Group, now: float, finished: bool) -> RequestOutput | None:
        kind = group.kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outs = self._deltas(group) if kind is RequestOutputKind.DELTA else self._cumulative(group)
        if not outs:
            return None
        first = group.seqs[0].request
        prompt_lps = first.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            prompt_lps, group.sent_prompt_logprobs = (
                None if group.sent_prompt_logprobs else prompt_lps), True
        reqs = [s.request for s in group.seqs]
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_token_time=min((r.first_token_time for r in reqs if r.first_token_time),
                                 default=None),
            finished_time=now if finished else None,
            num_preemptions=sum(r.num_preemptions for r in reqs),
            num_cached_tokens=first.num_cached_tokens or 0,
        )
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, prompt_lps,
                             outs, finished, metrics)

    def _cumulative(self, group: _Group) -> list[CompletionOutput]:
        outs = []
        for i, seq in enumerate(group.seqs):
            req, finish = seq.request, seq.finish_reason
            outs.append(CompletionOutput(
                index=i, text=seq.visible_text(finish is not None),
                token_ids=req.output_token_ids,
                cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
                logprobs=req.logprobs, finish_reason=finish, stop_reason=req.stop_reason,
            ))
        return outs

    def _deltas(self, group: _Group) -> list[CompletionOutput]:
        """What each sequence has new since its last output; a sequence is included when its
        visible text grew or it finished (tokens whose text is held back wait for it)."""
        outs = []
        start = len(group.prompt_token_ids)
        for i, seq in enumerate(group.seqs):
            if seq.done:
                continue
            req, finish = seq.request, seq.finish_reason
            text = seq.visible_text(finish is not None)
            if len(text) == seq.sent_text and finish is None:
                continue
            ids = req.token_ids[start + seq.sent_tokens:]
            lps = req.logprobs[seq.sent_tokens:] if req.logprobs is not None else None
            outs.append(CompletionOutput(
                index=i, text=text[seq.sent_text:], token_ids=ids,
                cumulative_logprob=req.cumulative_logprob if req.params.logprobs is not None else None,
                logprobs=lps, finish_reason=finish, stop_reason=req.stop_reason,
            ))
            seq.sent_text, seq.sent_tokens, seq.done = len(text), seq.sent_tokens + len(ids), finish is not None
        return outs


def _record_events(group: _Group, now: float, finished: bool, stats: StepStats) -> None:
    """A request that produced tokens this step: its first-token or inter-token latency, and
    its end-to-end latency and finish reasons when it is done."""
    if group.last_token_time is None:
        stats.time_to_first_token_s.append(now - group.arrival_time)
        stats.num_prompt_tokens += len(group.prompt_token_ids)
    else:
        stats.inter_token_latency_s.append(now - group.last_token_time)
    group.last_token_time = now
    if finished:
        stats.e2e_latency_s.append(now - group.arrival_time)
        stats.finish_reasons += [s.finish_reason or "abort" for s in group.seqs]
