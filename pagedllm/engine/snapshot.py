"""What the engine core tells about its state on request (named utility calls): the KV block
map with the requests holding it (the ``/kv`` inspector's snapshot). Runs on the core, between
steps; returns plain data, so it crosses to a front end in another process as it is."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from pagedllm.kv.snapshot import capture_kv
from pagedllm.request import RequestStatus

if TYPE_CHECKING:
    from pagedllm.engine.engine_core import EngineCore

TEXT_CHARS = 300  # of a prompt or an output shown with show_text


def kv_snapshot(engine: EngineCore, show_text: bool = False) -> dict[str, Any]:
    """The KV cache and the requests now: ``pagedllm.kv.snapshot.capture_kv``'s map plus each
    request's state and counts, ``kv_stats()`` and the queue lengths. Prompt and output text
    only with ``show_text``."""
    sched, kv = engine.scheduler, engine.kv
    snap = capture_kv(kv)
    now = time.monotonic()
    requests = []
    for r in sorted(sched.requests.values(), key=lambda r: r.sort_key):
        rid = r.request_id
        state = ("running" if r.status == RequestStatus.RUNNING
                 else "swapped" if kv.is_swapped(rid) else "waiting")
        entry: dict[str, Any] = {
            "id": rid, "state": state, "priority": r.priority,
            "prompt_tokens": r.num_prompt_tokens, "output_tokens": r.num_output_tokens,
            "computed": r.num_computed_tokens, "preemptions": r.num_preemptions,
            "age_s": round(now - r.arrival_time, 3),
        }
        if show_text:
            tok = engine.tokenizer
            entry["prompt"] = str(tok.decode(r.prompt_token_ids[:TEXT_CHARS]))[:TEXT_CHARS]
            entry["output"] = str(tok.decode(r.output_token_ids[-64:]))[-TEXT_CHARS:]
        requests.append(entry)
    snap.update(
        step=sched.num_steps, time=time.time(), requests=requests, kv_stats=engine.kv_stats(),
        num_running=sched.num_running, num_waiting=sched.num_waiting,
        num_swapped=sched.num_swapped,
    )
    return snap
