#!/usr/bin/env bash
# Tokens/s, MFU and peak memory of a generated project on one GPU: a ~1B Llama shape, bf16, ~50 steps.
#
#   benchmarks/gpu.sh                        # one GPU (H100/H200), nccl, ~1B model, 50 steps
#   benchmarks/gpu.sh --device cpu --tiny    # dry run: tiny model, 2 steps, gloo on CPU (what the tests run)
#   benchmarks/gpu.sh --float8               # also float8 + compile (needs compute capability 8.9+)
#   STEPS=30 BATCH=8 PEAK_FLOPS=989e12 benchmarks/gpu.sh
#   benchmarks/gpu.sh --reference-8b         # torchtitan's headline run: Llama 3.1 8B on 8 GPUs, local batch 2,
#                                            # seq 8192, op-level selective AC; eager, compile, float8+compile,
#                                            # beside `fsdp2gen plan`'s per-GPU figure
#   benchmarks/gpu.sh --long-context         # context parallelism on GPUS (default 2) GPUs: see below
#   benchmarks/gpu.sh --long-context --plan-only   # print the runs it would make (no GPU needed)
#   benchmarks/gpu.sh --pp                   # pipeline parallelism: pp 2 vs FSDP on the same GPUS (default: all
#                                            # visible GPUs, 2 or more): see below
#   benchmarks/gpu.sh --pp --plan-only       # print the runs it would make (no GPU needed)
#
# Generates a project (`fsdp2gen new --gpus 1 --bf16 --compile [--float8]`), trains it with torchrun (1 process)
# once per variant and reads outputs/metrics.jsonl. Prints one line per variant: tokens/s/GPU (median after the
# first 10 steps), achieved TFLOP/s (ModelArgs.flops_per_token(seq_len) x tokens/s), MFU against the device's
# bf16 dense peak (989e12 for H100 SXM / H200; PEAK_FLOPS overrides; float8 too is measured against the bf16
# peak), and peak memory. Variants: eager (parallel.compile false), compile, and with --float8 float8+compile.
#
# --long-context: a project generated with --cp 2 (the 1b preset, bf16, eager, activation checkpointing $LC_AC,
# default none: the shortest sequences that need CP, about a second a step) on $GPUS GPUs (2 or more, even), one
# sample per data rank. `fsdp2gen plan` picks SEQ, the longest power-of-2 sequence that cp 1 fits on the GPU
# ($GPU_TYPE, else from nvidia-smi), and three runs are made: cp 1 at SEQ (the baseline), cp 2 at SEQ (what CP
# costs on the same work) and cp 2 at 2 x SEQ (a sequence cp 1 cannot hold). One line per run: tokens/s/GPU, step
# time, TFLOP/s/GPU (ModelArgs.flops_per_token at that run's sequence length), peak memory beside the plan's
# total, and the ratios of tokens/s and TFLOP/s to the baseline.
#
# --pp: one project generated with --pp 2 (the 1b preset, bf16, eager: compile is not built with PP) on $GPUS GPUs
# (even, 2 or more; fewer visible GPUs: one line says the run is skipped, exit 0), two runs of the same global
# batch (2 samples of 2048 tokens per GPU, $STEPS steps, default 20; --tiny: the tiny model, 2 steps, no plan): "fsdp" (parallel.pp 1: FSDP over every GPU,
# no accumulation) and "pp2-1F1B" (pp 2 x dp_shard GPUS/2, Schedule1F1B over $PP_MICRO micro-batches, default 4,
# of 1 sample). One line per run: tokens/s/GPU, step time, peak memory (the largest rank's) beside the plan's
# total, and the pipeline's ratios to fsdp measured in the same invocation: what PP costs where both fit (the
# bubble; FSDP's parameters kept gathered until the last micro-batch). PP pays off where FSDP (+ TP) cannot fit the
# model, or across nodes on slow links.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
DEVICE=cuda
TINY=""
FLOAT8=""
NPROC=1
REFERENCE=""
LONG=""
PP=""
PLAN_ONLY=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --tiny) TINY=1; shift ;;
    --float8) FLOAT8=1; shift ;;
    --reference-8b) REFERENCE=1; FLOAT8=1; NPROC=8; shift ;;
    --long-context) LONG=1; shift ;;
    --pp) PP=1; shift ;;
    --plan-only) PLAN_ONLY=1; shift ;;
    *) echo "usage: benchmarks/gpu.sh [--device cuda|cpu] [--tiny] [--float8] [--reference-8b]" \
            "[--long-context [--plan-only]] [--pp [--plan-only]]" >&2; exit 2 ;;
  esac
