#!/usr/bin/env bash
# Usage: RECIPE=recipes/tiny/wan.yaml NPROC=2 bash launch/single_node.sh [--set key=value ...]
# One machine. Uses the GPU accelerate config when a GPU is visible, else N CPU processes (gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
RECIPE=${RECIPE:-recipes/tiny/wan.yaml}
if [ -z "${ACCEL_CONFIG:-}" ]; then
  if .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    ACCEL_CONFIG=configs/accelerate/gpu_8.yaml; NPROC=${NPROC:-$(nvidia-smi -L | wc -l)}
  else
    ACCEL_CONFIG=configs/accelerate/cpu.yaml; NPROC=${NPROC:-2}
  fi
fi
CMD=(.venv/bin/python -m train.launch --config_file "$ACCEL_CONFIG" --num_processes "$NPROC" train/finetune.py --recipe "$RECIPE" "$@")
echo "+ ${CMD[*]}"
exec "${CMD[@]}"
