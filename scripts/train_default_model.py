#!/usr/bin/env python3
"""Train the small default model embedded in pagedllm (``pagedllm/assets/default_model``).

Reproducible end to end (fixed seed, deterministic data order, fixed step count):

    python3 scripts/train_default_model.py

Pipeline:
  1. corpus = the Python standard library's own ``*.py`` source on this machine
     (``sysconfig.get_paths()["stdlib"]``), minus test suites and site-packages,
     sorted by relative path. Every file whose sorted index % 50 == 0 is held out
     for evaluation. (PSF licence.)
  2. byte-level BPE tokenizer (``tokenizers``), ByteLevel pre-tokenizer/decoder, so any
     text round-trips; special tokens <|bos|>, <|eos|>, <|pad|>, <|system|>, <|user|>,
     <|assistant|>.
  3. LlamaForCausalLM with grouped-query attention, random init, trained on CPU
     on 512-token windows with AdamW + warmup + cosine decay.
  4. held-out perplexity, greedy samples, HF-format directory + model card.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "pagedllm" / "assets" / "default_model"

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|eos|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

SAMPLE_PROMPTS = ["def ", "class ", "import ", '"""Return the ', "def fibonacci(n):"]

EXCLUDE_DIR_PARTS = {"test", "tests", "site-packages", "__pycache__"}


# --------------------------------------------------------------------------- corpus
def collect_corpus(stdlib: Path):
    files = []
    for p in stdlib.rglob("*.py"):
        rel = p.relative_to(stdlib)
        parts = set(rel.parts[:-1])
        if parts & EXCLUDE_DIR_PARTS:
            continue  # covers test/, tests/, idlelib/idle_test-style, lib2to3/tests, site-packages
        rel_s = rel.as_posix()
        if rel_s.startswith("idlelib/idle_test/") or rel_s.startswith("idlelib/test"):
            continue
        files.append(rel_s)
    files.sort()
    train, heldout = [], []
    for i, rel in enumerate(files):
        text = (stdlib / rel).read_bytes().decode("utf-8", errors="replace")
        (heldout if i % 50 == 0 else train).append((rel, text))
    return train, heldout


# --------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[3:],
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def finalize_tokenizer_files(out: Path) -> None:
    """Keep the chat template inside tokenizer_config.json (readable without transformers),
    use the portable ``PreTrainedTokenizerFast`` class name, and write special_tokens_map.json."""
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    jinja = out / "chat_template.jinja"
    if jinja.exists():
        jinja.unlink()
    stm = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
           "additional_special_tokens": SPECIAL_TOKENS[3:]}
    (out / "special_tokens_map.json").write_text(json.dumps(stm, indent=2) + "\n")


def encode_stream(tok, texts, eos_id: int) -> torch.Tensor:
    ids = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


# --------------------------------------------------------------------------- model
def build_model(args, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.context,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.02,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        use_cache=True,
    )
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(cfg).float()
    return model


def lr_at(step: int, total: int, warmup: int, peak: float, min_ratio: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog))))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, ctx: int, n_windows: int, batch: int = 4) -> tuple[float, int]:
    model.eval()
    n_avail = (len(stream) - 1) // ctx
    n = min(n_windows, n_avail)
    total_loss, total_tok = 0.0, 0
    for s in range(0, n, batch):
        idx = range(s, min(n, s + batch))
        x = torch.stack([stream[i * ctx : i * ctx + ctx] for i in idx])
        y = torch.stack([stream[i * ctx + 1 : i * ctx + ctx + 1] for i in idx])
        logits = model(input_ids=x).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)), y.reshape(-1), reduction="sum"
        )
        total_loss += loss.item()
        total_tok += y.numel()
    model.train()
    return math.exp(total_loss / total_tok), total_tok


