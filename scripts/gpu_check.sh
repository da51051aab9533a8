#!/usr/bin/env bash
# The GPU checks of issue 8 in one command, for a session that has a CUDA GPU. Run from the repo
# root (a copy of the working tree is enough; nothing is installed, PYTHONPATH=. is used):
#
#     OUT=/some/dir bash scripts/gpu_check.sh        # results in $OUT (default ./gpu-results)
#
# Steps, in order, each under its own `timeout`, all inside one wall-clock budget
# (GPU_CHECK_BUDGET_S, default 560 s; a step that would start with under 30 s left is skipped):
#   env         nvidia-smi, python / torch / CUDA / triton / transformers versions
#   pytest      the GPU-marked tests (tests/gpu) and the Triton kernels' tests on this GPU
#   kernel      pagedllm bench kernel --device cuda: decode KV bandwidth vs the GPU's peak and
#               a measured copy, prefill TFLOP/s, paged vs contiguous SDPA      -> kernel.json
#   model       a random-weight Llama of $MODEL_PRESET (~1B, bf16) into $MODEL_DIR (not $OUT)
#   throughput  bench throughput --device cuda --dtype bfloat16, pagedllm vs HF generate
#                                                                              -> throughput.json
#   lora        the model with 8 random adapters (rank 16): base vs LoRA with its decode graphs
#               vs LoRA eager, one run (issue 29's >= 0.7x)              -> throughput-lora.json
#   eager       the same workload, pagedllm only, --enforce-eager       -> throughput-eager.json
#   invariant   batch-invariant mode on the Triton family (issue 30): its kernel and engine tests
#               compiled for this GPU (fp32 and bf16, bitwise), then the cost: the model's
#               workload at 32 sequences, default vs --batch-invariant -> throughput-invariant.json
#   summary     the headline numbers and targets of the JSON files      -> summary.txt
# Every step's full output is in $OUT/<step>.log; the last lines are echoed here.
# Knobs (env): GPU_CHECK_STEPS (comma list of the steps above), NUM_PROMPTS (128), REPS (2),
# HF_BATCH (32), MODEL_PRESET (1b), MODEL_DIR (/tmp/pagedllm-llama-$MODEL_PRESET), PYTHON,
# TAIL (lines echoed per step).
set -uo pipefail

OUT="${OUT:-./gpu-results}"
BUDGET="${GPU_CHECK_BUDGET_S:-560}"
STEPS=",${GPU_CHECK_STEPS:-env,pytest,kernel,model,lora,throughput,eager,invariant,summary},"
NUM_PROMPTS="${NUM_PROMPTS:-128}"
REPS="${REPS:-2}"
HF_BATCH="${HF_BATCH:-32}"
MODEL_PRESET="${MODEL_PRESET:-1b}"
MODEL_DIR="${MODEL_DIR:-/tmp/pagedllm-llama-$MODEL_PRESET}"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
TAIL="${TAIL:-30}"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1 # the repo root: pagedllm/ and tests/
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export PAGEDLLM_LOG_LEVEL="${PAGEDLLM_LOG_LEVEL:-WARNING}"
SECONDS=0
: >"$OUT/summary.txt"

log() { echo "[gpu_check ${SECONDS}s] $*" | tee -a "$OUT/summary.txt"; }
want() { [[ "$STEPS" == *",$1,"* ]]; }

# run_step NAME LIMIT_S CMD...: CMD under `timeout`, output to $OUT/NAME.log, tail echoed
run_step() {
    local name=$1 limit=$2 left rc t0
    shift 2
    left=$((BUDGET - SECONDS))
    if ((left < 30)); then
        log "SKIP $name: ${left}s of the ${BUDGET}s budget left"
        return 124
    fi
    ((limit > left)) && limit=$left
    local cmd="$*"
    cmd="${cmd//$'\n'/ }"
    log "step $name (timeout ${limit}s): ${cmd:0:200}"
    t0=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    local note=""
    ((rc == 124 || rc == 137)) && note=" (TIMED OUT after ${limit}s)"
    log "step $name: exit $rc after $((SECONDS - t0))s$note"
    tail -n "$TAIL" "$OUT/$name.log" | sed "s/^/  [$name] /"
    return $rc
}

if [[ -z "$PY" ]]; then
    log "FATAL: no python3 / python on PATH"
    exit 1
fi

