"""``join_ray`` keeps the process's SIGINT/SIGTERM handlers (ray.init replaces them with its
own, which end the process at once: an engine core would die on the SIGTERM its front end
leaves to drain). A stand-in ``ray`` module, so no cluster starts."""

from __future__ import annotations

import signal
import sys
from types import SimpleNamespace

import pytest

from pagedllm.distributed.ray_init import join_ray


def test_join_ray_keeps_the_signal_handlers(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_init(**kwargs: object) -> None:
        calls.append(kwargs)
        signal.signal(signal.SIGTERM, lambda *a: sys.exit(15))  # what ray.init does
        signal.signal(signal.SIGINT, lambda *a: sys.exit(2))

    fake = SimpleNamespace(is_initialized=lambda: bool(calls), init=fake_init)
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # an engine core's
        join_ray(log_to_driver=True)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is before[signal.SIGINT]
        assert calls == [{"address": "10.0.0.1:6379", "include_dashboard": False,
                          "log_to_driver": True}]
        join_ray()  # initialised already: no second init
        assert len(calls) == 1
    finally:
        for s, h in before.items():
            signal.signal(s, h)
