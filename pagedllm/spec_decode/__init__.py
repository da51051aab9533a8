"""Speculative decoding on the paged cache: proposals (n-gram prompt lookup, or a draft model
with its own paged KV cache), verification in the target's one forward, KV rollback of rejected
tokens.

    config.py    SpeculativeConfig (``speculative_config`` / ``--speculative-config``)
    decoder.py   SpecDecoder: proposals before ``schedule``, counts after ``update``
    schedule.py  the scheduler's side: proposals within budget and blocks, accepted tokens, rollback
    adaptive.py  when to propose (batch size, a request's recent acceptance)
    ngram.py     prompt lookup proposals (pure numpy)
    draft.py     draft-model proposals over the draft's own KV pool
    verify.py    keep the proposals the target's own samples agree with (runner side)

The engine builds its SpecDecoder with ``decoder.build_spec_decoder``.
"""

from __future__ import annotations

from pagedllm.spec_decode.config import SpeculativeConfig  # stdlib only: config.py imports it

__all__ = ["SpeculativeConfig"]