# -- env: versions, and what is missing -------------------------------------------------------
missing_modules() {
    "$PY" - <<'EOF'
import importlib.util
mods = ["torch", "transformers", "tokenizers", "safetensors", "triton", "numpy", "yaml", "tqdm"]
print(" ".join(m for m in mods if importlib.util.find_spec(m) is None))
EOF
}
MISSING="$(missing_modules)"
if [[ -n "$MISSING" ]]; then
    log "missing python modules: $MISSING; trying pip (fails fast without network)"
    pkgs="$(echo "$MISSING" | sed 's/\byaml\b/pyyaml/')"
    # shellcheck disable=SC2086
    timeout 120 "$PY" -m pip install -q --retries 0 --timeout 5 $pkgs >"$OUT/pip.log" 2>&1 \
        || log "pip install failed (see pip.log)"
    MISSING="$(missing_modules)"
    [[ -n "$MISSING" ]] && log "still missing: $MISSING"
fi
for m in torch transformers tokenizers safetensors numpy yaml tqdm; do
    if [[ " $MISSING " == *" $m "* ]]; then
        log "FATAL: pagedllm needs the python module '$m'; install it and rerun"
        exit 1
    fi
done
HAVE_TRITON=1
[[ " $MISSING " == *" triton "* ]] && HAVE_TRITON=0

