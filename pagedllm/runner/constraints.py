"""Per-row token constraints of a step's sampling batch: ``logit_bias`` (added to the logits) and
token masks (a grammar's ``TokenMasks`` from the engine, ``allowed_token_ids``), as
``SamplingMetadata.bias`` / ``.token_mask``. Rows without any pay nothing; a step without any
adds nothing to the sampler (the runner, which sees every row's parameters once already, does not
call ``add`` then).

Masks are bitmasks, one int32 word per 32 tokens (llguidance's layout): a row of a 150k-token
vocabulary is 19 KB on the host, unpacked on the device by the sampler.
"""

from __future__ import annotations

import numpy as np

from pagedllm.layers.sampler import SamplingMetadata
from pagedllm.runner.batch import Uploader
from pagedllm.runner.model_input import SeqInput
from pagedllm.structured.masks import TokenMasks, mask_words


class TokenConstraints:
    def __init__(self, vocab_size: int, uploader: Uploader) -> None:
        self.vocab = vocab_size
        self.up = uploader
        self._allowed: dict[str, np.ndarray] = {}  # request id -> its allowed_token_ids mask

    def add(self, md: SamplingMetadata, rows: list[int], sub: list[SeqInput],
            masks: TokenMasks | None) -> None:
        """``sub``: the sampling rows, ``rows``: their indices in the step's ``seqs`` (which
        ``masks.rows`` index)."""
        row_mask: dict[int, np.ndarray] = {}
        if masks is not None:
            at = {i: j for j, i in enumerate(rows)}
            bits = masks.bits()
            for k, i in enumerate(masks.rows):
                row_mask[at[i]] = bits[k]
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        for j, s in enumerate(sub):
            p = s.params
            if not p.masks_tokens:
                continue
            if p.logit_bias:
                bias_rows += [j] * len(p.logit_bias)
                bias_ids += list(p.logit_bias)
                bias_vals += list(p.logit_bias.values())
            if p.allowed_token_ids is not None:
                allowed = self._allowed_mask(s.request_id, p.allowed_token_ids)
                row_mask[j] = allowed if j not in row_mask else row_mask[j] & allowed
        if bias_ids:
            r, t = self.up.upload([np.asarray(bias_rows, dtype=np.int64),
                                   np.asarray(bias_ids, dtype=np.int64)])
            md.bias = (r, t, self.up.tensor(bias_vals, md.temperature.dtype))
        if row_mask:
            order = sorted(row_mask)
            r, words = self.up.upload([np.asarray(order, dtype=np.int64),
                                       np.stack([row_mask[j] for j in order])])
            md.token_mask = (r, words)

    def _allowed_mask(self, request_id: str, ids: list[int]) -> np.ndarray:
        m = self._allowed.get(request_id)
        if m is None:
            bools = np.zeros(mask_words(self.vocab) * 32, dtype=bool)
            bools[np.asarray(ids, dtype=np.int64)] = True
            m = np.packbits(bools, bitorder="little").view(np.int32)
            self._allowed[request_id] = m
        return m

    def release(self, request_id: str) -> None:
        self._allowed.pop(request_id, None)
