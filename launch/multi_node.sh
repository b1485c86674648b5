#!/usr/bin/env bash
# Usage (on every node): NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 RECIPE=recipes/wan/14b_lora.yaml bash launch/multi_node.sh
# GPUs per node from nvidia-smi. Keep parallel.cp ≤ GPUs per node: CP groups are consecutive ranks, inside a node.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${NNODES:?}" "${NODE_RANK:?}" "${MASTER_ADDR:?}" "${RECIPE:?}"
GPUS=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
CMD=(.venv/bin/python -m train.launch --config_file configs/accelerate/multi_node.yaml --num_machines "$NNODES"
     --num_processes $((NNODES * GPUS)) --machine_rank "$NODE_RANK" --main_process_ip "$MASTER_ADDR"
     --main_process_port "${MASTER_PORT:-29500}" train/finetune.py --recipe "$RECIPE" "$@")
echo "+ ${CMD[*]}"
exec "${CMD[@]}"
