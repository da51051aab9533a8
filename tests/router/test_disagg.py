"""``router/disagg.py`` without engines: who prefills, what the prefill pass asks for, and which
outputs of a prefill replica are taken out of the stream."""

from __future__ import annotations

import pytest
from dp_helpers import engine_args

from pagedllm.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagedllm.router.client import DPClient
from pagedllm.router.disagg import PrefillDecode
from pagedllm.sampling_params import SamplingParams


def _req(rid: str) -> EngineCoreRequest:
    sp = SamplingParams(n=2, temperature=0.8, max_tokens=50, logprobs=3, stop=["x"])
    return EngineCoreRequest(request_id=rid, prompt_token_ids=[1, 2, 3], sampling_params=sp,
                             arrival_time=0.0)


def test_place_and_prefilled() -> None:
    pd = PrefillDecode(1, 3)
    live, idx = ["r0", "r1", "r2"], [0, 1, 2]
    sent, where = pd.place(_req("a"), live, idx, decode=False)
    p = sent.sampling_params
    assert where == ["r0"] and sent.request_id == "a" and sent.prompt_token_ids == [1, 2, 3]
    assert (p.n, p.max_tokens, p.temperature, p.logprobs, p.stop) == (1, 1, 0.0, None, [])
    assert pd.place(_req("b"), ["r1", "r2"], [1, 2], decode=False)[1] == ["r1", "r2"]  # no prefill left
    assert "b" not in pd.prefilling
    msg = EngineCoreOutputs(outputs=[
        EngineCoreOutput(request_id="a", new_token_ids=[5], finish_reason="length"),
        EngineCoreOutput(request_id="other", new_token_ids=[6])])
    (done,) = pd.prefilled(msg)
    assert done.sampling_params.max_tokens == 50 and [o.request_id for o in msg.outputs] == ["other"]
    sent, where = pd.place(done, live, idx, decode=True)
    assert sent is done and where == ["r1", "r2"]
    assert pd.place(done, ["r0"], [0], decode=True)[1] == ["r0"]  # no decode replica left
    pd.place(_req("c"), live, idx, decode=False)
    failed = EngineCoreOutputs(outputs=[EngineCoreOutput(request_id="c", error="failed")])
    assert pd.prefilled(failed) == [] and len(failed.outputs) == 1 and not pd.prefilling


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="give 1 to"):
        PrefillDecode(2, 2)
    with pytest.raises(ValueError, match="--kv-transfer-config too"):
        DPClient(engine_args(), size=2, prefill_replicas=1)
