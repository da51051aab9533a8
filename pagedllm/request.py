"""One object per request (STYLE 1): token ids and computed count are stored, the rest derived."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pagedllm.lora.request import LoRARequest, lora_extra_keys
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # failed inside a step (vLLM's name); the server answers 500

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # read several times per request and step: a set, built once


_FINISHED = frozenset({RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR})


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


# Per position: token id -> Logprob (the chosen token plus the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass(eq=False)
class Request:
    """A single sequence being generated: the engine core's state of it (what the scheduler, the
    KV manager and the runner need). Its text, detokenizer, stop-string state and logprobs are
    the front end's (``engine.output.SeqOutput``).

    ``token_ids`` = prompt + generated tokens. ``num_computed_tokens`` counts the tokens whose
    K/V are in the cache; the scheduler moves it toward ``num_tokens`` (prefill chunks and decode
    steps are the same arithmetic). On preemption by recompute it drops back to 0.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 2048
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = 0  # FCFS tie-break, assigned by the scheduler
    fork_seq: int = 0  # orders requests forked on a hold, which keep its arrival_seq
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    token_ids: list[int] = field(init=False)
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at first admission
    # held KV (``pagedllm.sched.holds``): keep this request's blocks for that many seconds after
    # it finishes; start on the held blocks of request ``fork_of``
    keep_kv_s: float | None = None
    fork_of: str | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)
    # token sequences it may never generate (``SamplingParams.bad_words``, tokenized at admission)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def prefix_keys(self) -> tuple | None:
        """The extra key of this request's prefix-cache blocks (its adapter's id)."""
        return lora_extra_keys(self.lora_request)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def max_output_tokens(self) -> int:
        """Tokens this request may still generate in total (max_tokens, capped by max_model_len)."""
        room = self.max_model_len - self.num_prompt_tokens
        mt = self.params.max_tokens
        return room if mt is None else min(mt, room)

    @property
    def sort_key(self) -> tuple[int, int, int]:
        """Lower = more urgent: priority first, then arrival (FCFS)."""
        return (self.priority, self.arrival_seq, self.fork_seq)

    @property
    def stopped_on_token(self) -> bool:
        """Finished by an eos or stop token (left out of the text), rather than by a stop
        string or a complete grammar."""
        if self.status != RequestStatus.FINISHED_STOPPED or not self.num_output_tokens:
            return False
        last, p = self.token_ids[-1], self.params
        return (not p.ignore_eos and last in self.eos_token_ids) or last in p.stop_token_ids

    def bad_word_bans(self) -> list[int]:
        """The tokens the next one may not be: the last token of each bad word whose other
        tokens the output ends with (vLLM's rule: only generated tokens count)."""
        bans = []
        n_out = self.num_output_tokens
        for word in self.bad_words_token_ids:
            k = len(word) - 1
            if k == 0 or (k <= n_out and tuple(self.token_ids[-k:]) == word[:-1]):
                bans.append(word[-1])
        return bans

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self) -> RequestStatus | None:
        """Token-level stop conditions after a new token was appended (stop strings are checked
        by the detokenizer, which sees text)."""
        last = self.token_ids[-1]
        n_out = self.num_output_tokens
        p = self.params
        if n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in p.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if n_out >= self.max_output_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None
