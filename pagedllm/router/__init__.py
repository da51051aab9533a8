"""Data-parallel serving: N engine-core replicas behind one front end (``DPClient``), each
request routed by a policy fed by the replicas' KV events (``policy``, ``prefix_index``)."""

from pagedllm.router.policy import IMBALANCE_THRESHOLD, ROUTING_POLICIES, make_policy

__all__ = ["IMBALANCE_THRESHOLD", "ROUTING_POLICIES", "make_policy"]
