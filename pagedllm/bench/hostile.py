"""Hostile rounds for ``bench soak``: bursts of the input that once left a server holding memory.

One round sends, at once:

- 1 MB prompts: a completion, a chat message and ``/tokenize`` (each tokenized on the engine
  thread: ~500,000 tokens; the first two are refused 400, ``/tokenize`` answers them), a prompt of
  ~500,000 token ids, and a body over ``--max-request-bytes``;
- ``QUEUED`` sequences queued and dropped: requests of n=16 whose clients hang up (non-streamed
  ones given up on after a moment, streamed ones closed after their first chunk);
- every bad body of the soak's ``INVALID`` list.

then waits until the server is idle (no request running or waiting) and ``settle_s`` more, and
samples its RSS (the server's and its engine core's: both processes release on their own idle
clock, and a busy machine delays them). A server that gives its freed memory back when idle (``_malloc.IdleRelease``)
shows the same idle RSS after every round; one that keeps it shows a jump after the first round
and a creep after each later one (issue 35: 438 MB to 1.09 GB, then +7 to +11 MB per round).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from pagedllm._malloc import IDLE_RELEASE_S

MB = 1_000_000
QUEUED = 960  # sequences queued then dropped, per round
N = 16  # sequences per request (the server's default --max-n)


async def _post(client: Any, path: str, timeout: float | None = None, stream: bool = False,
                **kw: Any) -> str:
    """The status of one request as a string; "hung up" where the client gave up on purpose."""
    import httpx

    try:
        if stream:
            async with client.stream("POST", path, **kw) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # the first chunk: hang up
                return str(r.status_code)
        r = await asyncio.wait_for(client.post(path, **kw), timeout)
        return str(r.status_code)
    except asyncio.TimeoutError:
        return "hung up"
    except httpx.HTTPError as e:
        return type(e).__name__


async def one_round(client: Any, round_no: int, invalid: list[bytes]) -> Counter[str]:
    """Send one round; the count of each status (5xx must stay 0)."""
    text = "x " * (MB // 2 - 8)  # ~1 MB, ~500,000 tokens of the shipped tokenizer
    ids = b'{"max_tokens": 4, "prompt": [' + b",".join([b"1"] * (MB // 2 - 32)) + b"]}"  # ~1 MB
    json_ct = {"Content-Type": "application/json"}
    calls = [
        _post(client, "/v1/completions", json={"prompt": text + str(round_no), "max_tokens": 4}),
        _post(client, "/v1/chat/completions",
              json={"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
        _post(client, "/tokenize", json={"prompt": text}),
        _post(client, "/v1/completions", content=ids, headers=json_ct),
        _post(client, "/v1/completions", content=b'{"prompt": "' + b"y" * (2 * MB) + b'"}',
              headers=json_ct),
    ]
    for i in range(QUEUED // N):
        body = {"prompt": f"def f{round_no}_{i}(", "n": N, "max_tokens": 64, "temperature": 1.0}
        if i % 2:
            calls.append(_post(client, "/v1/completions", stream=True, json={**body, "stream": True}))
        else:
            calls.append(_post(client, "/v1/completions", timeout=1.0 + 0.02 * i, json=body))
    calls += [_post(client, "/v1/completions", content=b, headers=json_ct) for b in invalid]
    return Counter(await asyncio.gather(*calls))


IDLE_SAMPLES = 4  # idle RSS samples, 1 s apart, after the settle time


async def _wait_idle(client: Any, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = 0.0
        for line in (await client.get("/metrics")).text.splitlines():
            if line.startswith(("pagedllm:num_requests_running", "pagedllm:num_requests_waiting")):
                busy += float(line.rsplit(" ", 1)[1])
        if busy == 0:
            return
        await asyncio.sleep(0.2)


async def run_rounds(base: str, rounds: int, rss: Callable[[], float | None], invalid: list[bytes],
                     settle_s: float = IDLE_RELEASE_S + 4.0) -> list[dict[str, Any]]:
    """``rounds`` hostile rounds; per round its statuses, seconds, peak RSS while it ran and RSS
    once idle (MiB)."""
    import httpx

    out: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=QUEUED // N + len(invalid) + 16)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
        for r in range(rounds):
            t0 = time.monotonic()
            peak = [rss() or 0.0]

            async def sample(peak: list[float] = peak) -> None:
                while True:
                    peak[0] = max(peak[0], rss() or 0.0)
                    await asyncio.sleep(0.25)

            sampler = asyncio.ensure_future(sample())
            try:
                statuses = await one_round(client, r, invalid)
                await _wait_idle(client)
            finally:
                sampler.cancel()
            seconds = time.monotonic() - t0
            await asyncio.sleep(settle_s)
            idle = []  # what the server keeps: the lowest of a few samples (a busy machine
            for _ in range(IDLE_SAMPLES):  # may run a process's idle release a little late)
                idle.append(rss())
                await asyncio.sleep(1.0)
            kept = min((x for x in idle if x is not None), default=None)
            out.append({"round": r + 1, "seconds": round(seconds, 1), "statuses": dict(statuses),
                        "rss_peak_mib": round(peak[0], 1), "rss_idle_mib": kept})
    return out


def summarize_rounds(rounds: list[dict[str, Any]], before: float | None) -> dict[str, Any]:
    """Idle RSS before the rounds and after each. Two figures judge it: the highest idle RSS over
    the one before the rounds (a server that keeps a burst's memory doubles here), and the creep
    per round after the first (warm-up) round. A leak adds in every round, so the creep is the
    lower of two estimates that a leak both raises: the median of the rises from one round's idle
    RSS to the next's, which ignores one late growth (an allocator arena, a cache filled once: CI
    saw 880 -> 911 -> 913 MiB), and the median of the slopes between every two rounds
    (Theil-Sen), which ignores idle RSS that goes up and down (CI saw 931 -> 943 -> 915 -> 936:
    rises 12, -28, 20, median 16; slopes' median -1), and the rise of the floor: the lowest idle
    RSS of the later half of the rounds over the lowest of the earlier half, per round between
    them. A leak lifts every round's idle RSS, the lowest too; a wobble of one arena taken and
    given back in alternate rounds does not (CI saw 897 -> 942 -> 900 -> 941: rises' median 41,
    slopes' 8, the floor 897 -> 900, 1.5 per round)."""
    idle = [r["rss_idle_mib"] for r in rounds if r["rss_idle_mib"] is not None]
    over = None if before is None or not idle else 100.0 * (max(idle) - before) / before
    rises = [b - a for a, b in zip(idle[1:], idle[2:])]
    slopes = [(idle[j] - idle[i]) / (j - i) for i in range(1, len(idle))
              for j in range(i + 1, len(idle))]
    after = idle[1:]  # past the warm-up round
    half = len(after) // 2
    # the floor's rise: the lowest idle RSS of the later rounds over that of the earlier ones
    floor = (min(after[-half:]) - min(after[:half])) / (len(after) - half) if half else None
    creep = min(statistics.median(rises), statistics.median(slopes),
                floor if floor is not None else float("inf")) if rises else None
    return {"rounds": rounds, "rss_before_mib": before, "rss_idle_mib": idle,
            "rss_idle_over_before_pct": over, "rss_creep_mib_per_round": creep,
            "server_errors": sum(n for r in rounds for s, n in r["statuses"].items()
                                 if s.isdigit() and int(s) >= 500)}
