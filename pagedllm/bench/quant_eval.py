"""KV-cache quantization: accuracy and capacity against the unquantized cache.

    python -m pagedllm.bench.quant_eval [--model DIR] [--windows 8] [--window-len 256]
                                  [--greedy 16] [--greedy-tokens 64] [--budget 64MiB] [--json F]

For each KV storage choice (K and V separately: auto, int8, fp8_e4m3, fp8_e5m2) the same engine
runs the same text, and the table reports, against the unquantized cache ("auto"):

- top-1: teacher-forced next-token agreement (the argmax over the vocabulary at every position
  of ``--windows`` windows of held-out text, via ``prompt_logprobs``);
- ppl and its change, and the mean |delta logprob| of the true next token;
- greedy: over ``--greedy`` prompts x ``--greedy-tokens`` greedy tokens, the share of tokens
  before the first divergence (strict: one flip ends the count), and how many continuations are
  identical throughout;
- bytes of KV per token (values + scales), the saving against fp16/bf16 and fp32 storage, and
  the tokens that fit in ``--budget``.

Held-out text: the shipped default model's held-out split (every 50th file of the Python
standard library, as ``scripts/train_default_model.py`` selects it), so the figures are on text
the model did not train on. Whatever the model, pass ``--text FILE`` to use other text.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# (label, k_cache_dtype, v_cache_dtype); the first is the reference
CONFIGS: list[tuple[str, str, str]] = [
    ("auto", "auto", "auto"),
    ("K auto + V int8", "auto", "int8"),
    ("K int8 + V auto", "int8", "auto"),
    ("int8", "int8", "int8"),
    ("K auto + V fp8_e4m3", "auto", "fp8_e4m3"),
    ("K fp8_e4m3 + V auto", "fp8_e4m3", "auto"),
    ("fp8_e4m3", "fp8_e4m3", "fp8_e4m3"),
    ("fp8_e5m2", "fp8_e5m2", "fp8_e5m2"),
]
_EXCLUDE = {"test", "tests", "site-packages", "__pycache__"}


def heldout_texts(stdlib: Path | None = None, limit: int = 20) -> list[str]:
    """The default model's held-out files (sorted stdlib ``*.py`` minus tests; index % 50 == 0)."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    files = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        rel_s = rel.as_posix()
        if set(rel.parts[:-1]) & _EXCLUDE or rel_s.startswith(("idlelib/idle_test/", "idlelib/test")):
            continue
        files.append(rel_s)
    files.sort()
    held = [f for i, f in enumerate(files) if i % 50 == 0][:limit]
    return [(root / f).read_bytes().decode("utf-8", errors="replace") for f in held]


@dataclass
class Row:
    label: str
    k_cache_dtype: str
    v_cache_dtype: str
    top1_agreement: float
    ppl: float
    ppl_change_pct: float
    mean_abs_dlogprob: float
    greedy_prefix_agreement: float
    greedy_identical: str
    kv_bytes_per_token: int
    saving_vs_16bit_pct: float
    saving_vs_32bit_pct: float
    tokens_in_budget: int


def _teacher_forced(llm: Any, windows: list[list[int]]) -> tuple[list[int], list[float]]:
    """(argmax token, logprob of the true token) at every position after the first."""
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    top1: list[int] = []
    true_lp: list[float] = []
    outs = llm.generate([{"prompt_token_ids": w} for w in windows], sp, use_tqdm=False)
    for w, out in zip(windows, outs, strict=True):
        for pos, lps in zip(range(1, len(w)), out.prompt_logprobs[1:], strict=True):
            top1.append(next(t for t, lp in lps.items() if lp.rank == 1))
            true_lp.append(lps[w[pos]].logprob)
    return top1, true_lp