@torch.no_grad()
def greedy_samples(model, hf_tok, max_new_tokens: int):
    model.eval()
    out = []
    for p in SAMPLE_PROMPTS:
        enc = hf_tok(p, return_tensors="pt", add_special_tokens=False)
        gen = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=hf_tok.pad_token_id,
            eos_token_id=hf_tok.eos_token_id,
        )
        new_ids = gen[0, enc["input_ids"].shape[1] :].tolist()
        out.append((p, hf_tok.decode(new_ids, skip_special_tokens=False), new_ids))
    return out


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- main
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=640)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--eval-windows", type=int, default=64)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sample-tokens", type=int, default=40)
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    assert args.kv_heads < args.heads and args.heads % args.kv_heads == 0, "GQA required"
    assert args.context >= 512

    # 1. corpus
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_docs, held_docs = collect_corpus(stdlib)
    train_texts = [t for _, t in train_docs]
    held_texts = [t for _, t in held_docs]
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    held_bytes = sum(len(t.encode("utf-8")) for t in held_texts)
    print(
        f"[corpus] python {platform.python_version()} stdlib={stdlib} "
        f"train files={len(train_docs)} bytes={train_bytes} | held-out files={len(held_docs)} bytes={held_bytes}",
        flush=True,
    )

    # 2. tokenizer
    t0 = time.time()
    tok = train_tokenizer(train_texts, args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    bos_id = tok.token_to_id(BOS)
    pad_id = tok.token_to_id(PAD)
    hf_tok = wrap_tokenizer(tok)
    train_stream = encode_stream(tok, train_texts, eos_id)
    held_stream = encode_stream(tok, held_texts, eos_id)
    vocab_size = tok.get_vocab_size()
    print(
        f"[tokenizer] vocab={vocab_size} train tokens={len(train_stream)} held-out tokens={len(held_stream)} "
        f"({train_bytes / len(train_stream):.2f} bytes/token) in {time.time() - t0:.1f}s",
        flush=True,
    )

    # 3. model + training
    model = build_model(args, vocab_size, bos_id, eos_id, pad_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"[model] {model.config.num_hidden_layers} layers, hidden {model.config.hidden_size}, "
          f"heads {args.heads}/{args.kv_heads} kv, ffn {args.intermediate}, params={n_params:,}", flush=True)

    decay, no_decay = [], []
    for p in model.parameters():  # same order as named_parameters()
        (decay if p.dim() >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
    )

    ctx = args.context
    gen = torch.Generator().manual_seed(args.seed)
    n_starts = len(train_stream) - ctx - 1
    model.train()
    t_train = time.time()
    tokens_seen = 0
    loss_ema = None
    for step in range(args.max_steps):
        lr = lr_at(step, args.max_steps, args.warmup, args.lr)
        for g in opt.param_groups:
            g["lr"] = lr
        starts = torch.randint(0, n_starts, (args.batch,), generator=gen)
        x = torch.stack([train_stream[s : s + ctx] for s in starts.tolist()])
        y = torch.stack([train_stream[s + 1 : s + ctx + 1] for s in starts.tolist()])
        logits = model(input_ids=x).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        opt.step()
        tokens_seen += x.numel()
        li = loss.item()
        loss_ema = li if loss_ema is None else 0.95 * loss_ema + 0.05 * li
        if step % args.log_every == 0 or step == args.max_steps - 1:
            el = time.time() - t_train
            print(
                f"[train] step {step + 1}/{args.max_steps} loss {li:.4f} (ema {loss_ema:.4f}) "
                f"gnorm {gnorm.item():.2f} lr {lr:.2e} tok/s {tokens_seen / el:.0f} "
                f"tokens {tokens_seen} elapsed {el:.0f}s",
                flush=True,
            )
    train_wall = time.time() - t_train
    print(f"[train] done: {tokens_seen} tokens in {train_wall:.1f}s", flush=True)

    # 4. evaluation + samples
    ppl, eval_tokens = evaluate(model, held_stream, ctx, args.eval_windows)
    print(f"[eval] held-out perplexity {ppl:.3f} over {eval_tokens} tokens", flush=True)

    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.generation_config.bos_token_id = bos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.do_sample = False
    model.save_pretrained(out, safe_serialization=True)
    hf_tok.save_pretrained(out)
    finalize_tokenizer_files(out)

    # Re-load from disk for the samples so the card reflects exactly what ships.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    t2 = AutoTokenizer.from_pretrained(out)
    samples = greedy_samples(m2, t2, args.sample_tokens)
    for p, text, _ in samples:
        print(f"[sample] {p!r} -> {text!r}", flush=True)

    total_wall = time.time() - t_start
    st_size = (out / "model.safetensors").stat().st_size
    argv_s = " ".join(sys.argv[1:])
    cmd = "python3 scripts/train_default_model.py" + (f" {argv_s}" if argv_s else "")
    samples_md = "\n\n".join(
        f"**Prompt** `{p!r}`\n\n```python\n{p}{text}\n```" for p, text, _ in samples
    )
    card = f"""# pagedllm default model

A tiny Llama-architecture causal LM shipped with pagedllm so that the engine, its tests and
examples work offline with real (trained) weights. It is a *toy*: it writes Python-looking
text and nothing more. It is not instruction tuned; the chat template exists only so the
chat code paths have something to exercise.

## Training data
- Source code of the Python {platform.python_version()} standard library (`*.py` under
  `sysconfig.get_paths()["stdlib"]`), excluding `test/`, `tests/`, `idle_test/` and
  `site-packages/`; files sorted by relative path. Licence: PSF License Agreement
  (Python Software Foundation License).
- Train split: {len(train_docs)} files, {train_bytes:,} bytes, {len(train_stream):,} tokens.
- Held-out split (every file whose sorted index % 50 == 0): {len(held_docs)} files,
  {held_bytes:,} bytes, {len(held_stream):,} tokens.
- Files are joined with `<|eos|>` between them.

## Tokenizer
Byte-level BPE (`tokenizers`), ByteLevel pre-tokenizer + decoder (any UTF-8 text round-trips),
vocabulary {vocab_size} including special tokens {", ".join(f"`{s}`" for s in SPECIAL_TOKENS)}.
No BOS is inserted automatically.

## Architecture
`LlamaForCausalLM`: {args.layers} layers, hidden {args.hidden}, {args.heads} attention heads with
{args.kv_heads} key/value heads (grouped-query attention), head dim {args.hidden // args.heads},
MLP intermediate {args.intermediate} (SiLU), RoPE theta 10000, max positions {args.context},
tied input/output embeddings. **{n_params:,} parameters**, stored in float32
(`model.safetensors` = {st_size / 1e6:.2f} MB).

## Training
- {args.max_steps} steps x {args.batch} sequences x {ctx} tokens = **{tokens_seen:,} tokens seen**
  (random windows drawn with a seeded generator; seed {args.seed}).
- AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), peak LR {args.lr},
  {args.warmup} warmup steps, cosine decay to 10%, gradient clipping {args.grad_clip}.
- CPU only, torch {torch.__version__}, {args.threads} threads. Training wall time
  **{train_wall / 60:.1f} min** (whole script {total_wall / 60:.1f} min).

## Evaluation
Held-out perplexity **{ppl:.2f}** (per token, over {eval_tokens:,} tokens = the first
{eval_tokens // ctx} non-overlapping {ctx}-token windows of the held-out stream).

## Reproduce
```
{cmd}
```
(run from the repository root; results depend on the exact Python stdlib version and on
torch/tokenizers versions.)

## Greedy samples ({args.sample_tokens} new tokens, `do_sample=False`)

{samples_md}
"""
    (out / "README.md").write_text(card)
    size = dir_size(out)
    print(f"[out] wrote {out} ({size / 1e6:.2f} MB): {sorted(f.name for f in out.iterdir())}", flush=True)
    print(json.dumps({
        "vocab": vocab_size, "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
        "kv_heads": args.kv_heads, "intermediate": args.intermediate, "params": n_params,
        "tokens_seen": tokens_seen, "train_wall_s": round(train_wall, 1), "total_wall_s": round(total_wall, 1),
        "heldout_ppl": round(ppl, 4), "dir_bytes": size,
    }), flush=True)


if __name__ == "__main__":
    main()
