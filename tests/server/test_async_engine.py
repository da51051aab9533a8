"""AsyncEngine without HTTP: the batching window and shutdown with requests in flight."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pagedllm.engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.server.async_engine import AsyncEngine, OutputStream, RequestAborted


@pytest.fixture(scope="module")
def engine(chat_model: Path) -> LLMEngine:
    return LLMEngine.from_args(model=str(chat_model), block_size=4, num_kv_blocks=128, max_model_len=128)


def test_batch_window_lets_a_late_arrival_join_the_first_step(engine: LLMEngine) -> None:
    async def main() -> list[int]:
        ae = AsyncEngine(engine, batch_wait_ms=300)
        ae.start()
        sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        first_step: list[int] = []

        async def run(rid: str, delay: float) -> None:
            await asyncio.sleep(delay)
            stream = OutputStream()
            await ae.add_request(rid, [5, 6, 7], sp, stream)
            async for out in stream:
                if len(out.outputs[0].token_ids) == 1:
                    first_step.append(ae.num_steps)

        await asyncio.gather(run("a", 0.0), run("b", 0.05))
        await ae.shutdown()
        return first_step

    assert asyncio.run(main()) == [1, 1]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_shutdown_aborts_in_flight_requests(engine: LLMEngine) -> None:
    async def main() -> None:
        ae = AsyncEngine(engine)
        ae.start()
        stream = OutputStream()
        await ae.add_request("long", [5, 6], SamplingParams(max_tokens=120, ignore_eos=True), stream)
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("empty", [], SamplingParams(), OutputStream())
        it = stream.__aiter__()
        await it.__anext__()
        await ae.shutdown()
        with pytest.raises(RequestAborted):
            while True:
                await it.__anext__()

    asyncio.run(main())
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
