"""Draft-model proposals: a smaller model with the target's tokenizer, its own paged KV cache,
run in the engine's process.

The draft holds KV for a request's tokens in its own ``KVCacheManager`` + ``BlockPool`` + KV
tensors (a ``ModelRunner`` of the draft checkpoint, eager). Each step a proposing request
with L tokens feeds the draft what it has not seen, then k - 1 of its own guesses::

    request tokens   [ 0 .. c-1 | c .. L-1 ]          c: positions the draft holds and agree
    draft forward 1  feeds c .. L-1            -> d1   (a prefill chunk on the first proposal)
    forwards 2..k    feed d1 .. d(k-1)         -> d2 .. dk   (positions L .. L+k-2)

Its proposals are greedy (argmax): the target's verification (spec_decode/verify.py) accepts a
proposal exactly when the target's own sample equals it, which keeps the target's distribution
for any proposer. Afterwards the draft holds L + k - 1 positions; the next step keeps the prefix
that the request's tokens confirm (the accepted guesses) and rolls the rest back
(``KVCacheManager.rollback``), so the rejected guesses' blocks return to the draft's pool.

Lifecycle (the target's request, followed): blocks of full, confirmed prompt/output blocks are
hashed in the draft's own prefix cache (a resumed or sibling request, n > 1, or a repeated
prompt hits them); a finished, aborted or preempted request frees every draft block (preempted
by swap too: the draft recomputes on resumption, mostly from its prefix cache). A draft pool
without room for a request's tokens proposes nothing for it (the target never waits for it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from pagedllm.kv.manager import KVCacheManager
from pagedllm.logging_utils import init_logger
from pagedllm.request import Request
from pagedllm.runner.batch import build_host_batch, fetch
from pagedllm.sched.output import KVUpdate

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig
    from pagedllm.runner.model_runner import ModelRunner

logger = init_logger(__name__)


class DraftProposer:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, vocab_size: int,
                 max_positions: int, max_num_batched_tokens: int) -> None:
        """``vocab_size``: proposals come from the first this many logits (the target's);
        ``max_positions``: the draft's rotary table; ``max_num_batched_tokens``: tokens per draft
        forward (a long catch-up is split into chunks)."""
        self.runner = runner
        self.kv = kv
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.budget = max_num_batched_tokens
        # per request: positions the draft holds for the request's own tokens (``base``) and the
        # guesses it wrote after them (positions base .. base + len(tail) - 1)
        self._base: dict[str, int] = {}
        self._tail: dict[str, list[int]] = {}

    # -- one step's proposals -------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in requests]
        live: list[tuple[int, Request, int]] = []  # (index, request, k)
        feeds: list[tuple[str, int, list[int]]] = []  # (request id, start position, tokens)
        for i, (r, k) in enumerate(zip(requests, ks)):
            k = min(k, self.max_positions - len(r.token_ids) + 1)  # guesses fed at <= L + k - 2
            start = self._keep_confirmed(r, k) if k > 0 else None
            if start is not None:
                live.append((i, r, k))
                feeds.append((r.request_id, start, list(r.token_ids[start:])))
        step = 0
        while live:
            for (i, _, _), g in zip(live, self._forward(feeds)):
                out[i].append(g)
            step += 1
            live = [x for x in live if x[2] > step]
            feeds = [(r.request_id, len(r.token_ids) + step - 1, [out[i][-1]]) for i, r, _ in live]
        for r, guesses in zip(requests, out):
            if guesses:
                rid = r.request_id
                self._base[rid] = len(r.token_ids)
                self._tail[rid] = guesses[:-1]  # the last guess was never fed
                self.kv.cache_blocks(rid, r.token_ids, len(r.token_ids))
        return out

    def _keep_confirmed(self, r: Request, k: int) -> int | None:
        """Roll the draft's KV of ``r`` back to the positions its tokens confirm and allocate
        slots for this step's feeds (L + k - 1 positions); the first position to feed, or None
        (no room in the draft's pool)."""
        rid, toks = r.request_id, r.token_ids
        base = self._base.get(rid)
        if base is None:
            hit = self.kv.find_prefix(toks)
            if not self.kv.allocate_slots(rid, len(toks) + k - 1, hit):
                return None
            self._base[rid], self._tail[rid] = hit.num_tokens, []
            return hit.num_tokens
        tail = self._tail[rid]
        keep = base
        while keep - base < len(tail) and keep < len(toks) - 1 and tail[keep - base] == toks[keep]:
            keep += 1
        self.kv.rollback(rid, keep)
        self._base[rid], self._tail[rid] = keep, []
        if not self.kv.allocate_slots(rid, len(toks) + k - 1):
            return None
        return keep

    def _forward(self, feeds: list[tuple[str, int, list[int]]]) -> list[int]:
        """Run the draft over ``feeds`` (in chunks of at most ``budget`` tokens); the greedy next
        token after each feed's last position, in order."""
        result: list[int] = [0] * len(feeds)
        todo = [(j, rid, start, toks) for j, (rid, start, toks) in enumerate(feeds)]
        while todo:
            batch: list[tuple[int, str, int, list[int], bool]] = []
            used = 0
            while todo and used < self.budget:
                j, rid, start, toks = todo[0]
                take = min(len(toks), self.budget - used)
                batch.append((j, rid, start, toks[:take], take == len(toks)))
                used += take
                if take == len(toks):
                    todo.pop(0)
                else:
                    todo[0] = (j, rid, start + take, toks[take:])
            hb = build_host_batch([b[3] for b in batch], [b[2] for b in batch],
                                  [self.kv.block_table(b[1]) for b in batch],
                                  self.runner.block_size)
            hidden = self.runner.run_step(KVUpdate(), hb)
            assert hidden is not None
            rows = [int(hb.q_start[n + 1]) - 1 for n, b in enumerate(batch) if b[4]]
            if not rows:
                continue
            logits = self.runner.model.compute_logits(hidden[self.runner.uploader.tensor(rows, torch.long)])
            ids = fetch([logits[:, : self.vocab_size].argmax(-1)])[0]
            assert ids is not None
            for b, t in zip((b for b in batch if b[4]), ids.tolist()):
                result[b[0]] = int(t)
        return result

    # -- lifecycle ----------------------------------------------------------------------------
    def release(self, request_ids: Iterable[str]) -> None:
        """Finished, aborted or preempted requests: every draft block back to the pool."""
        for rid in request_ids:
            self.kv.free(rid)
            self._base.pop(rid, None)
            self._tail.pop(rid, None)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        assert self._base.keys() == self._tail.keys()
        for rid in self._base:
            assert self.kv.has_request(rid), f"draft state of {rid!r} without draft blocks"


def build_draft_proposer(config: EngineConfig, tokenizer: Any, num_blocks: int) -> DraftProposer:
    """The draft of ``config.speculative`` (same dtype, device, block size and KV dtype as the
    target); its pool has ``speculative.draft_num_kv_blocks`` blocks, or ``num_blocks`` (as
    many tokens as the target's pool)."""
    from pagedllm.config import ModelConfig, ParallelConfig
    from pagedllm.hub import resolve_model
    from pagedllm.runner.model_runner import ModelRunner
    from pagedllm.tokenizer import get_tokenizer

    spec = config.speculative
    assert spec is not None and spec.model is not None
    path = resolve_model(spec.model, "speculative_config model")
    try:
        draft_tok = get_tokenizer(path, config.model.trust_remote_code)
    except ValueError as e:
        raise ValueError(f"speculative_config model={spec.model!r}: the draft needs the target's "
                         f"tokenizer files in its directory ({e}) (--speculative-config)") from None
    if draft_tok.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"speculative_config model={spec.model!r} has another tokenizer than the "
                         f"target {config.model.model!r}; a draft must share the target's "
                         f"vocabulary (--speculative-config)")
    model = ModelConfig.from_hf(path, config.model.dtype, config.model.trust_remote_code)
    blocks = spec.draft_num_kv_blocks or num_blocks
    cache = replace(config.cache, num_kv_blocks=blocks, kv_cache_memory=None, swap_space=0,
                    initial_num_kv_blocks=None, kv_trace_path=None)
    dconfig = replace(config, model=model, cache=cache, tokenizer=path, enforce_eager=True,
                      parallel=ParallelConfig(), speculative=None)
    runner = ModelRunner(dconfig, blocks)
    kv = KVCacheManager(blocks, cache.block_size, cache.enable_prefix_caching)
    logger.info("speculative decoding: draft %s (%d layers), KV %d blocks x %d tokens (%.1f MiB)",
                spec.model, model.num_hidden_layers, blocks, cache.block_size,
                blocks * cache.kv_bytes_per_block(model) / 2**20)
    return DraftProposer(runner, kv, min(model.vocab_size, config.model.vocab_size),
                         model.max_position_embeddings, config.scheduler.max_num_batched_tokens)
