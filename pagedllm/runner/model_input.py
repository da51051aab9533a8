"""``ModelInput``: what the executor is told about one step, as plain data (msgspec Structs, no
live ``Request``): it can cross a process boundary.

The engine core builds it from the step's ``SchedulerOutput`` (``ModelInput.build``), with the
step's grammar masks::

    SchedulerOutput (engine side: live Requests)      ModelInput (the message)
    ─────────────────────────────────────────────     ──────────────────────────────────────────
    scheduled[i].request, num_new_tokens,      ──▶    seqs[i]: SeqInput (request id, input token
      block_table, spec_token_ids                        ids, start, block table, proposals,
                                                         sampling params, ...)
    kv (KVUpdate)                              ──▶    kv
    StructuredOutputManager.masks(out)         ──▶    token_masks (rows index ``seqs``)

A row carries only what the runner reads; the long per-request lists travel only for the rows
that read them (the prompt: penalties and prompt logprobs; the output: penalties), and in one
process they are the Request's own lists, not copies. ``encoder()`` / ``decoder()`` are its
msgspec codec; ``TokenMasks`` (computed while the forward runs) is sent as its finished bits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.sched.output import KVUpdate
from pagedllm.structured.masks import TokenMasks

if TYPE_CHECKING:
    from pagedllm.sched.output import SchedulerOutput


class SeqInput(msgspec.Struct, array_like=True, gc=False):
    """One scheduled sequence: ``token_ids`` at positions ``start ..`` (known tokens), then
    ``spec_token_ids`` (proposals to verify: the last k of the step's new positions).
    ``samples``: the chunk reaches the sequence's end, so a token is sampled (one row per
    proposal more when verifying). ``prompt_token_ids`` / ``output_token_ids``: None unless a
    penalty or prompt logprobs read them."""

    request_id: str
    token_ids: list[int]
    start: int
    block_table: list[int]
    spec_token_ids: list[int]
    samples: bool
    params: SamplingParams
    num_prompt_tokens: int
    num_output_tokens: int
    eos_token_ids: tuple[int, ...]
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    lora_request: LoRARequest | None = None
    bad_word_bans: list[int] | None = None  # tokens the sampled one may not be (bad_words)

    @property
    def input_token_ids(self) -> list[int]:
        """The step's tokens of this sequence: known tokens, then proposals."""
        return self.token_ids + self.spec_token_ids if self.spec_token_ids else self.token_ids

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids) + len(self.spec_token_ids)

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens


class ModelInput(msgspec.Struct, kw_only=True):
    """One step for the executor: the KV changes (``kv``, applied first), then the forward of
    ``seqs`` and sampling (``token_masks``: the grammar masks of some sampling rows). No seqs: a
    KV-only step (compaction, shrinking the pool)."""

    seqs: list[SeqInput] = msgspec.field(default_factory=list)
    kv: KVUpdate = msgspec.field(default_factory=KVUpdate)
    token_masks: TokenMasks | None = None

    def lora_rows(self) -> list[tuple[LoRARequest | None, int]] | None:
        """Each row's adapter and new tokens, if any row runs an adapter (every rank maps them)."""
        if all(s.lora_request is None for s in self.seqs):
            return None
        return [(s.lora_request, s.num_new_tokens) for s in self.seqs]

    @classmethod
    def build(cls, out: SchedulerOutput, token_masks: TokenMasks | None = None) -> ModelInput:
        """The message of ``out`` (engine side: reads the scheduled Requests, once per row)."""
        seqs = []
        for s in out.scheduled:  # per row: attributes and lengths, no per-token work
            r = s.request
            p, toks, prompt = r.params, r.token_ids, r.prompt_token_ids
            start = r.num_computed_tokens
            end = start + s.num_new_tokens - len(s.spec_token_ids)
            n, n_prompt = len(toks), len(prompt)
            pen = p.uses_penalties
            seqs.append(SeqInput(
                r.request_id, toks[start:end], start, s.block_table, s.spec_token_ids, end == n,
                p, n_prompt, n - n_prompt, r.eos_token_ids,
                prompt if pen or p.prompt_logprobs is not None else None,
                toks[n_prompt:] if pen else None, r.lora_request,
                r.bad_word_bans() if r.bad_words_token_ids and end == n else None))
        return cls(seqs=seqs, kv=out.kv, token_masks=token_masks)


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, TokenMasks):
        bits = obj.bits()  # waits for the grammar's thread
        return (obj.rows, list(bits.shape), bits.tobytes(), obj.compute_s)
    raise NotImplementedError(f"{type(obj).__name__} is not plain data and cannot be part of a "
                              "ModelInput")


def _dec_hook(typ: type, obj: Any) -> Any:
    if typ is TokenMasks:
        rows, shape, data, compute_s = obj
        bits = np.frombuffer(data, dtype=np.int32).reshape(shape).copy()
        return TokenMasks.ready(rows, bits, compute_s)
    raise NotImplementedError(f"cannot decode {typ.__name__}")


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def decoder() -> msgspec.msgpack.Decoder[ModelInput]:
    return msgspec.msgpack.Decoder(ModelInput, dec_hook=_dec_hook)
