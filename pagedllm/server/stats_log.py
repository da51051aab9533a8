"""The server's periodic engine line, as vLLM logs it: every ``interval`` seconds, the prompt and
generation throughput since the last line, running / waiting / swapped sequences, KV cache usage
and the prefix cache hit rate of the interval. ``pagedllm serve`` logs it every 10 s;
``--disable-log-stats`` turns it off.

It reads what the Prometheus metrics read: each step's record as the engine client receives it
(``on_step``, a listener of the client: the tokens) and the client's latest record (the queues
and the KV pool, current even when the engine is idle). A server that stays idle logs one line
saying so, then nothing until work arrives.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagedllm.logging_utils import init_logger

if TYPE_CHECKING:
    from pagedllm.engine.client import EngineClient
    from pagedllm.sched.stats import StepStats

logger = init_logger(__name__)


class StatsLogger:
    def __init__(self, client: EngineClient, interval: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.interval = interval
        self.clock = clock
        self._prompt = self._generation = 0  # tokens since the last line
        self._last = clock()
        s = client.stats
        self._queries, self._hits = s.prefix_cache_queries, s.prefix_cache_hits
        self._was_idle = False
        client.stats_listeners.append(self.on_step)

    def on_step(self, stats: StepStats, engine: int = 0) -> None:
        """A step's record from engine (replica) ``engine``: all replicas add up."""
        self._prompt += stats.num_prompt_tokens
        self._generation += stats.num_generation_tokens

    def line(self) -> str | None:
        """The line for the interval that ends now (and start the next), or None when this
        interval and the one before were idle (no tokens, nothing running or waiting)."""
        now = self.clock()
        dt = max(now - self._last, 1e-9)
        s = self.client.stats
        # the counters run since start-up (or the last prefix cache reset: then from zero)
        queries = max(s.prefix_cache_queries - self._queries, 0)
        hits = max(s.prefix_cache_hits - self._hits, 0)
        idle = not (self._prompt or self._generation or s.num_running or s.num_waiting
                    or s.num_swapped)
        text = (f"engine: prompt {self._prompt / dt:.1f} tok/s, generation "
                f"{self._generation / dt:.1f} tok/s; running {s.num_running}, waiting "
                f"{s.num_waiting}, swapped {s.num_swapped} reqs; KV cache usage "
                f"{100 * s.kv.used / max(s.kv.total, 1):.1f}% ({s.kv.used}/{s.kv.total} blocks); "
                f"prefix cache hit rate {100 * hits / queries if queries else 0.0:.1f}%")
        skip = idle and self._was_idle
        self._last, self._prompt, self._generation = now, 0, 0
        self._queries, self._hits = s.prefix_cache_queries, s.prefix_cache_hits
        self._was_idle = idle
        return None if skip else text

    async def run(self) -> None:
        """Log a line every ``interval`` seconds until cancelled (the first interval starts
        here, once the engine is up)."""
        self._last, self._prompt, self._generation = self.clock(), 0, 0
        while True:
            await asyncio.sleep(self.interval)
            text = self.line()
            if text is not None:
                logger.info(text)
