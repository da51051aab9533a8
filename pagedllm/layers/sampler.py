"""Batched sampling: every per-request parameter lives in a tensor row.

Pipeline over logits [B, V] (fp32):
  raw log-softmax (for logprobs) -> penalties -> logit_bias -> bans (min_tokens, bad words)
  -> token masks (grammars, allowed_token_ids; only the rows that have one) -> greedy argmax
  -> temperature -> top-k / top-p / min-p -> exponential-race sampling.

Sampling uses the "exponential race" (argmax of p / E with E ~ Exp(1)), which is equivalent to
drawing from p. Rows of requests with a ``seed`` draw E from their own torch.Generator, so a
seeded request gives the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm import kernels

Softmax = Callable[[torch.Tensor, bool], torch.Tensor]


def torch_softmax(logits: torch.Tensor, log: bool = False) -> torch.Tensor:
    """softmax (``log``: log-softmax) over the last dim, torch's."""
    return logits.log_softmax(-1) if log else logits.softmax(-1)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [B] fp32, 0 = greedy
    all_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int64, 0 = off
    top_p: torch.Tensor | None = None  # [B] fp32
    min_p: torch.Tensor | None = None  # [B] fp32
    generators: dict[int, torch.Generator] = field(default_factory=dict)  # row -> generator
    # Penalties (None when no request in the batch uses them).
    presence_penalty: torch.Tensor | None = None  # [B]
    frequency_penalty: torch.Tensor | None = None  # [B]
    repetition_penalty: torch.Tensor | None = None  # [B]
    output_counts: torch.Tensor | None = None  # [B, V] counts of generated tokens
    prompt_mask: torch.Tensor | None = None  # [B, V] bool: token occurs in the prompt
    # bans (min_tokens, bad words): (rows, token ids), two equal-length int64 tensors;
    # logits[rows, ids] = -inf
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # logit_bias: (rows, token ids, values), three equal-length tensors; added to the logits
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # token masks: (rows [R] int64, bits [R, ceil(V/32)] int32 or int64 words: bit t % 32 of
    # word t // 32 set = token t allowed); the other rows are not masked
    token_mask: tuple[torch.Tensor, torch.Tensor] | None = None
    max_num_logprobs: int | None = None
    # the row softmax, (logits, log) -> fp32 probs or logprobs: torch's, or in batch-invariant
    # mode on the Triton family its kernel (layers/triton_invariant.py)
    softmax: Softmax = torch_softmax


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] raw logprob of the chosen token
    ranks: torch.Tensor | None = None  # [B] rank of the chosen token (1 = best)
    topk_ids: torch.Tensor | None = None  # [B, k]
    topk_logprobs: torch.Tensor | None = None  # [B, k]


