"""The messages between a front end (the API server, tests) and the engine core: plain data,
msgspec Structs, the same whether the core runs in a thread (``InProcessClient``) or in its own
process over ZMQ (``MPClient``).

::

    front end                                        engine core
    ─────────                                        ───────────
    EngineCoreRequest (token ids, params) ───▶       add_request
    Abort (ids)  ────────────────────────────▶       abort_request
    UtilityCall (name, args) ────────────────▶       a named, read-mostly call (kv_stats, ...)
    Shutdown ────────────────────────────────▶       abort the rest, stop TP workers, exit
                         ◀─── Accepted / Rejected    per EngineCoreRequest
                         ◀─── EngineCoreOutputs      per step: outputs + the step's StepStats
                                                     (+ its KV events, for a router)
                         ◀─── UtilityResult          per UtilityCall
                         ◀─── Ready                  the core process is serving
                         ◀─── CoreDead               the core's last word before it exits

Nothing here holds a live ``Request``, scheduler or KV manager, nor any text: the core sends
token ids and logprobs; the front end detokenizes and finds stop strings. ``SamplingParams`` and
``StepStats`` are plain dataclasses, which msgspec encodes field by field and decodes through
their own constructors (``SamplingParams.__post_init__`` checks them again).
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.kv.events import KVEventBatch
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.stats import StepStats


class EngineCoreRequest(msgspec.Struct, tag=True, kw_only=True):
    """A tokenized request. ``lora_id``: the name of a LoRA adapter the core serves (registered
    by the ``add_lora`` utility call; None: the base model). ``kv_transfer_params`` is reserved
    for prefill->decode transfer; the core refuses a request that sets it.

    Held KV (``pagedllm.sched.holds``; n=1 only): ``keep_kv_s`` keeps the request's KV blocks,
    by reference, that many seconds after it finishes (an ``Abort`` of its id ends the hold
    sooner); ``fork_of`` starts this request on the held blocks of that request, whose computed
    tokens its prompt must extend (the prefix shared, a partial last block copied on write). A
    ``fork_of`` without a hold (expired) is admitted like any request. Beam search's rounds
    (``pagedllm.engine.beam``) are made of such requests."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float  # time.monotonic() of the front end (same host)
    priority: int = 0
    lora_id: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    keep_kv_s: float | None = None
    fork_of: str | None = None


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    """``name``: one of ``core_proc.UTILITIES``; ``args`` plain data."""

    call_id: int
    name: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True):
    pass


class TokenLogprobs(msgspec.Struct, array_like=True):
    """A sampled token's logprob, its rank and the position's top-k (token id, logprob)."""

    logprob: float
    rank: int | None
    topk: list[tuple[int, float]]


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Logprobs of prompt tokens start+1 .. start+len(chosen); a recomputation after
    preemption may send positions again (the front end keeps the first)."""

    start: int
    chosen: list[float]
    ranks: list[int]
    topk: list[list[tuple[int, float]]]


class EngineCoreOutput(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One sequence's step: token ids, no text (the front end detokenizes). ``request_id`` is the
    sequence's id: the request's own for n=1, ``<id>#<i>`` for the i-th of n. ``finish_reason``
    set: the core ended the sequence (``stop_token``: its last token is an eos or stop token id,
    which the text leaves out).
    ``error`` set (with the request's id): the core ended the whole request without a result
    ("failed": a failed step; "shutdown": the core is stopping), ``error_detail`` for the log."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token, if params.logprobs
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    stop_token: bool = False
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    num_preemptions: int = 0
    error: str | None = None
    error_detail: str = ""


class EngineCoreOutputs(msgspec.Struct, tag=True, kw_only=True):
    """A step's outputs and its stats record; ``step`` False for a state change outside a step
    (aborts) whose ``stats`` is a snapshot without request events. The front end adds the
    request events (latencies, finish reasons) to ``stats`` when it turns the outputs into
    ``RequestOutput``s (``engine.output.OutputProcessor``). ``kv_events``: the step's KV cache
    events, for a core asked for them (``core_proc.CoreOptions.kv_events``: a router's)."""

    outputs: list[EngineCoreOutput] = []
    stats: StepStats | None = None
    step: bool = True
    kv_events: list[KVEventBatch] | None = None


class Accepted(msgspec.Struct, tag=True):
    request_id: str


class Rejected(msgspec.Struct, tag=True):
    """``add_request`` refused the request: ``message`` is its ValueError (a 400 for the
    client); ``internal`` an unexpected error (a 500)."""

    request_id: str
    message: str
    internal: bool = False


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error: str | None = None
    error_type: str = ""  # "ValueError" is re-raised as one; anything else as RuntimeError


class Ready(msgspec.Struct, tag=True):
    """The core process built its engine and is serving."""

    pid: int
    num_kv_blocks: int
    stats: StepStats


class CoreDead(msgspec.Struct, tag=True):
    """The core's engine loop failed for good (e.g. a lost tensor-parallel rank)."""

    reason: str


ToCore = EngineCoreRequest | Abort | UtilityCall | Shutdown
FromCore = EngineCoreOutputs | Accepted | Rejected | UtilityResult | Ready | CoreDead


def _enc_hook(obj: Any) -> Any:
    raise NotImplementedError(f"{type(obj).__name__} cannot cross to or from the engine core")


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def to_core_decoder() -> msgspec.msgpack.Decoder[ToCore]:
    return msgspec.msgpack.Decoder(ToCore)  # type: ignore[arg-type]


def from_core_decoder() -> msgspec.msgpack.Decoder[FromCore]:
    return msgspec.msgpack.Decoder(FromCore)  # type: ignore[arg-type]
