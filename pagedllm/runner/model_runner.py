"""SchedulerOutput -> flat batch tensors -> model -> sampled tokens.

Flat batch of one step (B requests, T new tokens in all)::

    request        r0            r1   r2
    input_ids   [ a a a a a  |  b  |  c c ]      T = 8
    positions   [ 3 4 5 6 7  |  9  |  0 1 ]      start_i + (0..q_len_i-1)
    q_start     [ 0,          5,    6,    8 ]    [B+1]
    seq_lens    [ 8,          10,   2 ]          start_i + q_len_i
    slot        block_tables[req, pos // bs] * bs + pos % bs

Everything here is batched over tokens with tensor ops; Python loops run over requests only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata, get_backend
from pagedllm.config import EngineConfig
from pagedllm.distributed.group import TPGroup, local_kv_model
from pagedllm.layers.sampler import SamplingMetadata, sample
from pagedllm.models.loader import load_model
from pagedllm.runner.kv_cache import KVCache, kv_bytes_per_block
from pagedllm.scheduler import ScheduledRequest, SchedulerOutput

_GREEDY_EPS = 1e-5  # temperatures below this sample greedily


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    topk: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class PromptLogprobsChunk:
    """Logprobs of prompt tokens start+1 .. start+len(chosen) (positions in the prompt)."""

    start: int
    chosen: list[float]
    ranks: list[int]
    topk: list[list[tuple[int, float]]]


@dataclass
class RunnerOutput:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, num_blocks: int, tp: TPGroup | None = None) -> None:
        """``tp``: this rank's tensor-parallel group; the model and KV cache hold its heads only."""
        self.config = config
        self.device = torch.device(config.device)
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.backend = get_backend(config.attention_backend, config.device)
        self.model = load_model(config.model, self.backend, config.device, tp)
        cache = config.cache
        if cache.kv_quantized and not self.backend.supports_quantized_kv:
            raise ValueError(
                f"attention backend {self.backend.name!r} does not read a quantized KV cache "
                f"(k_cache_dtype={cache.k_cache_dtype!r}, v_cache_dtype={cache.v_cache_dtype!r}); "
                f"use --kv-cache-dtype auto or a backend that does: torch_ref, cpu, triton"
            )
        host = cache.swap_space // kv_bytes_per_block(config.model, cache)
        self.kv_cache = KVCache(local_kv_model(config.model, tp), num_blocks, self.block_size, config.device, host,
                                cache.k_cache_dtype, cache.v_cache_dtype)
        self.generators: dict[str, torch.Generator] = {}
        torch.manual_seed(config.seed)

    # -- batch preparation --------------------------------------------------------------------
    def prepare(self, sched: list[ScheduledRequest]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        q_lens = np.fromiter((s.num_new_tokens for s in sched), dtype=np.int64, count=len(sched))
        starts = np.fromiter((s.start for s in sched), dtype=np.int64, count=len(sched))
        seq_lens = starts + q_lens
        q_start = np.zeros(len(sched) + 1, dtype=np.int64)
        np.cumsum(q_lens, out=q_start[1:])
        num_tokens = int(q_start[-1])

        ids: list[int] = []
        for s in sched:
            ids.extend(s.request.token_ids[s.start : s.end])
        # positions = arange(T) - (q_start_i - start_i) for the request owning each row
        req_idx = np.repeat(np.arange(len(sched)), q_lens)
        positions = np.arange(num_tokens) - (q_start[:-1] - starts)[req_idx]

        max_blocks = max(len(s.block_table) for s in sched)
        tables = np.zeros((len(sched), max_blocks), dtype=np.int32)
        for i, s in enumerate(sched):
            tables[i, : len(s.block_table)] = s.block_table
        slots = tables[req_idx, positions // bs].astype(np.int64) * bs + positions % bs

        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(q_start.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
            query_start_loc_cpu=q_start.tolist(),
            seq_lens_cpu=seq_lens.tolist(),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        return input_ids, torch.from_numpy(positions).to(dev), meta

    def _sampling_metadata(self, sched: list[ScheduledRequest]) -> SamplingMetadata:
        dev = self.device
        params = [s.request.params for s in sched]
        temps = [0.0 if p.temperature < _GREEDY_EPS else p.temperature for p in params]
        md = SamplingMetadata(
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            all_greedy=all(t == 0.0 for t in temps),
        )
        if not md.all_greedy:
            if any(p.top_k > 0 for p in params):
                md.top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev)
            if any(p.top_p < 1.0 for p in params):
                md.top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev)
            if any(p.min_p > 0.0 for p in params):
                md.min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=dev)
            for row, s in enumerate(sched):
                seed = s.request.params.seed
                if seed is not None and temps[row] > 0.0:
                    gen = self.generators.get(s.request.request_id)
                    if gen is None:
                        gen = torch.Generator(device=dev).manual_seed(seed)
                        self.generators[s.request.request_id] = gen
                    md.generators[row] = gen
        if any(p.uses_penalties for p in params):
            self._add_penalties(md, sched)
        for row, s in enumerate(sched):
            r = s.request
            if r.num_output_tokens < r.params.min_tokens:
                ban = list(r.eos_token_ids) + list(r.params.stop_token_ids or [])
                if ban:
                    md.banned.append((row, ban))
        ks = [p.logprobs for p in params if p.logprobs is not None]
        md.max_num_logprobs = max(ks) if ks else None
        return md

    def _add_penalties(self, md: SamplingMetadata, sched: list[ScheduledRequest]) -> None:
        dev, vocab, b = self.device, self.vocab_size, len(sched)
        params = [s.request.params for s in sched]
        out_ids = [s.request.output_token_ids for s in sched]
        md.output_counts = _counts(out_ids, b, vocab, dev)
        if any(p.repetition_penalty != 1.0 for p in params):
            md.prompt_mask = _counts([s.request.prompt_token_ids for s in sched], b, vocab, dev) > 0
            md.repetition_penalty = torch.tensor([p.repetition_penalty for p in params], device=dev)
        if any(p.presence_penalty != 0.0 for p in params):
            md.presence_penalty = torch.tensor([p.presence_penalty for p in params], device=dev)
        if any(p.frequency_penalty != 0.0 for p in params):
            md.frequency_penalty = torch.tensor([p.frequency_penalty for p in params], device=dev)

    # -- one step -----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        sched = out.scheduled
        result = RunnerOutput()
        # block moves first, in this order (see SchedulerOutput), each one batched
        self.kv_cache.swap_out(out.swap_out)
        self.kv_cache.copy_blocks(out.block_copies)
        self.kv_cache.swap_in(out.swap_in)
        if not sched:
            return result
        input_ids, positions, meta = self.prepare(sched)
        hidden = self.run_model(input_ids, positions, meta)  # [T, hidden]

        last_rows = [meta.query_start_loc_cpu[i + 1] - 1 for i in range(len(sched))]
        sampling = [i for i, s in enumerate(sched) if s.samples]
        if sampling:
            rows = torch.tensor([last_rows[i] for i in sampling], device=self.device)
            logits = self.model.compute_logits(hidden[rows])  # [S, V]
            sub = [sched[i] for i in sampling]
            so = sample(logits, self._sampling_metadata(sub))
            ids = so.token_ids.tolist()
            lps = so.logprobs.tolist() if so.logprobs is not None else None
            ranks = so.ranks.tolist() if so.ranks is not None else None
            tk_ids = so.topk_ids.tolist() if so.topk_ids is not None else None
            tk_lps = so.topk_logprobs.tolist() if so.topk_logprobs is not None else None
            for j, s in enumerate(sub):
                tok = SampledToken(ids[j])
                k = s.request.params.logprobs
                if k is not None and lps is not None and ranks is not None:
                    tok.logprob, tok.rank = lps[j], ranks[j]
                    if k > 0 and tk_ids is not None and tk_lps is not None:
                        tok.topk = list(zip(tk_ids[j][:k], tk_lps[j][:k]))
                result.sampled[s.request.request_id] = tok

        for i, s in enumerate(sched):
            if s.request.params.prompt_logprobs is not None and s.start < s.request.num_prompt_tokens - 1:
                result.prompt_logprobs[s.request.request_id] = self._prompt_logprobs(
                    s, hidden, meta.query_start_loc_cpu[i]
                )
        return result

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor,
                  meta: AttentionMetadata) -> torch.Tensor:
        """The forward of a prepared step (a tensor-parallel driver first sends it to its workers)."""
        return self.model(input_ids, positions, self.kv_cache.layers, meta)

    def _prompt_logprobs(self, s: ScheduledRequest, hidden: torch.Tensor, row0: int) -> PromptLogprobsChunk:
        """Row at position p predicts prompt token p+1, for p < num_prompt_tokens - 1."""
        req = s.request
        end = min(s.end, req.num_prompt_tokens - 1)
        n = end - s.start
        logits = self.model.compute_logits(hidden[row0 : row0 + n])  # [n, V]
        logprobs = logits.float().log_softmax(-1)
        targets = torch.tensor(req.prompt_token_ids[s.start + 1 : end + 1], device=self.device)
        chosen = logprobs.gather(1, targets.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > chosen.unsqueeze(1)).sum(-1) + 1
        k = req.params.prompt_logprobs or 0
        topk: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        if k > 0:
            v, ix = logprobs.topk(k, dim=-1)
            topk = [list(zip(a, b)) for a, b in zip(ix.tolist(), v.tolist())]
        return PromptLogprobsChunk(s.start + 1, chosen.tolist(), ranks.tolist(), topk)

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators) of finished requests."""
        for rid in request_ids:
            self.generators.pop(rid, None)


def _counts(seqs: list[list[int]], b: int, vocab: int, dev: torch.device) -> torch.Tensor:
    """[b, vocab] occurrence counts of each row's token ids, built with one scatter_add."""
    counts = torch.zeros(b, vocab, dtype=torch.float32, device=dev)
    lens = [len(x) for x in seqs]
    if sum(lens):
        flat = torch.tensor([t for x in seqs for t in x], dtype=torch.long, device=dev)
        rows = torch.repeat_interleave(torch.arange(b, device=dev), torch.tensor(lens, device=dev))
        counts.index_put_((rows, flat), torch.ones_like(flat, dtype=torch.float32), accumulate=True)
    return counts
