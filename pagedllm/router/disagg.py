"""Prefill/decode split over data-parallel replicas (``--prefill-replicas K``), on the KV tier.

    request ─▶ prefill replica (0..K-1): the prompt, max_tokens=1 ─▶ its full blocks put in the tier
              (its output is not streamed)        │ finished
                                                  ▼
               decode replica (K..N-1): the request as sent ─▶ loads the prompt's full blocks from
               the tier, computes the last partial block and decodes; its outputs are streamed

Replicas keep their roles; a decode replica computes only what the tier cannot give it (the
prompt's last partial block, or all of a prompt that asks for prompt logprobs). If no prefill
replica is left, a request goes straight to a decode replica (it then prefills itself); if no
decode replica is left, the prefill replicas decode as well. The prefill pass keeps the
request's id (its ``Accepted`` answers the client) and is a plain greedy request of one token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import msgspec

from pagedllm.engine.messages import EngineCoreOutputs, EngineCoreRequest
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

R = TypeVar("R")


def prefill_params() -> SamplingParams:
    """A prefill pass's: one greedy token, nothing else asked (its output is never streamed)."""
    return SamplingParams(n=1, temperature=0.0, max_tokens=1, ignore_eos=True,
                          output_kind=RequestOutputKind.FINAL_ONLY)


class PrefillDecode:
    """Which replicas prefill (indices below ``num_prefill``) and which requests are in their
    prefill pass (id -> the request as sent, for its decode pass)."""

    def __init__(self, num_prefill: int, size: int) -> None:
        if not 0 < num_prefill < size:
            raise ValueError(f"--prefill-replicas {num_prefill}: give 1 to "
                             f"--data-parallel-size - 1 = {size - 1} (the rest decode)")
        self.num_prefill = num_prefill
        self.prefilling: dict[str, EngineCoreRequest] = {}

    def place(self, req: EngineCoreRequest, live: Sequence[R], index: Sequence[int],
              decode: bool) -> tuple[EngineCoreRequest, list[R]]:
        """What to send for ``req`` and the replicas (of ``live``, whose indices are ``index``)
        that may take it: its prefill pass on a prefill replica, or (``decode``, or no prefill
        replica left) the request itself on a decode replica (any replica if none is left)."""
        pre = [r for r, i in zip(live, index, strict=True) if i < self.num_prefill]
        dec = [r for r, i in zip(live, index, strict=True) if i >= self.num_prefill]
        self.prefilling.pop(req.request_id, None)
        if decode or not pre:
            return req, dec or list(live)
        self.prefilling[req.request_id] = req
        return msgspec.structs.replace(req, sampling_params=prefill_params()), pre

    def prefilled(self, msg: EngineCoreOutputs) -> list[EngineCoreRequest]:
        """Take the prefill passes' outputs out of ``msg`` (from a prefill replica): the requests
        whose pass ended, for their decode pass. A pass that failed stays in ``msg``: the
        request fails as it would on one engine."""
        done, keep = [], []
        for out in msg.outputs:
            req = self.prefilling.get(out.request_id)
            if req is None or out.error is not None:
                keep.append(out)
                self.prefilling.pop(out.request_id, None)
            elif out.finish_reason is not None:
                done.append(self.prefilling.pop(out.request_id))
        if len(keep) != len(msg.outputs):
            msg.outputs = keep
        return done

    def forget(self, request_id: str) -> None:
        self.prefilling.pop(request_id, None)
