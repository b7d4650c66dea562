#!/usr/bin/env bash
# Smoke-test every project in generated_examples/ on this machine's GPUs (nccl), or on CPU (gloo):
# render it fresh from its answers, train 20 steps on all visible GPUs, check that the loss falls,
# that checkpoints were written, and that a run resumed from step 10 reproduces steps 11-20. Family hf
# examples train a random Llama saved (with transformers) into their model.path, so no download is needed.
#
#   scripts/gpu_smoke.sh                              # every example, all visible GPUs, nccl
#   DEVICE=cpu NPROC=2 TINY=1 scripts/gpu_smoke.sh    # the same checks on 2 CPU processes (gloo), tiny model
#   EXAMPLES="llama-1gpu-fp32" scripts/gpu_smoke.sh   # a subset
#   OWN_TESTS=0 scripts/gpu_smoke.sh                  # without the projects' own pytest (on by default on GPUs)
#
# Prints one line per example: PASS/FAIL name device nproc tokens/s first/last loss, and with OWN_TESTS the
# summary of the project's own pytest run on the same GPUs. Exit 1 if any failed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$(pwd)"
PYTHON="${PYTHON:-python}"
DEVICE="${DEVICE:-cuda}"
if [[ -z "${NPROC:-}" ]]; then
  NPROC="$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())')"
  [[ "$NPROC" -ge 1 ]] || { echo "gpu_smoke: no GPU visible; run with DEVICE=cpu NPROC=2 TINY=1" >&2; exit 2; }
fi
STEPS="${STEPS:-20}"
# The projects' own tests (real torchrun on every visible GPU): what a user runs first on the node.
if [[ "$DEVICE" == cuda ]]; then OWN_TESTS="${OWN_TESTS:-1}"; else OWN_TESTS="${OWN_TESTS:-0}"; fi
HALF=$(( STEPS / 2 ))
EXAMPLES="${EXAMPLES:-$(ls generated_examples)}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

# The same few samples every step (a repeated batch) so that "the loss falls" is a firm check.
OVERRIDES=(--job.device "$DEVICE" --training.steps "$STEPS" --checkpoint.interval "$HALF"
           --training.global_batch_size 8 --data.synthetic_samples 8 --training.lr 1e-3 --training.warmup_steps 2)

