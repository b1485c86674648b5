#!/usr/bin/env bash
# Usage (on every node): NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 RECIPE=recipes/wan/14b_lora.yaml bash launch/multi_node.sh [--set key=value ...]
#        NNODES=2 MASTER_ADDR=host0 GPUS_PER_NODE=8 RECIPE=... bash launch/multi_node.sh --dry-run [--set ...]
#          (prints the exact command of each node, or of NODE_RANK's only when set, and exits 0)
# GPUs per node: GPUS_PER_NODE, else nvidia-smi. MASTER_PORT defaults to 29500. Global ranks are node-major
# (node R runs ranks R×GPUS … R×GPUS+GPUS-1) and CP groups are consecutive ranks (train/parallel.py), so with
# parallel.cp ≤ GPUs per node (and dividing it) every CP group's all-to-alls stay inside one node.
set -euo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
: "${NNODES:?}" "${MASTER_ADDR:?}" "${RECIPE:?}"
[ "$DRY_RUN" = 1 ] || : "${NODE_RANK:?}"
GPUS=${GPUS_PER_NODE:-$(nvidia-smi -L | wc -l)}
command_for() {  # CMD = the launch command of node $1 (the trainer gets the rest of the arguments)
  local rank=$1; shift
  CMD=(.venv/bin/python -m train.launch --config_file configs/accelerate/multi_node.yaml --num_machines "$NNODES"
       --num_processes $((NNODES * GPUS)) --machine_rank "$rank" --main_process_ip "$MASTER_ADDR"
       --main_process_port "${MASTER_PORT:-29500}" train/finetune.py --recipe "$RECIPE" "$@")
}
if [ "$DRY_RUN" = 1 ]; then
  for rank in ${NODE_RANK:-$(seq 0 $((NNODES - 1)))}; do
    command_for "$rank" "$@"
    line=$(printf '%q ' "${CMD[@]}")
    echo "node $rank: ${line% }"
  done
  exit 0
fi
command_for "$NODE_RANK" "$@"
echo "+ ${CMD[*]}"
exec "${CMD[@]}"
