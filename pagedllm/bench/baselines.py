"""The systems a workload runs on: pagedllm's engine (paged or contiguous policy), HF
transformers ``generate`` with static batches, and vLLM in a Python of its own (vllm_backend.py).

Each backend runs a whole workload offline (every request submitted at time 0, greedy,
``ignore_eos``) and returns a ``RunResult``; the caller times repetitions and interleaves them.

Device: the engine backends take ``device`` from the engine kwargs (``--device``), and HF runs
on that same device at the dtype the engine resolves (``ModelConfig.from_hf(model, dtype)``:
``--dtype auto`` follows the checkpoint, so a float32 checkpoint runs in float32 on both; pass
``--dtype bfloat16`` for GPU runs). On CUDA the clock is read after ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import resource
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pagedllm._openmp import cpu_times
from pagedllm.bench.device import require_device, synchronize
from pagedllm.bench.workload import BenchRequest, submissions

if TYPE_CHECKING:
    from pagedllm.sched.stats import SpecDecodeCounts

BACKENDS = ("pagedllm", "pagedllm-json", "hf", "contiguous", "vllm")
# ``pagedllm-json``'s schema on every request (``--json-schema`` replaces it): records that the
# grammar cannot close before max_tokens (minItems), so every request runs as long as on
# ``pagedllm`` and the two compare per output token
BENCH_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 1000,
    "items": {"type": "object", "required": ["id", "name", "ok"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "name": {"type": "string", "maxLength": 16},
        "ok": {"type": "boolean"}}},
}


@dataclass
class RunResult:
    backend: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int  # tokens the workload asked for and got (padding waste not counted)
    generated_tokens: int  # tokens the backend computed, incl. waste (HF static-batch tails)
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    stats: dict[str, Any] = field(default_factory=dict)
    sequences: list[list[list[int]]] | None = field(default=None, repr=False)  # every one of n


class EngineBackend:
    """pagedllm's engine; ``policy`` "paged" (the default scheduler) or "contiguous";
    ``json_schema``: every request's output follows it (structured outputs). Requests ask for
    their final output only, as ``LLM.generate`` does (and vLLM's ``LLM.generate``, which its
    backend runs): no per-step output objects nobody reads."""

    def __init__(self, name: str, engine_kwargs: dict[str, Any], policy: str = "paged",
                 json_schema: dict[str, Any] | None = None) -> None:
        from pagedllm.bench.contiguous import ContiguousScheduler
        from pagedllm.bench.probe import StepTrace
        from pagedllm.engine import LLMEngine
        from pagedllm.sched import Scheduler

        policy_cls = ContiguousScheduler if policy == "contiguous" else Scheduler
        self.name = name
        self.engine = LLMEngine.from_args(scheduler_cls=policy_cls, **engine_kwargs)
        self.trace = StepTrace()  # the engine's step records of the last run
        self.step_prepare_s: list[float] = []
        self.device = str(engine_kwargs.get("device") or "cpu")
        self.json_schema = json_schema
        self.loras: dict[int, Any] = {}  # lora_id -> LoRARequest (random adapters, made once)
        self._lora_dir: Any = None

    def _adapters(self, reqs: list[BenchRequest]) -> dict[int, Any] | None:
        """A random adapter of ``max_lora_rank`` for each ``lora_id`` in ``reqs``, written once
        into a temporary directory (pagedllm/lora/random.py); None without LoRA (the requests
        run the base model: ``--backends 'pagedllm,pagedllm[enable_lora=true]'`` compares)."""
        import tempfile
        from pathlib import Path

        from pagedllm.lora.random import write_random_adapter
        from pagedllm.lora.request import LoRARequest

        cfg = self.engine.config
        if cfg.lora is None:
            return None
        for i in sorted({r.lora_id for r in reqs if r.lora_id is not None} - set(self.loras)):
            if self._lora_dir is None:
                self._lora_dir = tempfile.TemporaryDirectory(prefix="pagedllm-bench-lora-")
            path = write_random_adapter(cfg.model, Path(self._lora_dir.name) / f"a{i}",
                                        cfg.lora.max_lora_rank, seed=i)
            self.loras[i] = LoRARequest(f"bench-{i}", i, str(path))
        return self.loras

    def run(self, reqs: list[BenchRequest]) -> RunResult:
        from pagedllm.engine.drive import drive
        from pagedllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        eng = self.engine
        eng.kv.reset_prefix_cache()  # a repetition must not hit the previous one's blocks
        eng.kv.stats.reset()
        trace = self.trace
        trace.restart()
        self.step_prepare_s.clear()
        preempted_before = eng.num_preemptions
        spec_before = replace(eng.spec.total) if eng.spec is not None else None
        so = None if self.json_schema is None else StructuredOutputsParams(json=self.json_schema)
        grammar_s = [0.0, 0.0]  # llguidance's mask time, the part sampling waited for

        def on_step(outs: list[Any]) -> None:
            trace.add(eng.stats)
            self.step_prepare_s.append(eng.stats.prepare_time_s)
            grammar_s[0] += eng.stats.grammar_mask_time_s
            grammar_s[1] += eng.stats.grammar_wait_time_s

        subs = submissions(eng, reqs, prefix="b", loras=self._adapters(reqs), structured_outputs=so,
                           output_kind=RequestOutputKind.FINAL_ONLY)
        synchronize(self.device)
        m0, f0 = cpu_times(), minor_faults()
        t0, c0 = time.perf_counter(), time.process_time()
        res = drive(eng, subs, on_step=on_step)
        synchronize(self.device)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        m1 = cpu_times()
        seqs = [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)]
                for o in res.in_order([r.request_id for r in subs])]
        outs = [q[0] for q in seqs]  # the first sequence, as the other backends give
        n_out = sum(len(t) for q in seqs for t in q)
        stats = trace.summary()
        stats["prefix_cache_hit_rate"] = eng.kv.stats.hit_rate
        stats["num_preemptions"] = eng.num_preemptions - preempted_before
        stats["num_steps"] = len(trace.t)  # this run's step records (`pagedllm plan` replays these)
        stats["cpu_s"] = cpu  # all of this process's threads (on a shared machine, steadier)
        stats["minor_faults"] = minor_faults() - f0  # fresh pages touched (pagedllm/_malloc.py)
        if m0 is not None and m1 is not None:  # every process's, to see what else ran meanwhile
            stats["machine_cpu_s"] = m1[0] - m0[0]
        if eng.spec is not None:
            stats.update(spec_stats(spec_before, eng.spec.total))
        if so is not None:  # llguidance's time computing masks, and the part sampling waited for
            stats["grammar_mask_s"], stats["grammar_wait_s"] = grammar_s
        return RunResult(self.name, elapsed, len(reqs), sum(r.prompt_len for r in reqs), n_out,
                         n_out, outs, stats, seqs)


def minor_faults() -> int:
    """This process's minor page faults so far (``getrusage``)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class HFBackend:
    """transformers ``generate``: static batches of ``batch_size`` in workload order, left
    padding, ``max_new_tokens`` = the batch's longest request (shorter ones are cut after).
    Weights and inputs on ``device``, weights in the engine's resolved ``dtype``."""

    def __init__(self, model: str, batch_size: int = 16, dtype: str = "auto",
                 device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from pagedllm.config import ModelConfig
        from pagedllm.tokenizer import get_tokenizer

        require_device(device)
        self.name = "hf"
        self.batch_size = batch_size
        self.device = str(device)
        self.dtype = ModelConfig.from_hf(model, dtype).dtype
        self.model = AutoModelForCausalLM.from_pretrained(
            model, dtype=getattr(torch, self.dtype), local_files_only=True).eval()
        self.model.to(torch.device(self.device))
        tok = get_tokenizer(model)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def run(self, reqs: list[BenchRequest]) -> RunResult:
        import torch

        outs: list[list[int]] = []
        generated = 0
        synchronize(self.device)
        t0 = time.perf_counter()
        for i in range(0, len(reqs), self.batch_size):
            batch = reqs[i:i + self.batch_size]
            width = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, r in enumerate(batch):  # left padding
                ids[j, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
                mask[j, width - r.prompt_len:] = 1
            new = max(r.max_tokens for r in batch)
            with torch.inference_mode():
                seq = self.model.generate(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                    max_new_tokens=new, min_new_tokens=new,
                    do_sample=False, pad_token_id=self.pad_id,
                )
            gen = seq[:, width:]
            generated += gen.numel()
            outs.extend(gen[j, :r.max_tokens].tolist() for j, r in enumerate(batch))
        synchronize(self.device)
        elapsed = time.perf_counter() - t0
        return RunResult(self.name, elapsed, len(reqs), sum(r.prompt_len for r in reqs),
                         sum(len(o) for o in outs), generated, outs,
                         {"batch_size": self.batch_size, "device": self.device,
                          "dtype": self.dtype})


def spec_stats(before: SpecDecodeCounts | None, after: SpecDecodeCounts) -> dict[str, Any]:
    """A run's speculative decoding: its proposed / accepted tokens (the totals' growth since
    ``before``), the acceptance rate and tokens per verification."""
    from pagedllm.sched.stats import SpecDecodeCounts

    b = before or SpecDecodeCounts()
    run = SpecDecodeCounts(after.num_drafts - b.num_drafts,
                           after.num_draft_tokens - b.num_draft_tokens,
                           after.num_accepted_tokens - b.num_accepted_tokens)
    return {"spec_num_drafts": run.num_drafts, "spec_num_draft_tokens": run.num_draft_tokens,
            "spec_num_accepted_tokens": run.num_accepted_tokens,
            "spec_acceptance_rate": run.acceptance_rate,
            "spec_mean_accepted_length": run.mean_accepted_length}


def split_backends(text: str) -> list[str]:
    """``--backends`` -> names; a comma inside ``[...]`` belongs to a variant's settings (and
    one inside ``{...}`` to a JSON value among them)."""
    names, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth == 0:
            names.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [n for n in [*names, cur.strip()] if n]


def parse_backend(spec: str) -> tuple[str, dict[str, Any]]:
    """``pagedllm[max_num_seqs=128,fused_ops=false]`` -> ("pagedllm", {"max_num_seqs": 128,
    "fused_ops": False}) (``speculative_config={"method":"ngram",...}`` too): an engine backend with some engine settings changed (values read as
    JSON, else as strings), so that settings are compared interleaved in one run."""
    import json

    base, sep, rest = spec.partition("[")
    if not sep:
        return spec, {}
    if not rest.endswith("]") or base not in ("pagedllm", "contiguous"):
        raise ValueError(f"--backends {spec!r}: a variant is pagedllm[name=value,...] or "
                         f"contiguous[name=value,...] (engine setting names, as the flags)")
    over: dict[str, Any] = {}
    for item in split_backends(rest[:-1]):  # JSON values may hold commas
        key, eq, val = item.partition("=")
        if not eq:
            raise ValueError(f"--backends {spec!r}: {item!r} is not name=value")
        try:
            over[key.strip().replace("-", "_")] = json.loads(val)
        except json.JSONDecodeError:
            over[key.strip().replace("-", "_")] = val.strip()
    from pagedllm.args import EngineArgs

    try:
        EngineArgs.from_kwargs(over, f"--backends {spec!r}")
    except TypeError as e:  # an unknown setting name, with the closest one
        raise ValueError(str(e)) from e
    return base, over


def make_backend(name: str, engine_kwargs: dict[str, Any], hf_batch_size: int,
                 json_schema: dict[str, Any] | None = None) -> Any:
    """Every backend but vllm (``vllm_backend.make_vllm_backend``); ``name`` may be a variant
    (``parse_backend``), whose results carry its full name."""
    from pagedllm.config import default_model_path

    base, over = parse_backend(name)
    if base == "pagedllm-json":  # every request constrained to a JSON schema
        return EngineBackend(name, engine_kwargs, "paged", json_schema or BENCH_SCHEMA)
    if base in ("pagedllm", "contiguous"):
        return EngineBackend(name, {**engine_kwargs, **over},
                             "paged" if base == "pagedllm" else "contiguous")
    model = engine_kwargs.get("model") or default_model_path()
    if name == "hf":
        return HFBackend(model, hf_batch_size, engine_kwargs.get("dtype") or "auto",
                         engine_kwargs.get("device") or "cpu")
    raise ValueError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
