"""The front end's idle release (``FrontEndIdle``): it waits until the engine is idle AND the
front end's own work (HTTP bodies, tokenizer jobs: ``Activity``) has ended and stood still for
``after_s``, then gives freed memory back once per idle spell. Issue 35's soak found a release
that fired while 1 MB prompts were still being tokenized."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagedllm._malloc import IdleRelease
from pagedllm.engine import client_mp
from pagedllm.engine.activity import Activity


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def monotonic(self) -> float:
        return self.t


class _Client:
    def __init__(self) -> None:
        self.activity = Activity()
        self.engine_idle = True

    def is_idle(self) -> bool:
        return self.engine_idle


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(client_mp, "time", SimpleNamespace(monotonic=c.monotonic))
    return c


def _watch(client: _Client) -> tuple[client_mp.FrontEndIdle, list[int]]:
    released: list[int] = []
    idle = client_mp.FrontEndIdle(client)  # type: ignore[arg-type]
    idle.release = IdleRelease(after_s=5.0, release=lambda: released.append(1))
    return idle, released


def test_activity_counts_jobs_in_flight_and_moves_its_epoch() -> None:
    a = Activity()
    with a():
        assert (a.in_flight, a.epoch) == (1, 1)
        with a():
            assert a.in_flight == 2
    assert (a.in_flight, a.epoch) == (0, 4)
    with pytest.raises(RuntimeError), a():  # a job that fails still ends
        raise RuntimeError("refused")
    assert (a.in_flight, a.epoch) == (0, 6)


def test_no_release_while_a_job_is_in_flight_then_one_after_it_ends(clock: _Clock) -> None:
    client = _Client()
    idle, released = _watch(client)

    async def run() -> None:
        job = client.activity()
        job.__enter__()  # a 1 MB prompt being tokenized, the engine idle
        for _ in range(4):
            await idle.tick()
            clock.t += 10.0  # long past after_s: the job is still in flight
        assert released == []
        job.__exit__(None, None, None)
        await idle.tick()  # its end is work: the clock starts again from here
        clock.t += 4.0
        await idle.tick()
        assert released == []
        clock.t += 1.5
        await idle.tick()
        assert released == [1]
        clock.t += 60.0
        await idle.tick()
        assert released == [1]  # once per idle spell

    asyncio.run(run())


def test_a_job_that_starts_and_ends_between_ticks_still_counts_as_work(clock: _Clock) -> None:
    client = _Client()
    idle, released = _watch(client)

    async def run() -> None:
        with client.activity():
            pass
        await idle.tick()
        clock.t += 6.0
        await idle.tick()
        assert released == [1]
        with client.activity():  # a new burst, seen only by its epoch
            pass
        client.engine_idle = False  # and the engine busy for a while
        await idle.tick()
        clock.t += 30.0
        await idle.tick()
        assert released == [1]
        client.engine_idle = True
        await idle.tick()
        clock.t += 5.0
        await idle.tick()
        assert released == [1, 1]

    asyncio.run(run())
