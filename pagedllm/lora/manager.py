"""Adapter weights on the device: ``max_loras`` slots per linear layer, a host LRU cache of
``max_cpu_loras`` loaded adapters behind them, and the per-step ``LoRAMapping``.

    add(req)         load + check the adapter now (errors before any engine state changes)
    prepare(step)    the step's adapters into slots (LRU over slots not used by this step;
                     the scheduler admits at most max_loras per step), token -> slot indices
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from pagedllm.lora.adapter import SUPPORTED, LoRAError, LoRAWeights, load_adapter
from pagedllm.lora.ops import DENSE_MAX_TOKENS, LoRAMapping, LoRAStack
from pagedllm.lora.request import LoRAConfig, LoRARequest
from pagedllm.models.base import CausalLM


class LoRAManager:
    def __init__(self, model: CausalLM, config: LoRAConfig, device: torch.device,
                 method: str | None = None) -> None:
        """``method``: force "loop" or "gather" (lora/ops.py); None picks by step size."""
        self.model, self.config, self.method = model, config, method
        s, r = config.max_loras, config.max_lora_rank
        fused = type(model).FUSED_WEIGHTS
        names = {fused.get(p, (p, 0))[0] for p in SUPPORTED}
        self.stacks: dict[torch.nn.Module, LoRAStack] = {}  # keyed by the linear itself
        self.modules: dict[str, torch.nn.Module] = {}
        for name, m in model.named_modules():
            if name.rpartition(".")[2] in names and isinstance(m, torch.nn.Linear):
                sizes = list(getattr(m, "output_sizes", [m.out_features]))
                dtype = next(iter(model.parameters())).dtype
                a = torch.zeros(s + 1, len(sizes) * r, m.in_features, dtype=dtype, device=device)
                b = [torch.zeros(s + 1, o, r, dtype=dtype, device=device) for o in sizes]
                offsets = [sum(sizes[:j]) for j in range(len(sizes))]
                b_flat = [torch.zeros(s * r, o, dtype=dtype, device=device) for o in sizes]
                self.stacks[m] = LoRAStack(a, b, offsets, r, b_flat)
                self.modules[name] = m
        self.known: dict[int, LoRARequest] = {}
        self.cpu: OrderedDict[int, LoRAWeights] = OrderedDict()  # LRU, most recent last
        self.slot_of: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU
        self.slot_targets: list[frozenset[torch.nn.Module]] = [frozenset()] * s
        self.device = device
        self.num_slot_loads = 0  # adapters copied into a slot (the cost of paging them in)

    @property
    def base_slot(self) -> int:
        return self.config.max_loras

    def add(self, req: LoRARequest) -> None:
        """Load and check ``req``'s adapter into the host cache; raises ``LoRAError`` (the
        manager unchanged) for one that cannot run, or an id already used by another adapter."""
        old = self.known.get(req.lora_int_id)
        if old is not None and (old.lora_path, old.lora_name) != (req.lora_path, req.lora_name):
            raise LoRAError(f"LoRA adapter {req.lora_name!r}: lora_int_id={req.lora_int_id} is "
                            f"already adapter {old.lora_name!r} ({old.lora_path}); give each "
                            "adapter its own id")
        self._host_weights(req)
        self.known[req.lora_int_id] = req

    def _host_weights(self, req: LoRARequest) -> LoRAWeights:
        w = self.cpu.get(req.lora_int_id)
        if w is None:
            w = load_adapter(req, self.model, self.config.max_lora_rank)
            self.cpu[req.lora_int_id] = w
            while len(self.cpu) > self.config.cpu_capacity:
                self.cpu.popitem(last=False)
        self.cpu.move_to_end(req.lora_int_id)
        return w

    def prepare(self, loras: Sequence[LoRARequest | None], q_lens: Sequence[int]) -> LoRAMapping | None:
        """The mapping of a step whose requests (in batch order) run ``loras`` over ``q_lens``
        new tokens each; None if none runs an adapter (the plain, fused path)."""
        wanted = list(dict.fromkeys(lr.lora_int_id for lr in loras if lr is not None))
        if not wanted:
            return None
        if len(wanted) > self.config.max_loras:
            raise RuntimeError(f"a step runs {len(wanted)} adapters, over max_loras="
                               f"{self.config.max_loras} (the scheduler's limit)")
        reqs = {lr.lora_int_id: lr for lr in loras if lr is not None}
        slot_of = {i: self._slot(reqs[i], wanted) for i in wanted}
        per_req = [self.base_slot if lr is None else slot_of[lr.lora_int_id] for lr in loras]
        token_slots = torch.repeat_interleave(torch.tensor(per_req), torch.tensor(list(q_lens)))
        groups = [(s, (token_slots == s).nonzero().flatten().to(self.device), self.slot_targets[s])
                  for s in slot_of.values()]
        method = self.method or ("dense" if len(token_slots) <= DENSE_MAX_TOKENS else "loop")
        onehot = None
        if method == "dense":
            dtype = next(iter(self.stacks.values())).a.dtype
            onehot = torch.nn.functional.one_hot(token_slots, self.base_slot + 1)[:, :-1].to(dtype)
            onehot = onehot.unsqueeze(-1).to(self.device)  # [T, S, 1]: base tokens all zero
        return LoRAMapping(token_slots.to(self.device), groups, self.stacks, method, onehot)

    def _slot(self, req: LoRARequest, in_step: list[int]) -> int:
        """``req``'s slot, loading it there (into a free slot or the least recently used one that
        this step does not use) if it is not resident."""
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
        self._load(slot, self._host_weights(self.known.get(i, req)))
        self.slot_of[i] = slot
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


__all__ = ["LoRAError", "LoRAManager"]
