"""Replicas added and removed while serving (issue 28 item 6): a replica added under load takes
requests and gives one engine's tokens; a removed one finishes its requests first (drain) and
no request is lost; a drain past its timeout moves the requests that streamed nothing and ends
the rest with an error; vLLM's ``/scale_elastic_ep`` does both through the server."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from dp_helpers import PROMPTS, engine_args, generate, greedy, reference
from server_helpers import ServerThread

from pagedllm.engine.client import EngineError, OutputStream
from pagedllm.router.client import DPClient
from pagedllm.server.api import build_app

MAX_TOKENS = 24


def test_add_then_remove_a_replica_while_serving() -> None:
    want = reference(PROMPTS, MAX_TOKENS)

    async def main() -> dict[str, object]:
        dp = DPClient(engine_args(), size=1, policy="round_robin", num_threads=1)
        await dp.start()
        try:
            sp = greedy(MAX_TOKENS)
            first = [asyncio.ensure_future(generate(dp, f"a{i}", p, sp))
                     for i, p in enumerate(PROMPTS[:3])]
            added = await dp.add_replica()  # while those run on replica 0
            rest = [asyncio.ensure_future(generate(dp, f"b{i}", p, sp))
                    for i, p in enumerate(PROMPTS[3:])]
            while not dp.replicas[added].requests:  # routed there and not finished
                await asyncio.sleep(0.005)
            await dp.remove_replica(added)  # drains: its requests finish there
            routed_to_new = dp.replicas[added].computed_prefill_tokens
            out = await asyncio.gather(*first, *rest)
            after = await generate(dp, "c", PROMPTS[0], sp)  # the one left serves on
            with pytest.raises(ValueError, match="last serving engine replica"):
                await dp.remove_replica(0)
            with pytest.raises(ValueError, match="replica 1 is not serving"):
                await dp.remove_replica(added)
            stats = await dp.kv_stats()
            return dict(out=out, after=after, added=added, routed=routed_to_new,
                        degraded=dp.degraded, live=[r.index for r in dp.live],
                        retried=dp.num_retried, used=stats["used_blocks"])
        finally:
            await dp.shutdown()

    got = asyncio.run(main())
    assert got["added"] == 1 and got["routed"] > 0, got  # the new replica took requests
    assert got["out"] == want and got["after"] == want[0]
    assert got["retried"] == 0  # drained, not moved
    assert got["degraded"] is None and got["live"] == [0]
    assert got["used"] == 0


def test_a_drain_past_its_timeout_moves_the_unstreamed_and_fails_the_rest() -> None:
    async def main() -> tuple[object, list[int], int]:
        dp = DPClient(engine_args(), size=2, policy="round_robin", num_threads=1)
        await dp.start()
        try:
            long = greedy(400)
            long.ignore_eos = True
            stream = OutputStream()
            await dp.add_request("long", PROMPTS[5], long, stream)  # round robin: replica 0
            outputs = aiter(stream)
            await anext(outputs)  # it streamed
            await dp.remove_replica(0, drain_timeout=0.05)
            try:
                async for _ in outputs:
                    pass
                ended: object = "no error"
            except EngineError as e:
                ended = e
            again = await generate(dp, "after", PROMPTS[0], greedy(MAX_TOKENS))
            return ended, again, len(dp.routable)
        finally:
            await dp.shutdown()

    ended, again, routable = asyncio.run(main())
    assert isinstance(ended, EngineError) and "removed before the request finished" in str(ended)
    assert again == reference([PROMPTS[0]], MAX_TOKENS)[0] and routable == 1


def test_scale_elastic_ep_endpoint() -> None:
    dp = DPClient(engine_args(), size=1, policy="round_robin", num_threads=1)
    headers = {"Authorization": "Bearer k"}
    with ServerThread(build_app(dp, model_name="m", api_key="k")) as s:
        url = s.base_url
        assert httpx.post(url + "/scale_elastic_ep", json={"new_data_parallel_size": 2}
                          ).status_code == 401
        r = httpx.post(url + "/scale_elastic_ep", headers=headers,
                       json={"new_data_parallel_size": 0})
        assert r.status_code == 400 and "new_data_parallel_size" in r.text
        r = httpx.post(url + "/scale_elastic_ep", headers=headers, timeout=120,
                       json={"new_data_parallel_size": 2, "drain_timeout": 30})
        assert r.status_code == 200, r.text
        assert r.json() == {"message": "Scaled to 2 data parallel engines"}
        assert [x.index for x in dp.routable] == [0, 1]
        for p in PROMPTS[:2]:  # round robin: one on each
            r = httpx.post(url + "/v1/completions", headers=headers, timeout=60, json={
                "model": "m", "prompt": p, "max_tokens": 4, "temperature": 0})
            assert r.status_code == 200, r.text
        assert dp.replicas[1].computed_prefill_tokens > 0
        r = httpx.post(url + "/scale_elastic_ep", headers=headers, timeout=120,
                       json={"new_data_parallel_size": 1})
        assert r.status_code == 200 and [x.index for x in dp.routable] == [0]
        assert httpx.post(url + "/is_scaling_elastic_ep", headers=headers).json() == {
            "is_scaling_elastic_ep": False}
        assert httpx.get(url + "/health").json() == {"status": "ok"}
