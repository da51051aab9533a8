"""Prometheus metrics, named after vLLM's (``vllm:`` -> ``pagedllm:``) so dashboards carry over.

Engine state (queue lengths, KV usage, prefix-cache and preemption counters) is read at scrape
time by a custom collector, so it is always current, even when the engine is idle. Token counts
and latencies are observed by the engine thread from the ``RequestOutput`` deltas.

Every app gets its own ``CollectorRegistry``: several servers in one process do not clash.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pagedllm.engine import LLMEngine
    from pagedllm.outputs import RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)


class _EngineStateCollector(Collector):
    """Reads the engine's own counters at scrape time (plain int/float reads: safe off-thread)."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        e, labels = self.engine, [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        sched = e.scheduler
        yield gauge("pagedllm:num_requests_running", "Sequences in the running batch.", sched.num_running)
        yield gauge("pagedllm:num_requests_waiting", "Sequences waiting to be scheduled.", sched.num_waiting)
        yield gauge("pagedllm:num_requests_swapped", "Sequences swapped out to the host tier.",
                    sched.num_swapped)
        yield gauge("pagedllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", e.kv.usage)
        yield counter("pagedllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      e.kv.stats.queries)
        yield counter("pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", e.kv.stats.hits)
        yield counter("pagedllm:num_preemptions", "Preemptions since start-up.", e.num_preemptions)


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class ServerMetrics:
    """Counters and histograms of one server. ``on_*`` hooks run on the engine thread."""

    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lab = self.registry, ["model_name"]
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prefilled prompt tokens.", lab, registry=r)
        self.generation_tokens = Counter("pagedllm:generation_tokens", "Generated tokens.", lab, registry=r)
        self.request_success = Counter("pagedllm:request_success", "Finished requests by reason.",
                                       ["model_name", "finished_reason"], registry=r)
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pagedllm:inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds", "Arrival to last token.", lab,
                             buckets=E2E_BUCKETS, registry=r)
        self.registry.register(_EngineStateCollector(engine, model_name))
        self._live: dict[str, _Timing] = {}

    def on_add(self, request_id: str, arrival: float) -> None:
        self._live[request_id] = _Timing(arrival)

    def on_abort(self, request_id: str) -> None:
        self._live.pop(request_id, None)

    def on_outputs(self, outputs: Iterator[RequestOutput] | list[RequestOutput], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        m = self.model_name
        for out in outputs:
            t = self._live.get(out.request_id)
            if t is None:
                continue
            new = sum(len(c.token_ids) for c in out.outputs)  # the server's outputs are deltas
            if new > 0:
                if t.last_token is None:
                    self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
                    self.ttft.labels(m).observe(now - t.arrival)
                else:
                    self.itl.labels(m).observe(now - t.last_token)
                self.generation_tokens.labels(m).inc(new)
                t.last_token = now
            for c in out.outputs:  # a sequence's finish reason comes once, in its last delta
                if c.finish_reason is not None:
                    self.request_success.labels(m, c.finish_reason).inc()
            if out.finished:
                self.e2e.labels(m).observe(now - t.arrival)
                del self._live[out.request_id]

    def render(self) -> bytes:
        return generate_latest(self.registry)