def apply_penalties(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.output_counts is None:
        return logits
    counts = md.output_counts
    if md.repetition_penalty is not None:
        # HF / vLLM convention: seen tokens' positive logits divided, negative multiplied.
        seen = (counts > 0) | (md.prompt_mask if md.prompt_mask is not None else False)
        rp = md.repetition_penalty.unsqueeze(1).expand_as(logits)
        penalized = torch.where(logits > 0, logits / rp, logits * rp)
        logits = torch.where(seen, penalized, logits)
    if md.frequency_penalty is not None:
        logits = logits - md.frequency_penalty.unsqueeze(1) * counts
    if md.presence_penalty is not None:
        logits = logits - md.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits


def unpack_token_mask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Bitmask words [R, W] -> bool [R, vocab] (True = allowed)."""
    shifts = torch.arange(32, device=bits.device, dtype=bits.dtype)
    return ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]


def apply_token_mask(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """-inf where ``rows``' masks forbid a token; the other rows are untouched."""
    allowed = unpack_token_mask(bits, logits.shape[-1])
    return logits.index_put((rows,), logits[rows].masked_fill(~allowed, float("-inf")))


def apply_top_k_top_p_min_p(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    if md.min_p is not None:
        probs = md.softmax(logits, False)
        thresh = probs.amax(-1, keepdim=True) * md.min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < thresh, float("-inf"))
    if md.top_k is None and md.top_p is None:
        return logits
    sorted_logits, idx = logits.sort(-1, descending=True)
    vocab = logits.shape[-1]
    if md.top_k is not None:
        k = torch.where(md.top_k > 0, md.top_k, torch.full_like(md.top_k, vocab)).clamp(max=vocab)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= k.unsqueeze(1), float("-inf"))
    if md.top_p is not None:
        probs = md.softmax(sorted_logits, False)
        cum_before = probs.cumsum(-1) - probs  # mass strictly before each token
        drop = cum_before >= md.top_p.unsqueeze(1)
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of [B, V] logits in any float dtype, int64 [B]: the first index of
    each row's maximum (the first NaN where a row holds one). On CPU with the kernels built, one
    C++ op (kernels/csrc/argmax.cpp): vectorised, rows over threads, reading bf16 / fp16 logits
    as they are (torch's argmax runs one thread, and on bf16 ~6x slower than on fp32)."""
    if (logits.device.type == "cpu" and logits.dim() == 2 and logits.shape[1] > 0
            and logits.stride(-1) == 1 and kernels.available()):
        return torch.ops.pagedllm.argmax_rows(logits)
    return logits.argmax(-1)


def plain_greedy(md: SamplingMetadata) -> bool:
    """Every row greedy, no logprobs, nothing that edits logits (penalties, logit_bias,
    min_tokens bans, token masks): the sampled tokens are the argmax of the raw logits, in
    whatever dtype the LM head produced them (widening to fp32 is exact and keeps the order)."""
    return (md.all_greedy and md.max_num_logprobs is None and md.output_counts is None
            and md.bias is None and md.banned is None and md.token_mask is None)


def sample(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """logits [B, V] -> SamplerOutput. Does not modify ``logits``. Logits may come in the model's
    dtype where ``plain_greedy(md)``; otherwise they are fp32 (or converted here)."""
    if plain_greedy(md):
        return SamplerOutput(token_ids=argmax(logits))
    logits = logits.float()
    raw_logprobs = md.softmax(logits, True) if md.max_num_logprobs is not None else None
    logits = apply_penalties(logits, md)
    if md.bias is not None:
        logits = logits.index_put(md.bias[:2], md.bias[2], accumulate=True)
    if md.banned is not None:
        logits = logits.index_put(md.banned, torch.full((), float("-inf"), device=logits.device))
    if md.token_mask is not None:
        logits = apply_token_mask(logits, *md.token_mask)
    greedy_ids = argmax(logits)
    if md.all_greedy:
        ids = greedy_ids
    else:
        greedy_rows = md.temperature == 0.0
        temp = torch.where(greedy_rows, torch.ones_like(md.temperature), md.temperature)
        logits = apply_top_k_top_p_min_p(logits / temp.unsqueeze(1), md)
        probs = md.softmax(logits, False)
        race = torch.empty_like(probs).exponential_()
        for row, gen in md.generators.items():
            race[row].exponential_(generator=gen)
        ids = torch.where(greedy_rows, greedy_ids, (probs / race).argmax(-1))

    if raw_logprobs is None:
        return SamplerOutput(token_ids=ids)
    return logprob_stats(raw_logprobs, ids, md.max_num_logprobs or 0)


def logprob_stats(logprobs: torch.Tensor, ids: torch.Tensor, k: int) -> SamplerOutput:
    """For rows of ``logprobs`` [N, V] and chosen ``ids`` [N]: each chosen token's logprob, its
    rank (1 = best) and, for k > 0, the top k (ids, logprobs). Also used for prompt logprobs."""
    chosen = logprobs.gather(1, ids.unsqueeze(1)).squeeze(1)
    out = SamplerOutput(token_ids=ids, logprobs=chosen,
                        ranks=(logprobs > chosen.unsqueeze(1)).sum(-1) + 1)
    if k > 0:
        out.topk_logprobs, out.topk_ids = logprobs.topk(k, dim=-1)
    return out
