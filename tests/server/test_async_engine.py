"""The in-process EngineClient without HTTP: the batching window and shutdown with requests in
flight."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pagedllm.engine import LLMEngine
from pagedllm.engine.client import OutputStream, ServerShuttingDown
from pagedllm.engine.client_inproc import InProcessClient
from pagedllm.engine.messages import EngineCoreOutputs
from pagedllm.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine(chat_model: Path) -> LLMEngine:
    return LLMEngine.from_args(model=str(chat_model), block_size=4, num_kv_blocks=128, max_model_len=128)


def test_batch_window_lets_a_late_arrival_join_the_first_step(chat_model: Path) -> None:
    """"b" is sent after the engine accepted "a" and had half a second in which it would have
    stepped "a" alone without a window; the window waits for arrivals until the batch reaches
    max_num_seqs=2, so both get their first token from engine step 1. The window (60 s) is far
    longer than the test: it closes on its condition, not on time."""
    engine = LLMEngine.from_args(model=str(chat_model), block_size=4, num_kv_blocks=128,
                                 max_model_len=128, max_num_seqs=2)
    first_step: dict[str, int] = {}  # request -> the engine step that produced its first token
    real_step, steps = engine.core.step, [0]

    def step() -> EngineCoreOutputs:  # the core's step: the client's loop drives the core
        outs = real_step()
        steps[0] += 1
        for out in outs.outputs:
            if out.new_token_ids and out.request_id not in first_step:
                first_step[out.request_id] = steps[0]
        return outs

    engine.core.step = step  # type: ignore[method-assign]

    async def main() -> None:
        ae = InProcessClient(engine, batch_wait_ms=60_000)
        await ae.start()
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        streams = {rid: OutputStream() for rid in ("a", "b")}
        await ae.add_request("a", [5, 6, 7], sp, streams["a"])
        # give an engine without a window every chance to step "a" alone before "b" arrives
        deadline = time.monotonic() + 0.5
        while steps[0] == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await ae.add_request("b", [5, 6, 7], sp, streams["b"])
        for stream in streams.values():
            async for _ in stream:
                pass
        await ae.shutdown()

    asyncio.run(main())
    assert first_step == {"a": 1, "b": 1}
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_shutdown_aborts_in_flight_requests(engine: LLMEngine) -> None:
    async def main() -> None:
        ae = InProcessClient(engine)
        await ae.start()
        stream = OutputStream()
        await ae.add_request("long", [5, 6], SamplingParams(max_tokens=120, ignore_eos=True), stream)
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("empty", [], SamplingParams(), OutputStream())
        it = stream.__aiter__()
        await it.__anext__()
        await ae.shutdown()
        with pytest.raises(ServerShuttingDown):
            while True:
                await it.__anext__()

    asyncio.run(main())
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_the_engine_loop_releases_memory_once_it_idles_never_per_step(engine: LLMEngine) -> None:
    """The core loop hands its idle spells to IdleRelease: no release while steps run, one
    (after the last step) once a wait for work runs out, none more while it stays idle."""
    from pagedllm._malloc import IdleRelease

    async def main() -> tuple[list[int], int]:
        ae = InProcessClient(engine)
        await ae.start()
        at_step: list[int] = []  # the loop's steps at each release
        assert ae._core_loop is not None
        ae._core_loop.idle_release = IdleRelease(after_s=0.3,
                                                 release=lambda: at_step.append(ae.num_steps))
        for rid in ("a", "b"):
            stream = OutputStream()
            await ae.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=12, ignore_eos=True), stream)
            async for _ in stream:
                pass
            await asyncio.sleep(1.2)  # four times the idle delay: still one release
        steps = ae.num_steps
        await ae.shutdown()
        return at_step, steps

    at_step, steps = asyncio.run(main())
    assert steps >= 24 and len(at_step) == 2, (at_step, steps)
    assert at_step[1] == steps and 12 <= at_step[0] <= steps - 12  # after each request's last step
