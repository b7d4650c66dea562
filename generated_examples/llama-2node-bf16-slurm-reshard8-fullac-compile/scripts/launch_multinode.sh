#!/usr/bin/env bash
# Train on 2 nodes x 8 GPUs. Run this same command on every node:
#   MASTER_ADDR=<node 0 hostname> MASTER_PORT=29500 NODE_RANK=<0..1> scripts/launch_multinode.sh
# Extra arguments are config overrides (--section.key VALUE) passed to train.py.
set -euo pipefail
cd "$(dirname "$0")/.."

: "${MASTER_ADDR:?set MASTER_ADDR to the hostname or IP of node 0}"
: "${MASTER_PORT:?set MASTER_PORT to a free TCP port on node 0, e.g. 29500}"
: "${NODE_RANK:?set NODE_RANK to the index of this node, 0 to 1}"
NNODES="${NNODES:-2}"
NPROC="${NPROC:-8}"
DEVICE="${DEVICE:-auto}"
CONFIG="${CONFIG:-config.toml}"

# Mistakes in the config, the data or the output folder stop here, once per node, with one line and exit
# code 2, before torchrun starts any rank (so they are neither printed per rank nor retried).
python preflight.py --world-size "$((NNODES * NPROC))" --config "$CONFIG" --job.device "$DEVICE" "$@"

# c10d rendezvous: node 0 hosts the store; every node must reach MASTER_ADDR:MASTER_PORT.
exec torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" --node-rank "$NODE_RANK" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${RDZV_ID:-llama-2node-bf16-slurm-reshard8-fullac-compile}" \
  train.py --config "$CONFIG" --job.device "$DEVICE" "$@"
