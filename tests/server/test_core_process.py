"""The engine core in its own process (``MPClient``, ``pagedllm/engine/core_proc.py``): the same
greedy outputs as in-process, named utility calls, aborts that free blocks in the core, refusals
that cross back as ValueError, and a core killed under load failing every stream fast."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from pagedllm.args import EngineArgs
from pagedllm.engine import LLMEngine
from pagedllm.engine.client import EngineError, OutputStream, RequestAborted
from pagedllm.engine.client_mp import MPClient
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

SETTINGS = dict(block_size=4, num_kv_blocks=256, max_model_len=128, max_num_seqs=16)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8, 12, 13, 14, 15, 16]]


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                          output_kind=RequestOutputKind.DELTA, logprobs=2)


async def _collect(client: MPClient, rid: str, prompt: list[int], sp: SamplingParams) -> tuple[list[int], str, list]:
    stream = OutputStream()
    await client.add_request(rid, {"prompt_token_ids": prompt}, sp, stream)
    ids: list[int] = []
    text, lps = "", []
    async for out in stream:
        c = out.outputs[0]
        ids += c.token_ids
        text += c.text
        lps += c.logprobs or []
    return ids, text, lps


def test_core_process_matches_in_process_then_dies_loudly(chat_model: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    """Greedy outputs and logprobs as in-process; refusals, aborts and utility calls; then
    SIGKILL of the core with 8 requests streaming: ``is_running`` (health) is False within 5 s,
    every stream ends with an EngineError naming the signal within 10 s, new requests are
    refused at once, and the log names the cause."""
    args = EngineArgs.from_kwargs(dict(model=str(chat_model), **SETTINGS), "test")
    ref = LLMEngine.from_engine_args(args)
    acc: dict[str, RequestOutput] = {}
    for i, p in enumerate(PROMPTS):
        ref.add_request(f"r{i}", {"prompt_token_ids": p}, _greedy(12))
    while ref.has_unfinished_requests():
        for out in ref.step():
            if out.request_id in acc:
                acc[out.request_id].add(out)
            else:
                acc[out.request_id] = out
    ref.shutdown()
    want = {}
    for rid, out in acc.items():
        c = out.outputs[0]
        assert len(c.token_ids) == 12
        want[rid] = (c.token_ids, c.text, [{t: (lp.logprob, lp.rank) for t, lp in pos.items()}
                                            for pos in c.logprobs or []])

    async def main() -> None:
        client = MPClient(args)
        await client.start()
        try:
            pid = client.proc.pid if client.proc else None
            assert pid is not None and pid != os.getpid()
            got = await asyncio.gather(*(_collect(client, f"r{i}", p, _greedy(12))
                                         for i, p in enumerate(PROMPTS)))
            for i, (ids, text, lps) in enumerate(got):
                w_ids, w_text, w_lps = want[f"r{i}"]
                assert ids == w_ids and text == w_text
                assert [{t: (lp.logprob, lp.rank) for t, lp in pos.items()} for pos in lps] == w_lps
            assert client.stats.kv.total == 256
            # the same prompt again: its 2 full blocks (8 of 9 tokens) come from the prefix cache
            stream = OutputStream()
            await client.add_request("again", {"prompt_token_ids": PROMPTS[2]}, _greedy(2), stream)
            cached = [out.metrics.num_cached_tokens async for out in stream if out.metrics]
            assert cached[-1] == 8, cached
            # a refusal crosses back as the engine's ValueError, nothing held
            with pytest.raises(ValueError, match="max_model_len"):
                await client.add_request("big", {"prompt_token_ids": [5] * 200}, _greedy(4),
                                         OutputStream())
            # an abort (a client gone) ends the stream here and frees the blocks in the core
            stream = OutputStream()
            await client.add_request("long", {"prompt_token_ids": [5, 6]},
                                     SamplingParams(max_tokens=100, ignore_eos=True,
                                                    output_kind=RequestOutputKind.DELTA), stream)
            it = stream.__aiter__()
            await it.__anext__()
            client.abort("long")
            with pytest.raises(RequestAborted):  # outputs queued before the abort come first
                for _ in range(100):
                    await it.__anext__()
            free, total = await client.utility("check_integrity")
            assert await client.utility("num_unfinished_requests") == 0
            assert free == total == 256
            assert (await client.kv_stats())["used_blocks"] == 0
            snap = await client.kv_snapshot()
            assert snap["requests"] == [] and snap["kv_stats"]["num_blocks"] == 256
            with pytest.raises(ValueError, match="unknown utility call"):
                await client.utility("no_such_call")
            streams = []
            for i in range(8):
                s = OutputStream()
                await client.add_request(f"s{i}", {"prompt_token_ids": [5, 6, 7]},
                                         SamplingParams(max_tokens=120, ignore_eos=True,
                                                        output_kind=RequestOutputKind.DELTA), s)
                streams.append(s)

            its = [s.__aiter__() for s in streams]
            for it in its:  # every one is running
                await it.__anext__()

            async def drain(it: AsyncIterator[RequestOutput]) -> BaseException | None:
                try:
                    async for _ in it:
                        pass
                except EngineError as e:
                    return e
                return None

            tasks = [asyncio.ensure_future(drain(it)) for it in its]
            assert client.proc is not None
            os.kill(client.proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
            health_by = time.monotonic() + 5
            while client.is_running:
                assert time.monotonic() < health_by, "health still up 5 s after the core died"
                await asyncio.sleep(0.05)
            errors = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
            assert all(isinstance(e, EngineError) and "SIGKILL" in str(e) for e in errors), errors
            with pytest.raises(EngineError, match="not running"):
                await client.add_request("late", [5], SamplingParams(), OutputStream())
        finally:
            await client.shutdown()

    with caplog.at_level("ERROR", logger="pagedllm"):
        asyncio.run(main())
    assert any("SIGKILL" in r.getMessage() for r in caplog.records), "the log must name the cause"


def test_the_server_side_releases_memory_once_per_idle_spell(chat_model: Path) -> None:
    """The server process tokenizes and holds request bodies, so it gives what a burst freed
    back once idle, as the core does (``MPClient.idle``): none at start-up, none while a
    request runs or a /tokenize-style job keeps coming, one after each idle spell."""
    from pagedllm._malloc import IdleRelease

    args = EngineArgs.from_kwargs(dict(model=str(chat_model), **SETTINGS), "test")

    async def main() -> tuple[list[int], int]:
        client = MPClient(args)
        await client.start()
        try:
            released: list[int] = []  # requests finished at each release
            done = [0]
            client.idle.release = IdleRelease(after_s=0.4, release=lambda: released.append(done[0]))
            await asyncio.sleep(1.0)  # idle since start-up: nothing to give back
            for i in range(2):
                await _collect(client, f"r{i}", PROMPTS[i], _greedy(16))
                done[0] += 1
                for _ in range(4):  # tokenizer work alone keeps the front end busy
                    await client.run_on_tokenizer_thread(lambda fe: fe.tokenizer.encode("x"))
                    await asyncio.sleep(0.15)
                await asyncio.sleep(1.6)  # four times the delay: still one release
            return released, done[0]
        finally:
            await client.shutdown()

    released, done = asyncio.run(main())
    assert released == [1, 2], (released, done)