failed=0
for name in $EXAMPLES; do
  project="$WORK/$name"
  "$PYTHON" -m fsdp2gen new "$project" --answers-file "$REPO/generated_examples/$name/.copier-answers.yml" --yes >/dev/null
  family="$(sed -n 's/^family: //p' "$project/.copier-answers.yml")"
  MODEL=()
  if [[ "$family" == hf ]]; then
    # The example's model.path is a folder in the project (models/tiny-llama): a random Llama made here, offline.
    if [[ -n "${TINY:-}" ]]; then sizes="hidden_size=64, intermediate_size=172, num_hidden_layers=2, vocab_size=128"
    else sizes="hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, vocab_size=32000"; fi
    (cd "$project" && "$PYTHON" -c "import tomllib, transformers as t
path = tomllib.load(open('config.toml', 'rb'))['model']['path']
config = t.LlamaConfig($sizes, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
t.AutoModelForCausalLM.from_config(config).save_pretrained(path)") >/dev/null 2>&1
    [[ -n "${TINY:-}" ]] && MODEL=(--training.seq_len 32)
  elif [[ -n "${TINY:-}" && "$family" == custom ]]; then
    MODEL=(--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.vocab_size 128 --model.max_seq_len 64
           --training.seq_len 32)
  elif [[ -n "${TINY:-}" ]]; then
    MODEL=(--model.dim 64 --model.n_layers 2 --model.n_heads 4 --model.n_kv_heads 2 --model.ffn_dim 172
           --model.vocab_size 128 --model.max_seq_len 64 --training.seq_len 32)
  fi
  EXTRA=()
  NOTE=""
  if [[ "$DEVICE" == cpu ]] && grep -q '^compile = true' "$project/config.toml"; then
    EXTRA=(--parallel.compile false)  # compiling costs minutes on CPU; on GPUs the smoke run compiles
  fi
  if [[ "$DEVICE" == cuda ]] && grep -q '^float8 = true' "$project/config.toml" \
     && ! "$PYTHON" -c 'import sys, torch; sys.exit(torch.cuda.get_device_capability() < (8, 9))'; then
    # No float8 tensor cores (compute capability < 8.9): train.py would stop, as it should; smoke-test the rest.
    EXTRA+=(--parallel.float8 false)
    NOTE=" (float8 off: this GPU has no float8 tensor cores)"
  fi
  run() {  # run OUTPUT_DIR: train under torchrun with the smoke overrides
    (cd "$project" && OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
      train.py "${OVERRIDES[@]}" "${MODEL[@]}" "${EXTRA[@]}" --job.output_dir "$1") >"$1.log" 2>&1
  }
  if run "$WORK/$name-full" && rm -rf "$WORK/$name-resumed" && mkdir -p "$WORK/$name-resumed/checkpoints" \
     && cp -r "$WORK/$name-full/checkpoints/step-$HALF" "$WORK/$name-resumed/checkpoints/" \
     && run "$WORK/$name-resumed" \
     && verdict="$("$PYTHON" - "$WORK/$name-full" "$WORK/$name-resumed" "$STEPS" "$HALF" <<'PY'
import json, sys
from pathlib import Path
full_dir, resumed_dir, steps, half = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
full = [json.loads(line) for line in (full_dir / "metrics.jsonl").read_text().splitlines()]
resumed = [json.loads(line) for line in (resumed_dir / "metrics.jsonl").read_text().splitlines()]
problems = []
if [m["step"] for m in full] != list(range(1, steps + 1)):
    problems.append("steps missing from metrics.jsonl")
if not full[-1]["loss"] < 0.9 * full[0]["loss"]:
    problems.append(f"loss did not fall: {full[0]['loss']:.4f} -> {full[-1]['loss']:.4f}")
if sorted(p.name for p in (full_dir / "checkpoints").iterdir()) != sorted([f"step-{half}", f"step-{steps}"]):
    problems.append("checkpoints missing")
if [m["step"] for m in resumed] != list(range(half + 1, steps + 1)):
    problems.append("resume did not start after the checkpoint")
for a, b in zip(full[half:], resumed):
    if abs(a["loss"] - b["loss"]) > 1e-3 * abs(a["loss"]):
        problems.append(f"resumed step {b['step']} loss {b['loss']:.6f} != {a['loss']:.6f}")
        break
tokens_per_s = sorted(m["tokens_per_s"] for m in full[2:])[len(full[2:]) // 2]
summary = f"tokens/s {tokens_per_s:,.0f} loss {full[0]['loss']:.4f}->{full[-1]['loss']:.4f} peak {full[-1]['peak_mem_mib']:,.0f} MiB"
print(summary + ("" if not problems else " | " + "; ".join(problems)))
sys.exit(1 if problems else 0)
PY
)"; then
    echo "PASS $name device=$DEVICE nproc=$NPROC $verdict$NOTE"
    # Host syncs per step (tests/helpers/sync_probe.py; on GPUs CUDA's sync debug mode counts them too): steps
    # that neither print (job.log_every 5), validate nor save must make none.
    if (cd "$project" && PROBE_OUT="$WORK" PYTHONPATH="$project" OMP_NUM_THREADS=1 "$PYTHON" -m torch.distributed.run \
          --standalone --nproc-per-node "$NPROC" "$REPO/tests/helpers/sync_probe.py" "${OVERRIDES[@]}" "${MODEL[@]}" \
          "${EXTRA[@]}" --job.log_every 5 --eval.every 0 --job.output_dir "$WORK/$name-syncs") >"$WORK/$name-syncs.log" 2>&1 \
       && syncs="$("$PYTHON" - "$WORK/rank0.json" "$STEPS" "$HALF" <<'PY'
import json, sys
report, steps, half = json.load(open(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3])
quiet = [s for s in range(1, steps + 1) if s % 5 and s % half and s != steps]
cuda = {int(s): sum(call.startswith("cuda ") for call in calls) for s, calls in report["sites"].items()}
print(f"syncs on rank 0: {report['steps']} (CUDA sync debug mode: {cuda})")
bad = {s: report["sites"][str(s)] for s in quiet if cuda.get(s)}
sys.exit(f"syncs on steps that do not report: {bad}" if bad else 0)
PY
)"; then
      echo "PASS $name $syncs"
    else
      failed=1
      echo "FAIL $name syncs per step: $(tail -n 3 "$WORK/$name-syncs.log")"
    fi
    if [[ "$OWN_TESTS" == 1 ]]; then
      if (cd "$project" && NPROC="$NPROC" "$PYTHON" -m pytest -q -p no:cacheprovider >"$WORK/$name-pytest.log" 2>&1); then
        echo "PASS $name own tests: $(tail -n 1 "$WORK/$name-pytest.log")"
      else
        failed=1
        echo "FAIL $name own tests: $(tail -n 1 "$WORK/$name-pytest.log")"
        tail -n 40 "$WORK/$name-pytest.log"
      fi
    fi
  else
    failed=1
    echo "FAIL $name device=$DEVICE nproc=$NPROC ${verdict:-}"
    tail -n 20 "$WORK/$name-"*.log 2>/dev/null || true
  fi
  verdict=""
done
exit "$failed"
