"""A step's flat batch on the host (numpy), and moving host data to the device without syncs.

Flat batch of one step (B requests, T new tokens in all)::

    request        r0            r1   r2
    input_ids   [ a a a a a  |  b  |  c c ]      T = 8
    positions   [ 3 4 5 6 7  |  9  |  0 1 ]      start_i + (0..q_len_i-1)
    q_start     [ 0,          5,    6,    8 ]    [B+1]
    seq_lens    [ 8,          10,   2 ]          start_i + q_len_i
    slot        block_tables[req, pos // bs] * bs + pos % bs

Device transfers. On CUDA a ``torch.tensor(list, device="cuda")`` or a copy from pageable memory
waits for the stream (a hidden sync per tensor). ``Uploader`` packs a step's integer arrays into
one pinned int64 staging buffer and sends it with a single non-blocking copy; the device side
slices it and casts the int32 parts. The staging buffer is reused: before refilling it the
uploader waits on an event recorded after the previous copy (usually long done: most steps end
by reading their sampled tokens back; a step that samples nothing, a middle prefill chunk, does
not, and then the event is what keeps the copy in flight from reading overwritten data).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from pagedllm.attention import AttentionMetadata
from pagedllm.attention.base import to_device


@dataclass
class HostBatch:
    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    q_start: np.ndarray  # [B+1] int64
    seq_lens: np.ndarray  # [B] int64
    tables: np.ndarray  # [B, W] int64, right-padded with each row's last block
    max_query_len: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def is_decode_only(self) -> bool:
        return self.num_tokens == self.num_reqs


def build_host_batch(
    token_ids: list[list[int]], starts: list[int], tables: list[list[int]], block_size: int
) -> HostBatch:
    """``token_ids[i]``: request i's new tokens, at positions ``starts[i]...``; ``tables[i]``: its
    block table (covering every new position). Rows are padded with their own last block, so
    every entry a backend may gather (masked) names a block of that request, never a free one.
    A fixed number of numpy calls whatever the batch: no Python step per token; a decode-only
    batch (one token per request, most steps) in a few list operations instead."""
    n = len(token_ids)
    if all(len(t) == 1 for t in token_ids):
        return _decode_batch(token_ids, starts, tables, block_size)
    q_lens = np.fromiter(map(len, token_ids), dtype=np.int64, count=n)
    st = np.asarray(starts, dtype=np.int64)
    q_start = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(q_lens, out=q_start[1:])
    num_tokens = int(q_start[-1])
    ids = np.fromiter(chain.from_iterable(token_ids), dtype=np.int64, count=num_tokens)
    # positions = arange(T) - (q_start_i - start_i) for the request owning each row
    req_idx = np.repeat(np.arange(n), q_lens)
    positions = np.arange(num_tokens, dtype=np.int64) - (q_start[:-1] - st)[req_idx]
    # tables, concatenated, then gathered: row i, column j = tables[i][min(j, len_i - 1)]
    t_lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
    t_end = np.cumsum(t_lens)
    flat = np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=int(t_end[-1]))
    width = int(t_lens.max())
    tab = flat[(t_end - t_lens)[:, None] + np.minimum(np.arange(width), t_lens[:, None] - 1)]
    slots = tab[req_idx, positions // block_size] * block_size + positions % block_size
    return HostBatch(ids, positions, slots, q_start, st + q_lens, tab, int(q_lens.max()))


def _decode_batch(token_ids: list[list[int]], starts: list[int], tables: list[list[int]],
                  block_size: int) -> HostBatch:
    """``build_host_batch`` of one new token per request: the same arrays."""
    n = len(token_ids)
    width = max(map(len, tables))
    tab = np.array([t + t[-1:] * (width - len(t)) for t in tables], dtype=np.int64)
    slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(tables, starts)]
    pos = np.array(starts, dtype=np.int64)
    return HostBatch(np.array([t[0] for t in token_ids], dtype=np.int64), pos,
                     np.array(slots, dtype=np.int64), np.arange(n + 1, dtype=np.int64), pos + 1,
                     tab, 1)


class Uploader:
    """Host arrays -> device tensors: zero-copy views on CPU; one pinned, non-blocking copy per
    call on CUDA (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._staging = torch.empty(0, dtype=torch.int64)
        self._copied: torch.cuda.Event | None = None  # recorded after the last staging copy

    def upload(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 device tensors of the arrays' shapes (one copy on CUDA)."""
        if not self.cuda:
            return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
        sizes = [a.size for a in arrays]
        total = sum(sizes)
        if self._copied is not None:
            self._copied.synchronize()
        if self._staging.numel() < total:
            self._staging = torch.empty(max(total, 2 * self._staging.numel()), dtype=torch.int64,
                                        pin_memory=True)
        host = self._staging.numpy()
        off = 0
        for a, n in zip(arrays, sizes):
            host[off : off + n] = a.reshape(-1)
            off += n
        flat = self._staging[:total].to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return list(t.view(a.shape) for t, a in zip(flat.split(sizes), arrays))

    def tensor(self, data: list[int] | list[float], dtype: torch.dtype) -> torch.Tensor:
        """A small tensor of per-request values (sampling parameters) on the device."""
        return to_device(data, dtype, self.device)

    def metadata(self, hb: HostBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(input_ids [T], positions [T], AttentionMetadata) of a host batch."""
        if self.cuda:
            ids, pos, slots, qsl, seq, tab = self.upload(
                [hb.input_ids, hb.positions, hb.slots, hb.q_start, hb.seq_lens, hb.tables]
            )
            qsl, seq, tab = qsl.to(torch.int32), seq.to(torch.int32), tab.to(torch.int32)
        else:  # views of the host arrays; the int32 ones cast by numpy (cheaper than torch)
            ids, pos, slots = (torch.from_numpy(a) for a in (hb.input_ids, hb.positions,
                                                             hb.slots))
            qsl, seq, tab = (torch.from_numpy(a.astype(np.int32)) for a in (hb.q_start,
                                                                            hb.seq_lens, hb.tables))
        meta = AttentionMetadata(
            slot_mapping=slots,
            query_start_loc=qsl,
            seq_lens=seq,
            block_tables=tab,
            max_query_len=hb.max_query_len,
            max_seq_len=int(hb.seq_lens.max()),
            query_start_loc_cpu=hb.q_start.tolist(),
            seq_lens_cpu=hb.seq_lens.tolist(),
        )
        return ids, pos, meta


def fetch(tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Device tensors -> CPU tensors with one synchronisation for all of them (CUDA: copies into
    pinned buffers, non-blocking, then one stream sync)."""
    live = [t for t in tensors if t is not None]
    if not live or live[0].device.type != "cuda":
        return [None if t is None else t.cpu() for t in tensors]
    out: list[torch.Tensor | None] = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        dst.copy_(t, non_blocking=True)
        out.append(dst)
    torch.cuda.current_stream(live[0].device).synchronize()
    return out
