"""The front end's output processing: the core's token ids become text (incremental
detokenization, stop strings), logprobs get their token texts, and ``RequestOutput``s are built in
the kind each request asked for (``RequestOutputKind``: cumulative, delta, or final only).

Runs where the front end runs: in ``LLMEngine`` (``LLM``, tests) and in the API server's process
(``EngineClient``), never in the engine core. A stop string ends a sequence here: the processor
finishes it and returns its id in ``ProcessedOutputs.aborts``, which the caller sends to the core
as an ``Abort`` (the core may meanwhile have stepped it again; those tokens are dropped).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from pagedllm.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    PromptLogprobs,
    TokenLogprobs,
)
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.request import Logprob, PositionLogprobs
from pagedllm.sampling_params import RequestOutputKind, SamplingParams
from pagedllm.sched.stats import StepStats
from pagedllm.tokenizer import IncrementalDetokenizer


def sequence_ids(request_id: str, n: int) -> list[str]:
    """The ids of a request's sequences in the core: its own for n=1, ``<id>#<i>`` for n > 1
    (``InputProcessor.fan_out`` names them so)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


@dataclass(eq=False)
class SeqOutput:
    """The front end's state of one sequence: its tokens, text, logprobs, finish and what of it
    was already handed out (DELTA). The core's state of it is a ``Request``."""

    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    sent_tokens: int = 0
    sent_text: int = 0
    done: bool = False

    def visible_text(self) -> str:
        """The text so far, less what may begin a stop string while the sequence runs."""
        text = self.detok.text
        return text if self.finish_reason is not None else text[: len(text) - self.detok.holdback()]


