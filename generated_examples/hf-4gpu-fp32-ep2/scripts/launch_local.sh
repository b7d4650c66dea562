#!/usr/bin/env bash
# Train on this machine, one process per GPU.
#   scripts/launch_local.sh                                  # 4 GPU(s)
#   NPROC=2 DEVICE=cpu scripts/launch_local.sh --training.steps 5   # 2 CPU processes (gloo)
#   MAX_RESTARTS=0 scripts/launch_local.sh                   # fail at once, without the automatic restart
# Extra arguments are config overrides (--section.key VALUE) passed to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/restarts.sh

NPROC="${NPROC:-4}"
DEVICE="${DEVICE:-auto}"
CONFIG="${CONFIG:-config.toml}"
# If a rank dies, every rank is stopped and started again, up to MAX_RESTARTS times; they resume from the
# newest complete checkpoint. One restart by default: it rescues a long run from a one-off failure (a killed
# process, a GPU or network hiccup) at the cost of at most one checkpoint interval. Mistakes in the input are
# never retried (exit code 2).
MAX_RESTARTS="${MAX_RESTARTS:-1}"
# A mistake in these is one line and exit code 2 here, before anything starts.
require_count NPROC 1 4096 4
require_count MAX_RESTARTS 0 1000 1
require_choice DEVICE auto cpu cuda

# A launch of its own: its restarts continue the run it starts, never another; its ranks die with this script.
start_launch "$(python -c 'import uuid; print(uuid.uuid4().hex)')" "$(mktemp -d)"
trap 'rm -rf "$TRAIN_USAGE_ERRORS"' EXIT
watch_this_script

# Mistakes in the config, the data or the output folder stop here, once, with one line and exit code 2,
# before torchrun starts any rank (so they are neither printed per rank nor retried). preflight.py's own option
# first, then exactly train.py's arguments, which it parses with train.py's parser.
python preflight.py --world-size "$NPROC" --config "$CONFIG" --job.device "$DEVICE" "$@"

# One torchrun per attempt. --standalone: a private rendezvous on a free local port, so several runs can share
# a machine.
train_with_restarts "$MAX_RESTARTS" torchrun --standalone --nproc-per-node "$NPROC" --max-restarts 0 \
  train.py --config "$CONFIG" --job.device "$DEVICE" "$@"
