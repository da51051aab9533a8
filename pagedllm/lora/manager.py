"""Adapter weights on the device, in three places:

    pages   the resident adapters, in blocks of the KV pool (kv/adapters.py decides which;
            lora/pages.py lays them out): they compete with the KV cache for one pool
    slots   ``max_loras`` compute slots per linear layer, stacked for the batched ops
            (lora/ops.py): the step's adapters, copied from their pages on a miss
    host    an LRU cache of ``max_cpu_loras`` loaded adapters (then the adapter's files):
            where a paged-out adapter is paged in from

    add(req)            load + check the adapter now (errors before any engine state changes)
    apply_paging        the step's ``lora_evictions`` / ``lora_loads`` (sched/output.py)
    prepare(step)       the step's adapters into slots (LRU over slots not used by this step;
                        the scheduler admits at most max_loras per step), token -> slot indices
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from pagedllm.layers.linear import RowParallelLinear, gemm_dtypes
from pagedllm.lora.adapter import SUPPORTED, LoRAError, LoRAWeights, load_adapter
from pagedllm.lora.ops import DENSE_MAX_TOKENS, LoRAMapping, LoRAStack
from pagedllm.lora.pages import PageLayout, layer_of, pack, page_layout, unpack
from pagedllm.lora.request import LoRAConfig, LoRARequest
from pagedllm.models.base import CausalLM


class LoRAManager:
    def __init__(self, model: CausalLM, config: LoRAConfig, device: torch.device,
                 method: str | None = None) -> None:
        """``method``: force "dense", "loop", "gather" or "triton" (lora/ops.py); None picks
        "triton" on CUDA, else by step size."""
        self.model, self.config, self.method = model, config, method
        # the model's dtype: the slots', the pages' and the one-hot mask's
        self.dtype = dtype = next(iter(model.parameters())).dtype
        s, r = config.max_loras, config.max_lora_rank
        fused = type(model).FUSED_WEIGHTS
        names = {fused.get(p, (p, 0))[0] for p in SUPPORTED}
        self.stacks: dict[torch.nn.Module, LoRAStack] = {}  # keyed by the linear itself
        self.modules: dict[str, torch.nn.Module] = {}
        for name, m in model.named_modules():
            if name.rpartition(".")[2] in names and isinstance(m, torch.nn.Linear):
                sizes = list(getattr(m, "output_sizes", [m.out_features]))
                a = torch.zeros(s + 1, len(sizes) * r, m.in_features, dtype=dtype, device=device)
                b = [torch.zeros(s + 1, o, r, dtype=dtype, device=device) for o in sizes]
                offsets = [sum(sizes[:j]) for j in range(len(sizes))]
                b_flat = [torch.zeros(s * r, o, dtype=dtype, device=device) for o in sizes]
                reduce = m.tp.all_reduce if isinstance(m, RowParallelLinear) else None
                self.stacks[m] = LoRAStack(a, b, offsets, r, b_flat, reduce)
                self.modules[name] = m
        self.known: dict[int, LoRARequest] = {}
        self.cpu: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU, most recent last
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU
        self.slot_targets: list[frozenset[torch.nn.Module]] = [frozenset()] * s
        self.device = device
        self.layouts: dict[int, PageLayout] = {}  # every known adapter's layout in its pages
        self.num_layers = 1 + max(map(layer_of, self.modules))  # every layer has the targets
        self.num_slot_loads = 0  # adapters copied from their pages into a slot
        # the dense method's GEMMs on pagedllm's packed GEMM where it runs this dtype
        self._gemm = device.type == "cpu" and dtype in gemm_dtypes()
        self._repack = False
        self.num_page_loads = 0  # adapters written into pages (from the host tier)
        self.page_bytes_loaded = 0
        self.paging_s = 0.0  # time spent paging in, copying pages into slots, repacking slots

    @property
    def graphable(self) -> bool:
        """Whether decode graphs can record the deltas (runner/cuda_graph.py): a method that
        reads no host data per step, i.e. not one forced to "dense" or "loop"."""
        return self.method in (None, "triton", "gather") and all(
            st.reduce is None for st in self.stacks.values())

    @property
    def base_slot(self) -> int:
        return self.config.max_loras

    def add(self, req: LoRARequest, page_bytes: int, pool_blocks: int) -> int:
        """Load and check ``req``'s adapter into the host cache: the KV blocks it takes when
        paged in (``page_bytes``: one block's bytes in one layer). Raises ``LoRAError`` (the
        manager unchanged but for the host cache) for one that cannot run, does not fit a pool
        of ``pool_blocks``, or reuses another adapter's id."""
        old = self.known.get(req.lora_int_id)
        if old is not None and (old.lora_path, old.lora_name) != (req.lora_path, req.lora_name):
            raise LoRAError(f"LoRA adapter {req.lora_name!r}: lora_int_id={req.lora_int_id} is "
                            f"already adapter {old.lora_name!r} ({old.lora_path}); give each "
                            "adapter its own id")
        layout = page_layout(self._host_weights(req), self.dtype)
        n = layout.num_pages(page_bytes)
        if n > pool_blocks:
            raise LoRAError(f"LoRA adapter {req.lora_name!r}: its weights take {n} KV blocks "
                            f"({layout.layer_bytes} bytes in a layer, {page_bytes} per block), "
                            f"the pool has {pool_blocks}; give the KV cache more memory")
        self.known[req.lora_int_id] = req
        self.layouts[req.lora_int_id] = layout
        return n

    def apply_paging(self, evictions: list[int], loads: list[tuple[int, list[int]]],
                     page_bytes: int, write: Callable[[list[int], torch.Tensor], None]) -> None:
        """A step's adapters paged out of the pool (their slots, copies of their pages, are free
        again), then in: each one's weights (from the host tier) written into its fresh blocks
        with ``write`` (the runner's ``KVCache.write_pages``: the runner owns the KV tensors)."""
        for lora_id in evictions:
            slot = self.slot_of.pop(lora_id, None)
            if slot is not None:
                self.slot_targets[slot] = frozenset()
        for lora_id, blocks in loads:
            t0 = time.perf_counter()
            w = self._host_weights(self.known[lora_id])
            data = pack(w, self.layouts[lora_id], self.num_layers, len(blocks), page_bytes)
            write(blocks, data)
            self.num_page_loads += 1
            self.page_bytes_loaded += data.numel()
            self.paging_s += time.perf_counter() - t0

    def _host_weights(self, req: LoRARequest) -> LoRAWeights:
        w = self.cpu.get(req.lora_int_id)
        if w is None:
            w = load_adapter(req, self.model, self.config.max_lora_rank)
            self.cpu[req.lora_int_id] = w
            while len(self.cpu) > self.config.cpu_capacity:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(req.lora_int_id)
        return w

    def prepare(self, loras: Sequence[LoRARequest | None], q_lens: Sequence[int],
                pages: dict[int, list[int]], read: Callable[[list[int]], torch.Tensor],
                ) -> LoRAMapping | None:
        """The mapping of a step whose requests (in batch order) run ``loras`` over ``q_lens``
        new tokens each, the adapters living in ``pages`` (after the step's KV changes; ``read``
        returns their bytes: ``KVCache.read_pages``); None if none runs an adapter."""
        wanted = list(dict.fromkeys(lr.lora_int_id for lr in loras if lr is not None))
        if not wanted:
            return None
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step runs {len(wanted)} adapters, over max_loras="
                               f"{self.config.max_loras} (the scheduler's limit)")
        reqs = {lr.lora_int_id: lr for lr in loras if lr is not None}
        slot_of = {i: self._slot(reqs[i], wanted, pages[i], read) for i in wanted}
        per_req = [self.base_slot if lr is None else slot_of[lr.lora_int_id] for lr in loras]
        token_slots = torch.repeat_interleave(torch.tensor(per_req), torch.tensor(list(q_lens)))
        dense = len(token_slots) <= DENSE_MAX_TOKENS or (
            self._gemm and 2 * len(slot_of) >= self.base_slot)
        method = self.method or ("triton" if self.device.type == "cuda" else
                                 "dense" if dense else "loop")
        groups = [(s, (token_slots == s).nonzero().flatten().to(self.device), self.slot_targets[s])
                  for s in slot_of.values()] if method == "loop" else []  # only "loop" reads them
        targeted = frozenset().union(*(self.slot_targets[s] for s in slot_of.values()))
        if method == "dense" and self._repack:  # slots changed: repack them for the GEMM
            t0 = time.perf_counter()
            for stack in self.stacks.values():
                stack.pack(self.base_slot)
            self._repack = False
            self.paging_s += time.perf_counter() - t0
        onehot = None
        if method == "dense":
            onehot = torch.nn.functional.one_hot(token_slots, self.base_slot + 1)[:, :-1]
            onehot = onehot.to(self.dtype)
            onehot = onehot.unsqueeze(-1).to(self.device)  # [T, S, 1]: base tokens all zero
        return LoRAMapping(token_slots.to(self.device), groups, self.stacks, method, onehot,
                           targeted, token_slots)

    def _slot(self, req: LoRARequest, in_step: list[int], pages: list[int],
              read: Callable[[list[int]], torch.Tensor]) -> int:
        """``req``'s slot, copying it there from its ``pages`` (into a free slot or the least
        recently used one that this step does not use) if no slot holds it."""
        i = req.lora_int_id
        if i in self.slot_of:
            self.slot_of.move_to_end(i)
            return self.slot_of[i]
        used = set(self.slot_of.values())
        free = [s for s in range(self.config.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(v for v in self.slot_of if v not in in_step)
            slot = self.slot_of.pop(victim)
        t0 = time.perf_counter()
        layout = self.layouts[i]
        self._load(slot, LoRAWeights(req, layout.rank, unpack(read(pages), layout)))
        self.slot_of[i] = slot
        self.paging_s += time.perf_counter() - t0
        return slot

    def _load(self, slot: int, w: LoRAWeights) -> None:
        r = self.config.max_lora_rank
        for stack in self.stacks.values():
            stack.a[slot].zero_()
            for b in stack.b:
                b[slot].zero_()
            for bf in stack.b_flat:
                bf[slot * r:(slot + 1) * r].zero_()
        for (name, shard), (a, b) in w.targets.items():
            stack = self.stacks[self.modules[name]]
            stack.a[slot, shard * r:shard * r + w.rank].copy_(a)
            stack.b[shard][slot, :, :w.rank].copy_(b)
            stack.b_flat[shard][slot * r:slot * r + w.rank].copy_(b.t())
        self.slot_targets[slot] = frozenset(self.modules[name] for name, _ in w.targets)
        self.num_slot_loads += 1
        for stack in self.stacks.values():  # stale until repacked (prepare)
            stack.packed_a = stack.packed_b = None
        self._repack = self._gemm


__all__ = ["LoRAError", "LoRAManager"]
