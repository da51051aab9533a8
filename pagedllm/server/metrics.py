"""Prometheus metrics, named after vLLM's (``vllm:`` -> ``pagedllm:``) so dashboards carry over.

Everything comes from the engine core's per-step records (``pagedllm.sched.stats.StepStats``),
as its client receives them: the gauges and engine counters from the latest record at scrape time
(the core sends a fresh one when an abort changes its state outside a step, so an idle engine
reads true), the token counters and latency histograms from each step's record as it arrives
(``on_step``, a listener of the client).

Every series carries ``engine="i"``, the engine core (data-parallel replica) it counts, as
vLLM's do: one core is ``engine="0"``; with ``--data-parallel-size N`` each replica has its own
series (sum over ``engine`` for the server's total).

Every app gets its own ``CollectorRegistry``: several servers in one process do not clash.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pagedllm.engine.client import EngineClient
    from pagedllm.sched.stats import StepStats

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
LABELS = ["model_name", "engine"]
LORA_INFO = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0)


class _EngineStateCollector(Collector):
    """Reads the engine core's latest record at scrape time (held by the client)."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        # the latest record of each engine core, replaced whole as the core sends one
        records = self.client.engine_stats()

        def family(kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str,
                   value: Callable[[StepStats], float]) -> Metric:
            m = kind(name, doc, labels=LABELS)
            for i, s in records:
                m.add_metric([self.model_name, str(i)], value(s))
            return m

        G, C = GaugeMetricFamily, CounterMetricFamily
        yield family(G, "pagedllm:num_requests_running", "Sequences in the running batch.",
                     lambda s: s.num_running)
        yield family(G, "pagedllm:num_requests_waiting", "Sequences waiting to be scheduled.",
                     lambda s: s.num_waiting)
        yield family(G, "pagedllm:num_requests_swapped", "Sequences swapped out to the host tier.",
                     lambda s: s.num_swapped)
        yield family(G, "pagedllm:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).",
                     lambda s: s.kv.used / s.kv.total if s.kv.total else 0.0)
        yield family(C, "pagedllm:prefix_cache_queries",
                     "Prompt tokens looked up in the prefix cache.", lambda s: s.prefix_cache_queries)
        yield family(C, "pagedllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                     lambda s: s.prefix_cache_hits)
        if self.client.config.cache.kv_transfer is not None:  # vLLM's names for the KV tier's
            yield family(C, "pagedllm:external_prefix_cache_queries",
                         "Prompt tokens looked up in the KV tier shared by replicas.",
                         lambda s: s.external_prefix_cache_queries)
            yield family(C, "pagedllm:external_prefix_cache_hits",
                         "Prompt tokens loaded from the KV tier instead of computed.",
                         lambda s: s.external_prefix_cache_hits)
            yield family(C, "pagedllm:kv_tier_bytes_loaded", "KV bytes loaded from the tier.",
                         lambda s: s.kv_tier_bytes_loaded)
            yield family(C, "pagedllm:kv_tier_bytes_stored", "KV bytes stored in the tier.",
                         lambda s: s.kv_tier_bytes_stored)
        yield family(C, "pagedllm:num_preemptions", "Preemptions since start-up.",
                     lambda s: s.num_preemptions)
        lora = self.client.config.lora
        if lora is not None:  # vLLM's: the adapters as labels, the value the scrape's time
            m = GaugeMetricFamily("pagedllm:lora_requests_info", "The LoRA adapters of the running "
                                  "and the waiting requests.", labels=[*LORA_INFO, "engine"])
            for i, s in records:
                m.add_metric([str(lora.max_loras), ",".join(s.waiting_loras),
                              ",".join(s.running_loras), str(i)], time.time())
            yield m
        if self.client.config.speculative is not None:  # speculative decoding (vLLM's names)
            yield family(C, "pagedllm:spec_decode_num_drafts", "Verifications of proposed tokens.",
                         lambda s: s.spec_total.num_drafts)
            yield family(C, "pagedllm:spec_decode_num_draft_tokens", "Proposed tokens verified.",
                         lambda s: s.spec_total.num_draft_tokens)
            yield family(C, "pagedllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.",
                         lambda s: s.spec_total.num_accepted_tokens)


class ServerMetrics:
    """Counters and histograms of one server; ``on_step`` runs as each step's record arrives."""

    def __init__(self, client: EngineClient, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, lab = self.registry, LABELS
        self.prompt_tokens = Counter("pagedllm:prompt_tokens", "Prefilled prompt tokens.", lab, registry=r)
        self.computed_prefill_tokens = Counter(
            "pagedllm:computed_prefill_tokens", "Prompt positions computed (the prompt tokens "
            "less the prefix-cache hits, plus recomputation after preemption).", lab, registry=r)
        self.generation_tokens = Counter("pagedllm:generation_tokens", "Generated tokens.", lab, registry=r)
        self.request_success = Counter("pagedllm:request_success", "Finished requests by reason.",
                                       [*LABELS, "finished_reason"], registry=r)
        self.ttft = Histogram("pagedllm:time_to_first_token_seconds", "Time to first token.", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("pagedllm:inter_token_latency_seconds", "Time between output tokens.", lab,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("pagedllm:e2e_request_latency_seconds", "Arrival to last token.", lab,
                             buckets=E2E_BUCKETS, registry=r)
        lora_lab = ["model_name", "lora_name"]
        self.lora_requests = Counter("pagedllm:lora_requests", "Requests (one per prompt) run by "
                                     "each LoRA adapter.", lora_lab, registry=r)
        self.lora_generation_tokens = Counter("pagedllm:lora_generation_tokens",
                                              "Tokens generated by each LoRA adapter.", lora_lab,
                                              registry=r)
        self.lora_ttft = Histogram("pagedllm:lora_time_to_first_token_seconds", "Time to first "
                                   "token, by LoRA adapter.", lora_lab, buckets=TTFT_BUCKETS, registry=r)
        self.lora_itl = Histogram("pagedllm:lora_inter_token_latency_seconds", "Time between "
                                  "output tokens, by LoRA adapter.", lora_lab, buckets=ITL_BUCKETS,
                                  registry=r)
        self.lora_e2e = Histogram("pagedllm:lora_e2e_request_latency_seconds", "Arrival to last "
                                  "token, by LoRA adapter.", lora_lab, buckets=E2E_BUCKETS, registry=r)
        self.registry.register(_EngineStateCollector(client, model_name))

    def count_lora(self, lora_name: str | None, n: int) -> None:
        """``n`` requests accepted for adapter ``lora_name`` (None: the base, not counted)."""
        if lora_name is not None:
            self.lora_requests.labels(self.model_name, lora_name).inc(n)

    def on_step(self, stats: StepStats, engine: int = 0) -> None:
        """Count one step's tokens and observe its latencies (of engine core ``engine``)."""
        m, e = self.model_name, str(engine)
        self.prompt_tokens.labels(m, e).inc(stats.num_prompt_tokens)
        self.computed_prefill_tokens.labels(m, e).inc(stats.num_prefill_tokens)
        self.generation_tokens.labels(m, e).inc(stats.num_generation_tokens)
        for hist, values in ((self.ttft, stats.time_to_first_token_s),
                             (self.itl, stats.inter_token_latency_s),
                             (self.e2e, stats.e2e_latency_s)):
            for v in values:
                hist.labels(m, e).observe(v)
        for reason in stats.finish_reasons:
            self.request_success.labels(m, e, reason).inc()
        for name, n in stats.lora_generation_tokens.items():
            self.lora_generation_tokens.labels(m, name).inc(n)
        for hist, pairs in ((self.lora_ttft, stats.lora_ttft_s), (self.lora_itl, stats.lora_itl_s),
                            (self.lora_e2e, stats.lora_e2e_latency_s)):
            for name, v in pairs:
                hist.labels(m, name).observe(v)

    def render(self) -> bytes:
        return generate_latest(self.registry)
