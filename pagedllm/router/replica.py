"""One replica behind the data-parallel client (``router.client.DPClient``): its link to an engine
core (a process here, or a Ray actor), its latest step record, the requests routed to it, and
where it stands (serving, draining, down, removed)."""

from __future__ import annotations

from typing import NamedTuple

from pagedllm.args import EngineArgs
from pagedllm.engine.core_link import CoreLink, ProcessLink
from pagedllm.engine.core_proc import CoreOptions
from pagedllm.engine.messages import EngineCoreRequest
from pagedllm.sched.stats import StepStats


class Replica:
    """One engine core behind the client."""

    def __init__(self, index: int, link: CoreLink) -> None:
        self.index = index
        self.link = link
        self.stats = StepStats()  # its latest record
        self.dead: str | None = None  # why it left routing
        self.requests: set[str] = set()  # routed here and not finished
        self.computed_prefill_tokens = 0  # prompt positions its steps computed
        self.draining = False  # out of routing, finishing what it has (``remove_replica``)
        self.removed = False  # taken out on purpose (not "down" for ``degraded``)

    @property
    def kv_usage(self) -> float:
        kv = self.stats.kv
        return kv.used / kv.total if kv.total else 0.0


class Route(NamedTuple):
    replica: int
    hashes: list[str]
    request: EngineCoreRequest | None  # to send again if its replica dies; None once streamed


def make_link(engine_args: EngineArgs, backend: str, options: CoreOptions) -> CoreLink:
    """The link to a new engine core: a process on this machine (``mp``) or a Ray actor."""
    if backend == "ray":
        from pagedllm.router.ray_link import RayLink

        return RayLink(engine_args, options)
    return ProcessLink(engine_args, options,
                       name=f"pagedllm-engine-core-{options.data_parallel_rank}")
