"""ModelInput (the step as plain data) -> flat batch tensors -> model -> sampled tokens.

The flat batch layout is drawn in runner/batch.py. Everything here is batched over tokens with
tensor ops; Python loops run over requests only. On CUDA a step makes one host->device copy of
its batch (pinned, non-blocking), replays a captured graph for decode-only batches
(runner/cuda_graph.py), and synchronises once, when the sampled tokens come back.

Every rank runs ``run_step`` (the step's KV changes, then the forward); rank 0's ``execute``
wraps it with batch preparation and sampling. Start-up: the model loads first; with a KV pool
to be sized from ``gpu_memory_utilization`` the runner profiles the worst-case step
(``profile_run``, measured by runner/memory.py) before the engine calls ``init_kv_cache``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedllm import _malloc
from pagedllm.attention import AttentionMetadata, get_backend
from pagedllm.config import EngineConfig
from pagedllm.distributed.group import TPGroup, local_kv_model
from pagedllm.kv.ext_tier import rank_part
from pagedllm.layers.sampler import SamplingMetadata, logprob_stats, plain_greedy, sample
from pagedllm.logging_utils import init_logger
from pagedllm.lora.manager import LoRAManager
from pagedllm.lora.request import LoRARequest
from pagedllm.models.loader import load_model
from pagedllm.runner.batch import HostBatch, Uploader, build_host_batch, fetch
from pagedllm.runner.constraints import TokenConstraints
from pagedllm.runner.cuda_graph import DecodeGraphs, capture_sizes
from pagedllm.runner.kv_cache import KVCache
from pagedllm.runner.linears import prepare_model
from pagedllm.runner.memory import MemoryProfile, MemoryProfiler
from pagedllm.runner.model_input import ModelInput, SeqInput
from pagedllm.runner.penalties import PenaltyCounts
from pagedllm.runner.sampling import sampling_metadata
from pagedllm.sched.output import KVUpdate
from pagedllm.spec_decode import verify

logger = init_logger(__name__)

PROMPT_LOGPROBS_ROWS = 512  # prompt logprobs are computed this many rows at a time


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
    # speculative decoding: the proposals each verifying request accepted, in order, before
    # its ``sampled`` token (pagedllm/spec_decode/verify.py)
    accepted: dict[str, list[SampledToken]] = field(default_factory=dict)
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    prepare_s: float = 0.0  # time in ``prepare`` (block tables -> flat batch), for the stats


class ModelRunner:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None,
                 tp: TPGroup | None = None) -> None:
        """``num_blocks``: KV pool size; None: wait for ``init_kv_cache`` (after profiling memory
        into ``memory_profile`` where ``config.kv_sized_by_profile``). ``tp``: this rank's
        tensor-parallel group; the model and KV cache hold its heads only."""
        self.config = config
        self.tp = tp
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(
                f"device={config.device!r} but torch {torch.__version__} sees no CUDA GPU "
                f"(torch.cuda.is_available() is False); install a CUDA build of torch on a GPU "
                f"machine, or use --device cpu"
            )
        if self.device.type == "cuda":  # kernels launch on the thread's current device
            if self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            torch.cuda.set_device(self.device)
        self.block_size = config.cache.block_size
        self.vocab_size = config.model.vocab_size
        self.backend = get_backend(config.attention_backend, str(self.device),
                                   config.batch_invariant)
        self.uploader = Uploader(self.device)
        profiler = MemoryProfiler(self.device) if config.kv_sized_by_profile else None
        if profiler is not None:
            profiler.start()
        self.model = load_model(config.model, self.backend, str(self.device), tp)
        self.lora = None if config.lora is None else LoRAManager(self.model, config.lora, self.device)
        self.softmax = prepare_model(self.model, config, self.device, self.backend.name)
        cache = config.cache
        if cache.kv_quantized and not self.backend.supports_quantized_kv:
            raise ValueError(
                f"attention backend {self.backend.name!r} does not read a quantized KV cache "
                f"(k_cache_dtype={cache.k_cache_dtype!r}, v_cache_dtype={cache.v_cache_dtype!r}); "
                f"use --kv-cache-dtype auto or a backend that does: torch_ref, cpu, triton"
            )
        self.generators: dict[str, torch.Generator] = {}
        self.penalty_counts = PenaltyCounts(self.vocab_size, self.uploader)
        self.constraints = TokenConstraints(self.vocab_size, self.uploader)
        torch.manual_seed(config.seed)
        self.graphs: DecodeGraphs | None = None
        self.memory_profile: MemoryProfile | None = None
        if profiler is not None:
            profiler.weights_loaded()
            self.memory_profile = self._profile_memory(profiler)
        if num_blocks is not None:
            self.init_kv_cache(num_blocks)

    @property
    def use_cuda_graphs(self) -> bool:
        """Decode steps replay CUDA graphs: on CUDA, without enforce_eager, one rank, and with a
        backend that keeps its decode path free of host data (``supports_cuda_graphs``)."""
        return (self.device.type == "cuda" and not self.config.enforce_eager and self.tp is None
                and self.backend.supports_cuda_graphs)

    def new_kv_cache(self, num_blocks: int, num_host_blocks: int = 0) -> KVCache:
        c = self.config.cache
        return KVCache(local_kv_model(self.config.model, self.tp), num_blocks, self.block_size,
                       str(self.device), num_host_blocks, c.k_cache_dtype, c.v_cache_dtype)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV pool (and host tier); capture the decode CUDA graphs over it."""
        cache = self.config.cache
        host = cache.num_host_blocks(self.config.model)
        self.kv_cache = self.new_kv_cache(num_blocks, host)
        if self.device.type == "cpu":  # after the weights and the pool: steps reuse their memory
            logger.debug(_malloc.keep_freed_memory())
        if self.device.type == "cuda" and not self.use_cuda_graphs and not self.config.enforce_eager:
            logger.info("CUDA graphs off: attention backend %r does not support them%s",
                        self.backend.name, " (tensor parallel)" if self.tp is not None else "")
        if self.use_cuda_graphs:
            try:
                self.enable_decode_graphs()
            except Exception as e:  # CUDA or Triton (compile, resources) error: serve eagerly
                self.graphs = None
                logger.warning("CUDA graph capture failed, decode steps run eagerly "
                               "(--enforce-eager skips the attempt): %s", e)

    def enable_decode_graphs(self, capture: bool = True) -> DecodeGraphs:
        """Serve decode-only steps from static buffers, recorded as CUDA graphs (``capture``),
        or replayed eagerly (``capture=False``: the same padded path, testable on CPU)."""
        sc = self.config.scheduler
        lora = self.lora if self.lora is not None and self.lora.graphable else None
        self.graphs = DecodeGraphs(self.run_forward, self.kv_cache, sc.max_num_seqs,
                                   sc.max_model_len, self.block_size, self.device, capture, lora)
        self.graphs.capture_all()
        return self.graphs

    def run_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVCache,
                    meta: AttentionMetadata) -> torch.Tensor:
        """The model over ``kv`` (the pool, or the profiler's throw-away cache): hidden [T, H]."""
        return self.model(input_ids, positions, kv.layers, meta)

    # -- the memory profile (CUDA start-up; runner/memory.py measures) -------------------------------
    def _profile_memory(self, profiler: MemoryProfiler) -> MemoryProfile:
        """The profiling steps of a freshly loaded runner (no KV pool yet), measured."""
        sc = self.config.scheduler
        profiler.step()
        self.profile_run(sc.max_num_batched_tokens, sc.max_num_seqs)
        profiler.step_done("prefill")
        if self.use_cuda_graphs:  # the graphs' pool holds the largest decode batch's activations
            g = capture_sizes(sc.max_num_seqs)[-1]
            profiler.step()
            self.profile_run(g, g)
            profiler.step_done("decode")
        torch.cuda.empty_cache()
        return profiler.profile()

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, num_reqs: int) -> None:
        """One worst-case step against a throw-away KV cache: ``num_tokens`` new tokens over
        ``num_reqs`` requests starting at position 0, logits for every request, and sampling with
        top-k, top-p, min-p, penalties and 20 logprobs. Touches no engine state."""
        num_reqs = max(1, min(num_reqs, num_tokens))
        per, extra = divmod(num_tokens, num_reqs)
        q_lens = [per + (i < extra) for i in range(num_reqs)]
        bs = self.block_size
        tables: list[list[int]] = []
        nxt = 0
        for q in q_lens:
            n = -(-q // bs)
            tables.append(list(range(nxt, nxt + n)))
            nxt += n
        kv = self.new_kv_cache(nxt)
        hb = build_host_batch([[0] * q for q in q_lens], [0] * num_reqs, tables, bs)
        b, dev, vocab = num_reqs, self.device, self.vocab_size
        ids, pos, meta = self.uploader.metadata(hb)
        hidden = self.run_forward(ids, pos, kv, meta)
        last = self.uploader.upload([hb.q_start[1:] - 1])[0]
        logits = self.model.compute_logits(hidden[last])
        md = SamplingMetadata(
            temperature=torch.ones(b, device=dev), all_greedy=False,
            top_k=torch.full((b,), 50, dtype=torch.long, device=dev),
            top_p=torch.full((b,), 0.9, device=dev), min_p=torch.full((b,), 0.05, device=dev),
            presence_penalty=torch.ones(b, device=dev),
            frequency_penalty=torch.ones(b, device=dev),
            repetition_penalty=torch.ones(b, device=dev),
            output_counts=torch.zeros(b, vocab, device=dev),
            prompt_mask=torch.zeros(b, vocab, dtype=torch.bool, device=dev),
            max_num_logprobs=min(self.config.max_logprobs, vocab),
        )
        fetch([sample(logits, md).token_ids])
        del kv

    # -- batch preparation --------------------------------------------------------------------
    def prepare(self, sched: list[SeqInput]) -> HostBatch:
        """The step's flat batch on the host: block tables -> positions and slot mapping."""
        return build_host_batch([s.input_token_ids for s in sched],
                                [s.start for s in sched], [s.block_table for s in sched],
                                self.block_size)

    # -- one step -----------------------------------------------------------------------------
    def apply_kv_update(self, u: KVUpdate) -> None:
        """The step's KV changes, in ``KVUpdate``'s documented order, each one batched move."""
        kv = self.kv_cache
        if u.resize is not None and u.resize > kv.num_blocks:
            kv.resize(u.resize)
        kv.copy_blocks(u.compaction)
        if u.resize is not None and u.resize < kv.num_blocks:
            kv.resize(u.resize)
        kv.swap_out(u.swap_out)
        kv.copy_blocks(u.block_copies)
        kv.swap_in(u.swap_in)
        if u.loads:  # a tensor-parallel rank takes its heads of each block
            r, n = (0, 1) if self.tp is None else (self.tp.rank, self.tp.size)
            kv.import_blocks([(rank_part(p, r, n), b) for p, b in u.loads])
        if self.lora is not None:  # LoRA adapters paged out of the pool, then in
            self.lora.apply_paging(u.lora_evictions, u.lora_loads, kv.page_bytes, kv.write_pages)

    def add_lora(self, req: LoRARequest) -> int:
        """Load and check an adapter into the host cache (``LoRAError`` if it cannot run):
        the KV blocks its weights take when paged in."""
        assert self.lora is not None
        return self.lora.add(req, self.kv_cache.page_bytes, self.kv_cache.num_blocks)

    @torch.inference_mode()
    def run_step(self, kv: KVUpdate, batch: HostBatch | None,
                 loras: list[tuple[LoRARequest | None, int]] | None = None) -> torch.Tensor | None:
        """What every rank does in a step: the KV changes, then the forward of ``batch`` (None:
        a KV-only step) with the LoRA adapters of ``loras`` (per row: adapter, new tokens; read
        from their pages after the KV changes). Hidden states [T, hidden], or [B, hidden] from a
        decode graph (which records the adapters' deltas where ``LoRAManager.graphable``).
        Tensor-parallel workers receive this call from rank 0; their all-reduces pair up."""
        self.apply_kv_update(kv)
        if batch is None:
            return None
        lora = None if self.lora is None or not loras else self.lora.prepare(
            [r for r, _ in loras], [n for _, n in loras], kv.lora_pages, self.kv_cache.read_pages)
        if self.graphs is not None and self.graphs.can_run(batch, lora):
            return self.graphs.run(batch, lora)  # [B, hidden]: one row per decode request
        input_ids, positions, meta = self.uploader.metadata(batch)
        meta.lora = lora
        return self.run_forward(input_ids, positions, self.kv_cache, meta)  # [T, hidden]

    @torch.inference_mode()
    def execute(self, out: ModelInput, hb: HostBatch | None = None) -> RunnerOutput:
        """Rank 0's step: ``run_step`` over the step's batch (``hb``, if the executor prepared it
        already), then logits, sampling and logprobs."""
        sched = out.seqs
        result = RunnerOutput()
        if self.device.type == "cuda" and torch.cuda.current_device() != self.device.index:
            torch.cuda.set_device(self.device)  # a server steps the engine from its own thread
        if sched and hb is None:
            t0 = time.perf_counter()
            hb = self.prepare(sched)
            result.prepare_s = time.perf_counter() - t0
        hidden = self.run_step(out.kv, hb, None if self.lora is None else out.lora_rows())
        if hidden is None or hb is None:
            return result

        q_start = hb.q_start.tolist()
        sampling = [i for i, s in enumerate(sched) if s.samples]
        if sampling:
            # one row per sampling request, k + 1 rows for one verifying k proposals
            owner = [i for i in sampling for _ in range(1 + len(sched[i].spec_token_ids))]
            sub = [sched[i] for i in owner]
            if len(sub) == hidden.shape[0]:  # every row samples (decode only, or verification)
                last = hidden
            else:
                last = hidden[self.uploader.tensor(
                    [r for i in sampling
                     for r in range(q_start[i + 1] - 1 - len(sched[i].spec_token_ids),
                                    q_start[i + 1])], torch.long)]
            spec = verify.SeededRewind(sub, self.generators)
            # a grammar's row never verifies
            md, masks = sampling_metadata(sub, self.uploader, self.generators, self.penalty_counts,
                                          self.config.seed if self.config.batch_invariant else None)
            md.softmax = self.softmax
            if masks or out.token_masks is not None:
                self.constraints.add(md, owner, sub, out.token_masks)
            # [rows, V]: fp32, or as the LM head made them where the argmax is all that is read
            logits = self.model.compute_logits(last, fp32=not plain_greedy(md))
            so = sample(logits, md)
            fetched = fetch([so.token_ids, so.logprobs, so.ranks, so.topk_ids, so.topk_logprobs])
            ids, lps, ranks, tk_ids, tk_lps = (None if t is None else t.tolist() for t in fetched)
            assert ids is not None
            toks: list[SampledToken] = []
            for j, s in enumerate(sub):
                tok = SampledToken(ids[j])
                k = s.params.logprobs
                if k is not None and lps is not None and ranks is not None:
                    tok.logprob, tok.rank = lps[j], ranks[j]
                    if k > 0 and tk_ids is not None and tk_lps is not None:
                        tok.topk = list(zip(tk_ids[j][:k], tk_lps[j][:k]))
                toks.append(tok)
            verify.accept(sub, toks, result.sampled, result.accepted)
            spec.rewind(result.accepted, self.vocab_size)

        for i, s in enumerate(sched):
            if s.params.prompt_logprobs is not None and s.start < s.num_prompt_tokens - 1:
                result.prompt_logprobs[s.request_id] = self._prompt_logprobs(
                    s, hidden, q_start[i]
                )
        return result

    def _prompt_logprobs(self, s: SeqInput, hidden: torch.Tensor, row0: int) -> PromptLogprobsChunk:
        """Row at position p predicts prompt token p+1, for p < num_prompt_tokens - 1.

        In slices of ``PROMPT_LOGPROBS_ROWS`` rows: a whole chunk at once would hold several
        [rows, vocab] fp32 tensors (GiBs for a large vocabulary) that no memory profile counts."""
        prompt = s.prompt_token_ids
        assert prompt is not None, "a row with prompt logprobs carries its prompt"
        end = min(s.end, s.num_prompt_tokens - 1)
        k = s.params.prompt_logprobs or 0
        chosen: list[float] = []
        ranks: list[int] = []
        topk: list[list[tuple[int, float]]] = []
        for a in range(s.start, end, PROMPT_LOGPROBS_ROWS):
            b = min(a + PROMPT_LOGPROBS_ROWS, end)
            rows = hidden[row0 + a - s.start : row0 + b - s.start]
            logprobs = self.softmax(self.model.compute_logits(rows), True)  # [rows, V] fp32
            targets = self.uploader.tensor(prompt[a + 1 : b + 1], torch.long)
            st = logprob_stats(logprobs, targets, k)
            c, r, tk_ids, tk_lps = fetch([st.logprobs, st.ranks, st.topk_ids, st.topk_logprobs])
            assert c is not None and r is not None
            chosen += c.tolist()
            ranks += r.tolist()
            if tk_ids is not None and tk_lps is not None:
                topk += [list(zip(t, p)) for t, p in zip(tk_ids.tolist(), tk_lps.tolist())]
            else:
                topk += [[] for _ in range(b - a)]
        return PromptLogprobsChunk(s.start + 1, chosen, ranks, topk)

    def kv_contents(self) -> list[torch.Tensor]:
        """Host copies of this rank's KV planes (``collective_rpc(ModelRunner.kv_contents)``)."""
        return [p.cpu().clone() for p in self.kv_cache.planes]

    def export_kv_blocks(self, blocks: list[int]) -> list[dict[str, torch.Tensor]]:
        """The blocks' K/V (and scales) as CPU payloads for the KV tier (``KVCache.export_blocks``)."""
        return self.kv_cache.export_blocks(blocks)

    def kv_payload_layout(self) -> dict[str, tuple[tuple[int, ...], str]]:
        return self.kv_cache.payload_layout()

    def release(self, request_ids: list[str]) -> None:
        """Forget per-request state (seeded generators, penalty counts) of finished requests."""
        for rid in request_ids:
            self.generators.pop(rid, None)
            self.penalty_counts.release(rid)
            self.constraints.release(rid)
