"""A step's sampling rows -> ``SamplingMetadata``: per-row parameters as device tensors, only
for what some row uses (an all-greedy batch sends one temperature tensor), the seeded
generators, penalty counts and the bans (min_tokens, bad words). Rows are looked at once for
everything most batches have none of."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from pagedllm.layers.sampler import SamplingMetadata
from pagedllm.runner.batch import Uploader
from pagedllm.runner.model_input import SeqInput
from pagedllm.runner.penalties import PenaltyCounts

GREEDY_EPS = 1e-5  # temperatures below this sample greedily


def request_seed(engine_seed: int, request_id: str) -> int:
    """The seed of an unseeded request's own generator in batch-invariant mode: a hash of the
    engine's seed and the request id (the same in every process; no draw from a shared
    generator, whose state would depend on what else ran before)."""
    digest = hashlib.sha256(f"{engine_seed}/{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def sampling_metadata(sched: list[SeqInput], up: Uploader,
                      generators: dict[str, torch.Generator],
                      penalty_counts: PenaltyCounts,
                      unseeded: int | None = None) -> tuple[SamplingMetadata, bool]:
    """The rows' sampling parameters, and whether a row has a logit bias or allowed token ids
    (``TokenConstraints``). ``generators``: the seeded requests' generators, made here at a
    request's first sampled step. ``unseeded``: the engine seed in batch-invariant mode, where
    a request without a seed gets a generator too (``request_seed``); None: such requests draw
    from the global generator, in batch order."""
    params = [s.params for s in sched]
    temps = [0.0 if p.temperature < GREEDY_EPS else p.temperature for p in params]
    md = SamplingMetadata(temperature=up.tensor(temps, torch.float32), all_greedy=not any(temps))
    if not md.all_greedy:
        if any(p.top_k > 0 for p in params):
            md.top_k = up.tensor([p.top_k for p in params], torch.long)
        if any(p.top_p < 1.0 for p in params):
            md.top_p = up.tensor([p.top_p for p in params], torch.float32)
        if any(p.min_p > 0.0 for p in params):
            md.min_p = up.tensor([p.min_p for p in params], torch.float32)
        for row, s in enumerate(sched):
            seed = s.params.seed
            if seed is None and unseeded is not None:
                seed = request_seed(unseeded, s.request_id)
            if seed is not None and temps[row] > 0.0:
                gen = generators.get(s.request_id)
                if gen is None:
                    gen = torch.Generator(device=up.device).manual_seed(seed)
                    generators[s.request_id] = gen
                md.generators[row] = gen
    penalties = masks = False
    rows: list[int] = []
    bans: list[int] = []
    k_max: int | None = None
    for row, s in enumerate(sched):
        p = s.params
        penalties = penalties or p.uses_penalties
        masks = masks or p.masks_tokens
        if p.logprobs is not None and (k_max is None or p.logprobs > k_max):
            k_max = p.logprobs
        ban = list(s.bad_word_bans or ())
        if p.min_tokens and s.num_output_tokens < p.min_tokens:
            ban += list(s.eos_token_ids) + list(p.stop_token_ids or [])
        if ban:
            rows.extend([row] * len(ban))
            bans.extend(ban)
    if penalties:
        _add_penalties(md, sched, up, penalty_counts)
    if bans:
        banned_rows, banned_ids = up.upload([np.asarray(rows, dtype=np.int64),
                                             np.asarray(bans, dtype=np.int64)])
        md.banned = (banned_rows, banned_ids)
    md.max_num_logprobs = k_max
    return md, masks


def _add_penalties(md: SamplingMetadata, sched: list[SeqInput], up: Uploader,
                   penalty_counts: PenaltyCounts) -> None:
    params = [s.params for s in sched]
    repetition = any(p.repetition_penalty != 1.0 for p in params)
    md.output_counts, md.prompt_mask = penalty_counts.rows(sched, with_prompt=repetition)
    if repetition:
        md.repetition_penalty = up.tensor([p.repetition_penalty for p in params], torch.float32)
    if any(p.presence_penalty != 0.0 for p in params):
        md.presence_penalty = up.tensor([p.presence_penalty for p in params], torch.float32)
    if any(p.frequency_penalty != 0.0 for p in params):
        md.frequency_penalty = up.tensor([p.frequency_penalty for p in params], torch.float32)
