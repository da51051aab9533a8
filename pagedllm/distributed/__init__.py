"""Tensor parallelism over torch.distributed (gloo on CPU).

    LLM(model=..., tensor_parallel_size=2)                       worker processes (spawn)
    LLM(model=..., tensor_parallel_size=2, distributed_executor_backend="ray")   Ray actors
    pagedllm generate|serve --tensor-parallel-size 2 [--distributed-executor-backend ray]

Map:
    group.py    TPGroup (rank, size, all-reduce, counters) and the sharding arithmetic: which
                heads / rows / columns each rank owns (Megatron-style; embeddings and lm_head
                replicated, so rank 0 has full logits and samples alone)
    worker.py   the loop of ranks 1..N-1: ModelRunner method calls from rank 0 (``collective_rpc``)
    ../executor/  UniProcExecutor (TP=1, unchanged), MultiprocExecutor, RayExecutor

The scheduler and the block manager run once, in the engine process, which is also rank 0. Each
step rank 0 sends every worker the step's KV changes (copy-on-write, swap, compaction, resize:
``ModelInput.kv``) and the prepared host batch (token ids, positions, slot mapping, block
tables: one block table for all ranks) as one ``run_step`` call, then all ranks apply the changes
and run the forward; each rank's KV cache holds only its KV heads under the same block ids. A script that starts a tensor-parallel engine must do so under
``if __name__ == "__main__":`` (workers are spawned and re-import the main module).

Multi-node with Ray (manual procedure; the local case is tested):
    1. ``pip install 'pagedllm[ray]'`` on every node, and put the checkpoint at the same path on
       every node (each rank reads its own slices of it).
    2. Head node: ``ray start --head --port 6379``; every other node:
       ``ray start --address HEAD_IP:6379``.
    3. On the head node: ``RAY_ADDRESS=HEAD_IP:6379 pagedllm serve MODEL --tensor-parallel-size N
       --distributed-executor-backend ray``. Rank 0 runs there; Ray places ranks 1..N-1 (one CPU
       per worker thread). The nodes must reach each other on arbitrary TCP ports (rank 0's
       TCPStore and message listener, gloo's pairwise connections).
    4. Check: the start-up log line "tensor parallel: N ranks (ray backend): rank 1 (Ray actor,
       pid ... on NODE_IP) ..." names where each rank runs.
"""

from pagedllm.distributed.group import CommStats, TPGroup, check_tp_size, shard_heads

__all__ = ["CommStats", "TPGroup", "check_tp_size", "shard_heads"]