@dataclass(eq=False)
class _Group:
    """The user's request: n sequences sharing one prompt (or a beam search: ``beam``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[SeqOutput]
    arrival_time: float
    kind: RequestOutputKind
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    sent_prompt_logprobs: bool = False
    last_token_time: float | None = None
    beam: bool = False
    lora_name: str | None = None  # the LoRA adapter it runs (its metrics' label)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)


@dataclass
class ProcessedOutputs:
    outputs: list[RequestOutput] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)  # sequences a stop string ended: tell the core


class OutputProcessor:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.groups: dict[str, _Group] = {}
        self._seqs: dict[str, tuple[_Group, SeqOutput]] = {}

    def __len__(self) -> int:
        return len(self.groups)

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int],
            params: SamplingParams, arrival: float, lora_name: str | None = None) -> None:
        seqs = [SeqOutput(i, params, IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.stop, params.include_stop_str_in_output,
            params.skip_special_tokens), logprobs=[] if params.logprobs is not None else None)
            for i in range(params.n)]
        group = _Group(request_id, prompt, prompt_ids, seqs, arrival, params.output_kind,
                       prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
                       lora_name=lora_name)
        self.groups[request_id] = group
        for sid, s in zip(sequence_ids(request_id, params.n), seqs):
            self._seqs[sid] = (group, s)

    def add_beam_search(self, request_id: str, prompt_ids: list[int], arrival: float) -> None:
        """A beam search: one output when it finishes (its sequences come whole)."""
        self.groups[request_id] = _Group(request_id, None, prompt_ids, [], arrival,
                                         RequestOutputKind.FINAL_ONLY, beam=True)

    def remove(self, request_id: str) -> bool:
        """Forget a request (False if unknown)."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return False
        if not group.beam:
            for sid in sequence_ids(request_id, len(group.seqs)):
                self._seqs.pop(sid, None)
        return True

    def owns(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def group_of(self, seq_id: str) -> str | None:
        """The request a sequence belongs to (None: not a generate request, e.g. a beam)."""
        entry = self._seqs.get(seq_id)
        return None if entry is None else entry[0].request_id

    def process(self, core: EngineCoreOutputs) -> ProcessedOutputs:
        """The ``RequestOutput``s of a step's core outputs; the request events (tokens,
        latencies, finishes) are added to ``core.stats``. Outputs of sequences this processor
        does not know or already finished (aborted, stopped here) are dropped."""
        done = ProcessedOutputs()
        stats = core.stats if core.stats is not None else StepStats()
        touched: dict[str, _Group] = {}
        produced: set[str] = set()  # requests with new tokens (an error may end one without)
        now = time.monotonic()
        for out in core.outputs:
            entry = self._seqs.get(out.request_id)
            if entry is None or entry[1].finish_reason is not None:
                continue
            group, seq = entry
            if out.prompt_logprobs is not None and group.prompt_logprobs is not None:
                self._record_prompt_logprobs(group, out.prompt_logprobs)
            if out.new_token_ids or out.finish_reason is not None:
                touched[group.request_id] = group
                if out.new_token_ids:
                    produced.add(group.request_id)
                if self._add_tokens(seq, out, stats, now):
                    done.aborts.append(out.request_id)
                if group.lora_name is not None:  # per adapter, for its metrics
                    tokens = stats.lora_generation_tokens
                    tokens[group.lora_name] = tokens.get(group.lora_name, 0) + len(out.new_token_ids)
        for group in touched.values():
            finished = group.finished
            _record_events(group, now, group.request_id in produced, finished, stats)
            ro = self._output(group, now, finished)
            if ro is not None:
                done.outputs.append(ro)
            if finished:
                self.remove(group.request_id)
        return done

    def _add_tokens(self, seq: SeqOutput, out: EngineCoreOutput, stats: StepStats,
                    now: float) -> bool:
        """Append a step's tokens; True if a stop string ended the sequence (the tokens past it
        are dropped)."""
        seq.num_cached_tokens, seq.num_preemptions = out.num_cached_tokens, out.num_preemptions
        if seq.first_token_time is None and out.new_token_ids:
            seq.first_token_time = now
        toks, lps = out.new_token_ids, out.new_logprobs
        stopped = False
        for j, t in enumerate(toks):
            stats.num_generation_tokens += 1
            seq.token_ids.append(t)
            if lps is not None:
                self._record_logprobs(seq, t, lps[j])
            stop_token = out.stop_token and j == len(toks) - 1  # eos/stop id: not in the text
            if not stop_token or seq.params.include_stop_str_in_output:
                seq.detok.add_tokens([t])
            if seq.detok.stopped_by is not None and out.finish_reason is None:
                seq.finish_reason, seq.stop_reason = "stop", seq.detok.stopped_by
                stopped = True
                break
        if out.finish_reason is not None:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return stopped

    # -- logprobs -------------------------------------------------------------------------------
    def _record_logprobs(self, seq: SeqOutput, token_id: int, lp: TokenLogprobs) -> None:
        seq.cumulative_logprob += lp.logprob
        if seq.logprobs is None:
            return
        pos: PositionLogprobs = {}
        for rank, (tid, v) in enumerate(lp.topk, start=1):
            pos[tid] = Logprob(v, rank, self._token_text(tid))
        pos[token_id] = Logprob(lp.logprob, lp.rank, self._token_text(token_id))
        seq.logprobs.append(pos)

    def _token_text(self, token_id: int) -> str:
        return str(self.tokenizer.decode([token_id]))

    def _record_prompt_logprobs(self, group: _Group, chunk: PromptLogprobs) -> None:
        recorded = group.prompt_logprobs
        assert recorded is not None
        # A recomputation after preemption repeats positions already recorded, in chunks that
        # need not start where the first pass's did: only the positions past them are new.
        skip = len(recorded) - chunk.start
        if skip < 0:
            return
        for j, (lp, rank) in enumerate(zip(chunk.chosen[skip:], chunk.ranks[skip:]), skip):
            tid = group.prompt_token_ids[chunk.start + j]
            pos: PositionLogprobs = {
                t: Logprob(v, r, self._token_text(t))
                for r, (t, v) in enumerate(chunk.topk[j], start=1)
            }
            pos[tid] = Logprob(lp, rank, self._token_text(tid))
            recorded.append(pos)

    # -- outputs --------------------------------------------------------------------------------
    def _output(self, group: _Group, now: float, finished: bool) -> RequestOutput | None:
        kind = group.kind
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        outs = self._deltas(group) if kind is RequestOutputKind.DELTA else self._cumulative(group)
        if not outs:
            return None
        prompt_lps = group.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            prompt_lps, group.sent_prompt_logprobs = (
                None if group.sent_prompt_logprobs else prompt_lps), True
        seqs = group.seqs
        metrics = RequestMetrics(
            arrival_time=group.arrival_time,
            first_token_time=min((s.first_token_time for s in seqs if s.first_token_time),
                                 default=None),
            finished_time=now if finished else None,
            num_preemptions=sum(s.num_preemptions for s in seqs),
            num_cached_tokens=seqs[0].num_cached_tokens,
        )
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, prompt_lps,
                             outs, finished, metrics)

    def _cumulative(self, group: _Group) -> list[CompletionOutput]:
        return [CompletionOutput(
            index=seq.index, text=seq.visible_text(), token_ids=list(seq.token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
            logprobs=seq.logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
        ) for seq in group.seqs]

    def _deltas(self, group: _Group) -> list[CompletionOutput]:
        """What each sequence has new since its last output; a sequence is included when its
        visible text grew or it finished (tokens whose text is held back wait for it)."""
        outs = []
        for seq in group.seqs:
            if seq.done:
                continue
            finish = seq.finish_reason
            text = seq.visible_text()
            if len(text) == seq.sent_text and finish is None:
                continue
            ids = seq.token_ids[seq.sent_tokens:]
            lps = seq.logprobs[seq.sent_tokens:] if seq.logprobs is not None else None
            outs.append(CompletionOutput(
                index=seq.index, text=text[seq.sent_text:], token_ids=ids,
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                logprobs=lps, finish_reason=finish, stop_reason=seq.stop_reason,
            ))
            seq.sent_text, seq.sent_tokens, seq.done = len(text), seq.sent_tokens + len(ids), finish is not None
        return outs

    def finish_beam_search(self, request_id: str, beams: list[tuple[list[int], float]],
                           finish_reason: str) -> RequestOutput | None:
        """A beam search's one output: its sequences (token ids, score), best first, detokenized;
        None if the search is unknown (aborted)."""
        group = self.groups.get(request_id)
        if group is None or not group.beam:
            return None
        self.remove(request_id)
        outs = [CompletionOutput(i, str(self.tokenizer.decode(ids)), ids, score, None,
                                 finish_reason) for i, (ids, score) in enumerate(beams)]
        return RequestOutput(group.request_id, None, group.prompt_token_ids, None, outs, True,
                             RequestMetrics(arrival_time=group.arrival_time))


def _record_events(group: _Group, now: float, produced: bool, finished: bool,
                   stats: StepStats) -> None:
    """A request that produced tokens this step (``produced``) or ended: its first-token or
    inter-token latency, and its end-to-end latency and finish reasons when it is done."""
    name = group.lora_name
    if produced:
        if group.last_token_time is None:
            stats.time_to_first_token_s.append(now - group.arrival_time)
            stats.num_prompt_tokens += len(group.prompt_token_ids)
            if name is not None:
                stats.lora_ttft_s.append((name, now - group.arrival_time))
        else:
            stats.inter_token_latency_s.append(now - group.last_token_time)
            if name is not None:
                stats.lora_itl_s.append((name, now - group.last_token_time))
        group.last_token_time = now
    if finished:
        stats.e2e_latency_s.append(now - group.arrival_time)
        if name is not None:
            stats.lora_e2e_latency_s.append((name, now - group.arrival_time))
        stats.finish_reasons += [s.finish_reason or "abort" for s in group.seqs]