done
if [[ -n "$PLAN_ONLY" && -z "$LONG$PP" ]]; then
  echo "benchmarks/gpu.sh: --plan-only goes with --long-context or --pp; add one" >&2; exit 2
fi
if [[ -n "$LONG" && -n "$PP" ]]; then
  echo "benchmarks/gpu.sh: --long-context and --pp are separate benchmarks; run one at a time" >&2; exit 2
fi
if [[ -n "$LONG" ]]; then
  NPROC="${GPUS:-2}"
  if [[ "$DEVICE" != cuda && -z "$PLAN_ONLY" ]]; then
    # torch's context parallelism shards only the CUDA attention kernels (the CPU tests use a test-only shim).
    echo "benchmarks/gpu.sh: --long-context needs CUDA GPUs (context parallelism has no CPU attention kernel);" \
         "drop --device $DEVICE, or add --plan-only" >&2; exit 2
  fi
  if ! [[ "$NPROC" =~ ^[0-9]+$ ]] || (( NPROC < 2 || NPROC % 2 )); then
    echo "benchmarks/gpu.sh: --long-context runs cp 2 on GPUS=$NPROC; set GPUS to an even number, 2 or more" >&2
    exit 2
  fi
  LC_AC="${LC_AC:-none}"
  if [[ -z "${GPU_TYPE:-}" ]]; then
    GPU_TYPE=h100-80gb
    if command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      GPU_TYPE=h200-141gb
    fi
  fi
  # SEQ: the longest power-of-2 sequence (from 4096) that cp 1 fits, and the plan's totals of the three runs.
  read -r SEQ PLAN_CP1 PLAN_CP2 PLAN_LONG < <("$PYTHON" - "$NPROC" "$LC_AC" "$GPU_TYPE" <<'PY'
import sys
from fsdp2gen.plan import build_request, estimate
from fsdp2gen.plan_shapes import GIB

gpus, ac, gpu_type = int(sys.argv[1]), sys.argv[2], sys.argv[3]


def plan(seq, cp):
    request = build_request(size="1b", gpus=gpus, precision="bf16", activation_checkpointing=ac, seq=seq, cp=cp,
                            batch=1, gpu_type=gpu_type)
    return estimate(request, with_levers=False)


seq = 4096
while plan(2 * seq, 1).fits:
    seq *= 2
print(seq, *(f"{plan(s, cp).per_gpu['total'] / GIB:.1f}" for s, cp in ((seq, 1), (seq, 2), (2 * seq, 2))))
PY
  )
  echo "long context: 1b, $NPROC GPUs ($GPU_TYPE), bf16, AC $LC_AC; plan: cp 1 fits seq $SEQ at most ($PLAN_CP1 GiB)"
  echo "runs: cp1-seq$SEQ (plan $PLAN_CP1 GiB), cp2-seq$SEQ (plan $PLAN_CP2 GiB), cp2-seq$((2 * SEQ)) (plan" \
       "$PLAN_LONG GiB)"
  if [[ -n "$PLAN_ONLY" ]]; then exit 0; fi
