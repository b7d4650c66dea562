#!/usr/bin/env bash
# Train on this machine, one process per GPU.
#   scripts/run_local.sh                                  # 8 GPU(s)
#   NPROC=2 DEVICE=cpu scripts/run_local.sh --training.steps 5   # 2 CPU processes (gloo)
# Extra arguments are config overrides (--section.key VALUE) passed to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC="${NPROC:-8}"
DEVICE="${DEVICE:-auto}"
CONFIG="${CONFIG:-config.toml}"

# --standalone: a private rendezvous on a free local port, so several runs can share a machine.
exec torchrun --standalone --nproc-per-node "$NPROC" \
  train.py --config "$CONFIG" --job.device "$DEVICE" "$@"