if want env; then
    { nvidia-smi || echo "nvidia-smi not available"; } >"$OUT/nvidia-smi.txt" 2>&1
    run_step env 60 "$PY" -c '
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda)
print("cuda available:", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs")
for m in ("triton", "transformers", "safetensors", "tokenizers"):
    try:
        print(m, __import__(m).__version__)
    except ImportError as e:
        print(m, "MISSING:", e)
from pagedllm.bench.device import peak_memory_bandwidth
if torch.cuda.is_available():
    print("spec peak bandwidth (bytes/s):", peak_memory_bandwidth(torch.cuda.get_device_name(0)))
'
    head -n 20 "$OUT/nvidia-smi.txt" | sed "s/^/  [nvidia-smi] /"
fi
if { want pytest || want kernel || want model || want throughput || want eager || want lora ||
    want invariant; } &&
    ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    log "FATAL: torch sees no CUDA GPU; nothing below can run"
    exit 1
fi
((HAVE_TRITON)) || log "no triton: the kernel bench and the pagedllm engine on CUDA need it; skipping them"

# -- pytest -m cuda ----------------------------------------------------------------------------
if want pytest; then
    if "$PY" -c 'import pytest' 2>/dev/null; then
        # the cuda-marked engine tests, and the Triton kernels' own tests (which run in the
        # interpreter on CPU elsewhere) compiled for this GPU: TRITON_INTERPRET=0 sends them to cuda
        TRITON_INTERPRET=0 run_step pytest-cuda "${PYTEST_LIMIT_S:-300}" "$PY" -m pytest -q \
            -p no:cacheprovider -rfE --timeout 120 -m "cuda or not slow" \
            --continue-on-collection-errors tests/gpu tests/attention/test_triton.py \
            tests/lora/test_lora_triton.py tests/attention/test_kv_quant.py \
            tests/attention/test_window_tables.py
        rc=$?
        ((rc == 5)) && log "pytest: no tests are marked cuda (exit 5), fine"
    else
        log "SKIP pytest: pytest is not installed"
    fi
fi

# -- kernel bench ------------------------------------------------------------------------------
if want kernel && ((HAVE_TRITON)); then
    run_step kernel 200 "$PY" -m pagedllm.entrypoints.cli bench kernel --device cuda --rounds 3 --iters 10 \
        --output-dir "$OUT"
fi

# -- ~1B random model, then end-to-end throughput vs HF ----------------------------------------
if want model; then
    if [[ -f "$MODEL_DIR/config.json" && -f "$MODEL_DIR/model.safetensors" ]]; then
        log "model: reusing $MODEL_DIR"
    else
        run_step random-model 150 "$PY" -m pagedllm.entrypoints.cli bench random-model "$MODEL_DIR" \
            --preset "$MODEL_PRESET" --device cuda
    fi
fi
TP_ARGS=(--model "$MODEL_DIR" --device cuda --dtype bfloat16 --num-prompts "$NUM_PROMPTS"
    --reps "$REPS" --max-num-seqs 128 --output-dir "$OUT")
if want lora && ((HAVE_TRITON)) && [[ -f "$MODEL_DIR/config.json" ]]; then
    run_step throughput-lora 200 "$PY" -m pagedllm.entrypoints.cli bench throughput "${TP_ARGS[@]}" \
        --backends "pagedllm,pagedllm[enable_lora=true,max_loras=8],pagedllm[enable_lora=true,\
max_loras=8,enforce_eager=true]" --lora-adapters 8 --max-lora-rank 16 \
        --gpu-memory-utilization 0.25 --output-json "$OUT/throughput-lora.json" --no-plot
fi
if want throughput; then
    if [[ ! -f "$MODEL_DIR/config.json" ]]; then
        log "SKIP throughput: no model at $MODEL_DIR"
    else
        backends=hf
        ((HAVE_TRITON)) && backends=pagedllm,hf
        # HF shares the GPU with the engine in one process: leave it half of the memory
        run_step throughput 300 "$PY" -m pagedllm.entrypoints.cli bench throughput "${TP_ARGS[@]}" \
            --backends "$backends" --hf-batch-size "$HF_BATCH" --gpu-memory-utilization 0.5 \
            --output-json "$OUT/throughput.json"
    fi
fi
if want eager && ((HAVE_TRITON)) && [[ -f "$MODEL_DIR/config.json" ]]; then
    run_step throughput-eager 150 "$PY" -m pagedllm.entrypoints.cli bench throughput "${TP_ARGS[@]}" \
        --backends pagedllm --enforce-eager --output-json "$OUT/throughput-eager.json" --no-plot
fi

# -- batch-invariant mode (Triton family): bitwise tests on this GPU, then its cost -------------
if want invariant && ((HAVE_TRITON)); then
    TRITON_INTERPRET=0 run_step invariant-tests 240 "$PY" -m pytest -q -p no:cacheprovider -rfE \
        --timeout 200 -m "slow or not slow" tests/layers/test_triton_invariant_ops.py \
        tests/attention/test_triton_invariant_attention.py \
        tests/golden/test_batch_invariant_triton.py
    if [[ -f "$MODEL_DIR/config.json" ]]; then
        run_step throughput-invariant 200 "$PY" -m pagedllm.entrypoints.cli bench throughput \
            "${TP_ARGS[@]}" --max-num-seqs 32 --backends "pagedllm,pagedllm[batch_invariant=true]" \
            --gpu-memory-utilization 0.25 --output-json "$OUT/throughput-invariant.json" --no-plot
    fi
fi

# -- summary -----------------------------------------------------------------------------------
if want summary; then
    "$PY" - "$OUT" <<'EOF' | tee -a "$OUT/summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])


def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None


def gb(x):
    return "n/a" if x is None else f"{x / 1e9:.0f} GB/s"


def pct(x):
    return "n/a" if x is None else f"{x:.0%}"


k = load("kernel.json")
if k:
    print(f"== kernel: {k['device_name']}, {k['shape']}, backend {k['backend']}")
    print(f"   spec peak {gb(k['peak_bandwidth_bytes_per_s'])}, "
          f"measured copy {gb(k['copy_bandwidth'].get('bytes_per_s'))} (read + write)")
    d = k["summary"].get("decode")
    if d:
        for bs, gbps in d["paged_GBps_at_longest"].items():
            print(f"   decode ctx {d['longest_context']} block {bs}: {gbps:.0f} GB/s, "
                  f"{pct(d['frac_peak_at_longest'][bs])} of peak, "
                  f"{pct(d['frac_copy_at_longest'][bs])} of copy")
        print(f"   decode paged/contiguous time: median {d['median_ratio']:.2f}, "
              f"worst {d['max_ratio']:.2f}")
    p = k["summary"].get("prefill")
    if p:
        print(f"   prefill best TFLOP/s: paged {p['best_paged_TFLOPs']:.1f}, contiguous SDPA "
              f"{p['best_contiguous_TFLOPs']:.1f}; paged/contiguous time median "
              f"{p['median_ratio']:.2f}, worst {p['max_ratio']:.2f}")
    for t in k["targets"]:
        print(f"   target {t['target']}: {t['value']} -> {'met' if t['met'] else 'MISSED'}")
else:
    print("== kernel: no kernel.json")
for name in ("throughput.json", "throughput-eager.json", "throughput-lora.json",
             "throughput-invariant.json"):
    t = load(name)
    if not t:
        print(f"== {name}: missing")
        continue
    w = t["workload"]
    print(f"== {name}: {t.get('device_name')}, {w['num_requests']} requests, "
          f"{w['output_tokens']} output tokens, reps {t['reps']}")
    for r in t["results"]:
        runs = ", ".join(f"{x:.1f}" for x in r["elapsed_s_all"])
        print(f"   {r['backend']}: {r['output_tokens_per_s']:.0f} output tok/s, "
              f"{r['requests_per_s']:.2f} req/s (runs: {runs} s)")
    for pair, r in t["ratios"].items():
        print(f"   {pair}: output tok/s x{r['output_tokens_per_s']:.2f}")
    for pair, m in t["greedy_output_agreement"].items():
        print(f"   greedy outputs identical {pair}: {m:.0%}")
EOF
fi
log "done in ${SECONDS}s; results in $OUT"
