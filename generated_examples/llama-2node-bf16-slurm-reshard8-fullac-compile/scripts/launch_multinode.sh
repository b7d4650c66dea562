#!/usr/bin/env bash
# Train on 2 nodes x 8 GPUs. Run this same command on every node:
#   MASTER_ADDR=<node 0 hostname> MASTER_PORT=29500 NODE_RANK=<0..1> scripts/launch_multinode.sh
# Extra arguments are config overrides (--section.key VALUE) passed to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/restarts.sh

: "${MASTER_ADDR:?set MASTER_ADDR to the hostname or IP of node 0}"
: "${MASTER_PORT:?set MASTER_PORT to a free TCP port on node 0, e.g. 29500}"
: "${NODE_RANK:?set NODE_RANK to the index of this node, 0 to 1}"
NNODES="${NNODES:-2}"
NPROC="${NPROC:-8}"
DEVICE="${DEVICE:-auto}"
CONFIG="${CONFIG:-config.toml}"
# If training fails, every node starts its ranks again (they meet at MASTER_ADDR:MASTER_PORT), up to
# MAX_RESTARTS times, and they resume from the newest complete checkpoint. Mistakes in the input are never
# retried (exit code 2).
MAX_RESTARTS="${MAX_RESTARTS:-1}"
# A mistake in these is one line and exit code 2 here, before anything starts.
require_count NNODES 1 100000 2
require_count NODE_RANK 0 "$((NNODES - 1))" 0
require_count NPROC 1 4096 8
require_count MASTER_PORT 1 65535 29500
require_count MAX_RESTARTS 0 1000 1
require_choice DEVICE auto cpu cuda

# A launch id per node (run.json records those of all nodes: a restart continues this launch's run whichever
# node its rank 0 lands on); the ranks of this node die with this script.
start_launch "$(python -c 'import uuid; print(uuid.uuid4().hex)')" "$(mktemp -d)"
trap 'rm -rf "$TRAIN_USAGE_ERRORS"' EXIT
watch_this_script

# Mistakes in the config, the data or the output folder stop here, once per node, with one line and exit
# code 2, before torchrun starts any rank (so they are neither printed per rank nor retried). preflight.py's own
# option first, then exactly train.py's arguments, which it parses with train.py's parser.
LOCAL_WORLD_SIZE="$NPROC" python preflight.py --world-size "$((NNODES * NPROC))" --config "$CONFIG" --job.device "$DEVICE" "$@"

# One torchrun per attempt. c10d rendezvous: node 0 hosts the store; every node must reach
# MASTER_ADDR:MASTER_PORT.
train_with_restarts "$MAX_RESTARTS" torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" --node-rank "$NODE_RANK" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-llama-2node-bf16-slurm-reshard8-fullac-compile}" \
  --max-restarts 0 train.py --config "$CONFIG" --job.device "$DEVICE" "$@"
