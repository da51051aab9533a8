"""Token counts for presence / frequency / repetition penalties, kept on the device.

Each request that uses a penalty gets a row (a slot) in two persistent tables::

    counts  [slots, vocab] fp32   how often each token occurs in the request's output so far
    prompt  [slots, vocab] bool   whether it occurs in the prompt (set once, at the first step)

A step adds only the tokens generated since the request's previous step (usually one) with one
scatter-add, then gathers the batch's rows: O(new tokens) host work per step instead of re-sending
every output token of every request. Rows are zeroed and recycled by ``release``; the tables
double when they run out of slots. Slot 0 stays all zeros: the row of every request of the batch
that uses no penalty (its penalties are neutral, whatever its counts; its ``SeqInput`` carries
no token lists).
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.runner.batch import Uploader
from pagedllm.runner.model_input import SeqInput


class PenaltyCounts:
    def __init__(self, vocab_size: int, uploader: Uploader) -> None:
        self.vocab = vocab_size
        self.up = uploader
        dev = uploader.device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.float32, device=dev)
        self.prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=dev)
        self.slots: dict[str, int] = {}
        self.counted: dict[str, int] = {}  # output tokens already in the request's row
        self.free: list[int] = []

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, 2 * old)
        counts = self.counts.new_zeros(new, self.vocab)
        prompt = self.prompt.new_zeros(new, self.vocab)
        counts[:old], prompt[:old] = self.counts, self.prompt
        self.counts, self.prompt = counts, prompt
        self.free.extend(range(new - 1, max(old, 1) - 1, -1))  # slot 0: the zero row

    def _slot(self, request_id: str, prompt: list[int]) -> int:
        slot = self.slots.get(request_id)
        if slot is None:
            if not self.free:
                self._grow()
            slot = self.free.pop()
            self.slots[request_id], self.counted[request_id] = slot, 0
            if prompt:
                ids = self.up.upload([np.asarray(prompt, dtype=np.int64)])[0]
                self.prompt[slot, ids] = True
        return slot

    def rows(self, reqs: list[SeqInput], with_prompt: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output counts [B, vocab], prompt mask [B, vocab] or None) of the batch's requests;
        the zero row for those without penalties (no ``output_token_ids``)."""
        slots: list[int] = []
        new_rows: list[int] = []
        new_toks: list[int] = []
        if not len(self.counts):
            self._grow()  # the zero row
        for r in reqs:
            out = r.output_token_ids
            if out is None or r.prompt_token_ids is None:
                slots.append(0)
                continue
            slot = self._slot(r.request_id, r.prompt_token_ids)
            done = self.counted[r.request_id]
            if len(out) < done:  # outputs were rewritten: count them again
                self.counts[slot].zero_()
                done = 0
            new_rows.extend([slot] * (len(out) - done))
            new_toks.extend(out[done:])
            self.counted[r.request_id] = len(out)
            slots.append(slot)
        idx, rows, toks = self.up.upload([np.asarray(slots, dtype=np.int64),
                                          np.asarray(new_rows, dtype=np.int64),
                                          np.asarray(new_toks, dtype=np.int64)])
        if new_toks:
            self.counts.index_put_((rows, toks), torch.ones_like(toks, dtype=torch.float32),
                                   accumulate=True)
        return self.counts[idx], (self.prompt[idx] if with_prompt else None)

    @torch.inference_mode()  # the tables are inference tensors (made inside the step)
    def release(self, request_id: str) -> None:
        slot = self.slots.pop(request_id, None)
        if slot is None:
            return
        self.counted.pop(request_id, None)
        self.counts[slot].zero_()
        self.prompt[slot] = False
        self.free.append(slot)