def _greedy(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from pagedllm import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def evaluate(
    model: str | None = None,
    text: str | None = None,
    windows: int = 8,
    window_len: int = 256,
    greedy: int = 16,
    greedy_prompt_len: int = 64,
    greedy_tokens: int = 64,
    budget: str = "64MiB",
    configs: list[tuple[str, str, str]] | None = None,
    attention_backend: str | None = None,
    dtype: str = "auto",
) -> list[Row]:
    from pagedllm import LLM
    from pagedllm.args import EngineArgs
    from pagedllm.kv.plan import plan_kv_pool
    from pagedllm.tokenizer import get_tokenizer

    configs = configs or CONFIGS
    kw: dict[str, Any] = dict(model=model, max_model_len=max(window_len, greedy_prompt_len) + greedy_tokens + 8,
                              attention_backend=attention_backend, enable_prefix_caching=False,
                              dtype=dtype)
    tok = get_tokenizer(EngineArgs(**kw).create_engine_config().tokenizer)
    texts = [Path(text).read_text()] if text else heldout_texts()
    eos = tok.eos_token_id
    stream: list[int] = []
    for t in texts:
        stream += tok.encode(t) + ([eos] if eos is not None else [])
    need = windows * window_len + greedy * greedy_prompt_len
    if len(stream) < need:
        raise ValueError(f"the text has {len(stream)} tokens; {need} are needed")
    wins = [stream[i * window_len:(i + 1) * window_len] for i in range(windows)]
    base = windows * window_len
    prompts = [stream[base + i * greedy_prompt_len: base + (i + 1) * greedy_prompt_len]
               for i in range(greedy)]

    rows: list[Row] = []
    ref: dict[str, Any] = {}
    for label, kd, vd in configs:
        llm = LLM(k_cache_dtype=kd, v_cache_dtype=vd, **kw)
        top1, lp = _teacher_forced(llm, wins)
        cont = _greedy(llm, prompts, greedy_tokens)
        if not ref:
            ref = dict(top1=top1, lp=lp, cont=cont, ppl=math.exp(-sum(lp) / len(lp)))
        agree = sum(a == b for a, b in zip(top1, ref["top1"], strict=True)) / len(top1)
        ppl = math.exp(-sum(lp) / len(lp))
        dlp = sum(abs(a - b) for a, b in zip(lp, ref["lp"], strict=True)) / len(lp)
        prefix = 0
        for c, r in zip(cont, ref["cont"], strict=True):
            prefix += next((i for i, (a, b) in enumerate(zip(c, r)) if a != b), len(r))
        same = sum(c == r for c, r in zip(cont, ref["cont"], strict=True))
        cfg = EngineArgs(**kw, k_cache_dtype=kd, v_cache_dtype=vd,
                         kv_cache_memory=budget).create_engine_config()
        m = cfg.model
        per_token = cfg.cache.kv_bytes_per_token(m)
        unit = m.kv_bytes_per_token // m.dtype_bytes  # K+V elements per token
        plan = plan_kv_pool(m, cfg.cache, cfg.scheduler)
        rows.append(Row(
            label, kd, vd, agree, ppl, 100 * (ppl / ref["ppl"] - 1), dlp,
            prefix / (len(cont) * greedy_tokens), f"{same}/{len(cont)}", per_token,
            100 * (1 - per_token / (2 * unit)), 100 * (1 - per_token / (4 * unit)),
            plan.num_tokens,
        ))
    return rows


def markdown(rows: list[Row], budget: str) -> str:
    head = (f"| KV storage | top-1 agree | ppl | Δppl | mean \\|Δlogprob\\| | greedy prefix agree "
            f"| greedy identical | bytes/token | saved vs 16-bit | saved vs 32-bit | tokens in {budget} |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r.label} | {100 * r.top1_agreement:.2f} % | {r.ppl:.3f} | {r.ppl_change_pct:+.2f} % "
            f"| {r.mean_abs_dlogprob:.4f} | {100 * r.greedy_prefix_agreement:.1f} % | "
            f"{r.greedy_identical} | {r.kv_bytes_per_token} | {r.saving_vs_16bit_pct:.1f} % | "
            f"{r.saving_vs_32bit_pct:.1f} % | {r.tokens_in_budget:,} |"
        )
    return "\n".join(lines)


COMMAND = "kv-quant"
HELP = ("quantized KV (int8 / fp8, K and V separately) vs the unquantized cache: top-1 agreement, "
        "perplexity, greedy agreement, bytes/token, capacity")


def add_cli_args(ap: argparse.ArgumentParser) -> None:
    from pagedllm.args import EngineArgs

    ap.add_argument("--text", default=None, help="evaluate on this text file instead of the held-out split")
    ap.add_argument("--windows", type=int, default=8, help="teacher-forced windows")
    ap.add_argument("--window-len", type=int, default=256)
    ap.add_argument("--greedy", type=int, default=16, help="greedy prompts")
    ap.add_argument("--greedy-tokens", type=int, default=64)
    ap.add_argument("--budget", default="64MiB", help="KV budget for the tokens-that-fit column")
    ap.add_argument("--json", default=None, help="also write the rows as JSON here")
    # the model, its dtype (K/V 'auto' storage follows it) and the attention backend
    EngineArgs.add_cli_args(ap, only=("model", "dtype", "attention_backend"))


def run(a: argparse.Namespace) -> int:
    rows = evaluate(a.model, a.text, a.windows, a.window_len, a.greedy, greedy_tokens=a.greedy_tokens,
                    budget=a.budget, attention_backend=a.attention_backend, dtype=a.dtype)
    print(markdown(rows, a.budget))
    if a.json:
        Path(a.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedllm.bench.quant_eval`` (the same as ``pagedllm bench kv-quant``)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(ap)
    return run(ap.parse_args(argv))

if __name__ == "__main__":
    raise SystemExit(main())
