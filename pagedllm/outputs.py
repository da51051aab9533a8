"""What callers receive: vLLM-shaped RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedllm.request import PositionLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None

    def add(self, delta: RequestOutput) -> None:
        """Fold the next DELTA output of this request into this one, which then holds everything
        so far, as a CUMULATIVE output would."""
        mine = {c.index: c for c in self.outputs}
        for d in delta.outputs:
            c = mine.get(d.index)
            if c is None:
                lps = None if d.logprobs is None else list(d.logprobs)
                self.outputs.append(replace(d, token_ids=list(d.token_ids), logprobs=lps))
                continue
            c.text += d.text
            c.token_ids.extend(d.token_ids)
            if c.logprobs is not None and d.logprobs is not None:
                c.logprobs.extend(d.logprobs)
            c.cumulative_logprob, c.finish_reason = d.cumulative_logprob, d.finish_reason
            c.stop_reason = d.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.finished, self.metrics = delta.finished, delta.metrics