fi
if [[ -n "$PP" ]]; then
  VISIBLE=2  # CPU ranks (--device cpu), or --plan-only
  if [[ "$DEVICE" == cuda && -z "$PLAN_ONLY" ]]; then
    VISIBLE=0
    if command -v nvidia-smi >/dev/null; then VISIBLE="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"; fi
  fi
  NPROC="${GPUS:-$VISIBLE}"
  if ! [[ "$NPROC" =~ ^[0-9]+$ ]] || (( NPROC % 2 && NPROC > 1 )); then
    echo "benchmarks/gpu.sh: --pp runs pp 2 on GPUS=$NPROC; set GPUS to an even number, 2 or more" >&2; exit 2
  fi
  if (( NPROC < 2 )); then
    echo "pp: skipped: --pp needs 2 or more GPUs, found $NPROC; run it on a machine with 2+ GPUs (or set GPUS)"
    exit 0
  fi
  PP_MICRO="${PP_MICRO:-4}"
  BATCH="${BATCH:-$((2 * NPROC))}"
  if [[ -z "${GPU_TYPE:-}" ]]; then
    GPU_TYPE=h100-80gb
    if command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
      GPU_TYPE=h200-141gb
    fi
  fi
  # The plan's per-GPU totals of both runs (the worst stage for pp 2) and the 1F1B bubble.
  read -r PLAN_FSDP PLAN_PP BUBBLE < <("$PYTHON" - "$NPROC" "$BATCH" "$PP_MICRO" "$GPU_TYPE" <<'PY'
import sys
from fsdp2gen.plan import build_request, estimate
from fsdp2gen.plan_shapes import GIB
from fsdp2gen.plan_pp import bubble_fraction

gpus, batch, micro, gpu_type = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
totals = []
for pp, accum in ((1, 1), (2, micro)):
    request = build_request(size="1b", gpus=gpus, precision="bf16", seq=2048, pp=pp, grad_accum_steps=accum,
                            batch=batch // (gpus // pp * accum), gpu_type=gpu_type)
    totals.append(f"{estimate(request, with_levers=False).per_gpu['total'] / GIB:.1f}")
print(*totals, f"{100 * bubble_fraction(2, micro, '1F1B', 1):.0f}")
PY
  )
  MODEL=1b
  if [[ -n "$TINY" ]]; then MODEL=tiny; PLAN_FSDP=-; PLAN_PP=-; fi  # the plan is the 1b model's
  echo "pipeline: $MODEL, $NPROC GPUs ($GPU_TYPE), bf16, global batch $BATCH; pp2-1F1B: pp 2 x dp_shard" \
       "$((NPROC / 2)), $PP_MICRO micro-batches (plan: bubble $BUBBLE%) vs fsdp: dp_shard $NPROC, no accumulation"
  echo "runs: fsdp (plan $PLAN_FSDP GiB), pp2-1F1B (plan $PLAN_PP GiB)"
  if [[ -n "$PLAN_ONLY" ]]; then exit 0; fi
fi
AC=none
if [[ -n "$REFERENCE" ]]; then
  STEPS="${STEPS:-50}"
  AC=selective
  SHAPE=(--model.size 8b --training.seq_len 8192 --training.global_batch_size $((2 * NPROC)))
elif [[ -n "$TINY" ]]; then
  STEPS="${STEPS:-2}"
  SHAPE=(--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 2 --model.ffn_dim 172
         --model.vocab_size 128 --model.max_seq_len 64 --training.seq_len 32 --training.global_batch_size "${BATCH:-2}")
else
  STEPS="${STEPS:-50}"
  # The 1b preset, Llama 3.2 1B's shape (1.5B parameters with the untied 128k-vocabulary output); batch
  # 4 x 2048 tokens keeps the fp32 logits and AdamW state well inside 80 GB.
  SHAPE=(--model.size 1b --training.seq_len 2048 --training.global_batch_size "${BATCH:-4}")
fi
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

train() {  # train VARIANT [OVERRIDE...]: a fresh run into $WORK/VARIANT
  local variant="$1"
  shift
  if ! (cd "$PROJECT" && OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" -m torch.distributed.run --standalone \
          --nproc-per-node "$NPROC" train.py --config config.toml "${OVERRIDES[@]}" "$@" --job.output_dir "$WORK/$variant") \
          >"$WORK/$variant.log" 2>&1; then
    echo "$variant: FAILED"
    tail -n 30 "$WORK/$variant.log"
    return 1
  fi
}

if [[ -n "$LONG" ]]; then
  PROJECT="$WORK/llama-1b-cp2"
  "$PYTHON" -m fsdp2gen new "$PROJECT" --gpus "$NPROC" --bf16 --cp 2 --activation-checkpointing "$LC_AC" --yes \
    >/dev/null
  OVERRIDES=(--model.size 1b --model.max_seq_len $((2 * SEQ)) --parallel.compile false --job.device cuda
             --training.steps "${STEPS:-8}" --training.warmup_steps 2 --checkpoint.interval "${STEPS:-8}"
             --checkpoint.resume never --job.log_every 1)
  if grep -q '^model_only_final' "$PROJECT/config.toml"; then
    OVERRIDES+=(--checkpoint.model_only_final true)  # the final checkpoint is not what is measured
  fi
  if grep -q '^document_mask' "$PROJECT/config.toml"; then
    # Synthetic tokens have no documents; CP with document masking is refused, so say it is off.
    OVERRIDES+=(--data.document_mask false)
  fi
  status=0
  runs=()
  # VARIANT CP SEQ: one sample per data rank (NPROC / cp of them).
  for run in "cp1-seq$SEQ 1 $SEQ" "cp2-seq$SEQ 2 $SEQ" "cp2-seq$((2 * SEQ)) 2 $((2 * SEQ))"; do
    read -r variant cp seq <<<"$run"
    if train "$variant" --parallel.cp "$cp" --training.seq_len "$seq" --training.global_batch_size $((NPROC / cp)); then
      runs+=("$variant:$seq")
    else
      status=1
    fi
  done
  if [[ ${#runs[@]} -gt 0 ]]; then
    (cd "$PROJECT" && "$PYTHON" - "$WORK" "${runs[@]}" <<'PY') || status=1
import json, os, statistics, sys
import torch
from config import parse_args

work, runs = sys.argv[1], [run.split(":") for run in sys.argv[2:]]
model = parse_args(["--config", "config.toml", "--model.size", "1b"]).model
print(f"device {torch.cuda.get_device_name(0)} | torch {torch.__version__}")
base = None
for variant, seq in runs:
    with open(os.path.join(work, variant, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f][2:]  # after the CUDA context and the allocator's growth
    tokens = statistics.median(r["tokens_per_s_per_gpu"] for r in records)
    step = statistics.median(r["step_time_s"] for r in records)
    tflops = model.flops_per_token(int(seq)) * tokens / 1e12
    base = base or (tokens, tflops)
    print(f"{variant}: {tokens:,.0f} tokens/s/GPU | step {step:.3f} s | {tflops:.1f} TFLOP/s/GPU | peak "
          f"{max(r['peak_mem_mib'] for r in records) / 1024:.1f} GiB | vs {runs[0][0]}: tokens/s x{tokens / base[0]:.2f},"
          f" TFLOP/s x{tflops / base[1]:.2f} | {len(records)} timed steps")
PY
  fi
  exit "$status"
fi
if [[ -n "$PP" ]]; then
  PROJECT="$WORK/llama-1b-pp2"
  "$PYTHON" -m fsdp2gen new "$PROJECT" --gpus "$NPROC" --bf16 --pp 2 --yes >/dev/null
  STEPS="${STEPS:-20}"
  [[ -n "$TINY" ]] && STEPS=2
  OVERRIDES=("${SHAPE[@]}" --job.device "$DEVICE" --training.steps "$STEPS" --training.warmup_steps 2
             --checkpoint.interval "$STEPS" --checkpoint.resume never --job.log_every 1 --parallel.pp_schedule 1F1B)
  status=0
  runs=()
  for run in "fsdp 1 1" "pp2-1F1B 2 $PP_MICRO"; do
    read -r variant pp accum <<<"$run"
    if train "$variant" --parallel.pp "$pp" --training.grad_accum_steps "$accum"; then
      runs+=("$variant")
    else
      status=1
    fi
  done
  if [[ ${#runs[@]} -gt 0 ]]; then
    (cd "$PROJECT" && "$PYTHON" - "$WORK" "$DEVICE" "$PLAN_FSDP" "$PLAN_PP" "${runs[@]}" <<'PY') || status=1
import importlib.metadata, json, os, statistics, sys

work, device, plans, runs = sys.argv[1], sys.argv[2], dict(zip(("fsdp", "pp2-1F1B"), sys.argv[3:5])), sys.argv[5:]
if device == "cuda":
    import torch  # the device's name; on CPU the report needs no torch (an import costs seconds of CPU)
    name = torch.cuda.get_device_name(0)
else:
    name = "cpu"
print(f"device {name} | torch {importlib.metadata.version('torch')}")
base = None
for variant in runs:
    with open(os.path.join(work, variant, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    timed = records[min(5, len(records) - 1):]  # after the CUDA context and the allocator's growth
    tokens = statistics.median(r["tokens_per_s_per_gpu"] for r in timed)
    step = statistics.median(r["step_time_s"] for r in timed)
    peak = max(r["peak_mem_mib"] for r in records) / 1024
    base = base or (variant, tokens, step, peak)
    ratios = f" | vs {base[0]}: tokens/s x{tokens / base[1]:.2f}, step time x{step / base[2]:.2f}, peak memory " \
             f"x{peak / base[3]:.2f}" if variant != base[0] else ""
    plan = f" (plan {plans[variant]} GiB)" if plans[variant] != "-" else ""
    print(f"{variant}: {tokens:,.0f} tokens/s/GPU | step {step:.3f} s | peak {peak:.2f} GiB{plan}{ratios} | "
          f"{len(timed)} timed steps")
PY
  fi
  exit "$status"
fi
PROJECT="$WORK/llama-1b"
"$PYTHON" -m fsdp2gen new "$PROJECT" --gpus "$NPROC" --bf16 --compile ${FLOAT8:+--float8} \
  --activation-checkpointing "$AC" --yes >/dev/null

# Fresh runs only, a short warm-up, and no checkpoint before the last step.
OVERRIDES=("${SHAPE[@]}" --job.device "$DEVICE" --training.steps "$STEPS" --training.warmup_steps 2
           --checkpoint.interval "$STEPS" --checkpoint.resume never --job.log_every 10)
if grep -q '^model_only_final' "$PROJECT/config.toml"; then
  # The final checkpoint is not what is measured: write the weights only.
  OVERRIDES+=(--checkpoint.model_only_final true)
fi

report() {  # report VARIANT...: the setup, then one line per variant from its metrics.jsonl
  # One Python process for all variants: importing torch costs seconds.
  (cd "$PROJECT" && "$PYTHON" - "$WORK" "$DEVICE" "$*" "${OVERRIDES[@]}" <<'PY'
import json, os, statistics, sys
import torch
from config import parse_args
from model import Transformer

work, device, variants = sys.argv[1], sys.argv[2], sys.argv[3].split()
config = parse_args(["--config", "config.toml", *sys.argv[4:]])
with torch.device("meta"):  # counts parameters without allocating them
    parameters = sum(p.numel() for p in Transformer(config.model).parameters())
flops_per_token = config.model.flops_per_token(config.training.seq_len)
name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu"
print(f"device {name} | torch {torch.__version__} | {parameters / 1e6:,.1f}M parameters | "
      f"{flops_per_token / 1e9:.3f} GFLOP/token at seq {config.training.seq_len} | "
      f"batch {config.training.global_batch_size} | {config.training.steps} steps bf16")
# bf16 dense peaks (no sparsity); H100 SXM and H200 have the same tensor cores.
peak = float(os.environ.get("PEAK_FLOPS") or 0) or (989e12 if "H100" in name or "H200" in name else 0)
for variant in variants:
    with open(os.path.join(work, variant, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    # The first steps pay for the CUDA context, allocator growth and (with compile) compilation.
    timed = records[min(10, len(records) - 1):]
    tokens_per_s = statistics.median(r["tokens_per_s_per_gpu"] for r in timed)
    flops = flops_per_token * tokens_per_s
    if peak:
        mfu = f"MFU {100 * flops / peak:.1f}% of {peak / 1e12:g} TFLOP/s"
    else:
        mfu = "MFU n/a (bf16 peak of this device unknown; set PEAK_FLOPS)"
    print(f"{variant}: {tokens_per_s:,.0f} tokens/s/GPU | {flops / 1e12:.3f} TFLOP/s | {mfu} | "
          f"peak {max(r['peak_mem_mib'] for r in records):,.0f} MiB "
          f"(reserved {max(r['peak_reserved_mib'] for r in records):,.0f} MiB) | "
          f"loss {records[0]['loss']:.3f} -> {records[-1]['loss']:.3f} | {len(records)} steps, {len(timed)} timed")
PY
  )
}

status=0
variants=()
# Float8 is off in the eager and compile runs, so that they measure bf16.
BF16=(${FLOAT8:+--parallel.float8 false})
for variant in eager compile ${FLOAT8:+float8+compile}; do
  case "$variant" in
    eager) overrides=(--parallel.compile false "${BF16[@]}") ;;
    compile) overrides=(--parallel.compile true "${BF16[@]}") ;;
    float8+compile) overrides=(--parallel.compile true --parallel.float8 true) ;;
  esac
  if train "$variant" "${overrides[@]}"; then variants+=("$variant"); else status=1; fi
done
if [[ ${#variants[@]} -gt 0 ]]; then
  report "${variants[@]}" || status=1
fi
if [[ "$AC" != none ]]; then
  # What the memory plan expects per GPU for the same run (compare with the peaks above).
  "$PYTHON" -m fsdp2gen plan --config "$PROJECT/config.toml" --gpus "$NPROC" --precision bf16 --batch 2 \
    --seq 8192 --activation-checkpointing "$AC" | grep -E '^(activations|total|h100|h200)' | sed 's/^/plan: /' || status=1
fi
exit "$status"
