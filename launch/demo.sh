#!/usr/bin/env bash
# Usage: bash launch/demo.sh            (NPROC=2 by default; CP degree = NPROC)
# The embedded demo on CPU, no downloads: set up → make media + a tiny Wan pipeline → cache latents → CP training.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
bash launch/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_SILENT=true
run() { echo "+ $*"; "$@"; }
run .venv/bin/python -m train.demo --out outputs/demo/assets
run .venv/bin/python -m train.prepare --recipe recipes/demo.yaml
run .venv/bin/accelerate launch --config_file configs/accelerate/cpu.yaml --num_processes "$NPROC" \
    train/finetune.py --recipe recipes/demo.yaml --set parallel.cp="$NPROC" "$@"
.venv/bin/python - <<'PY'
import json
lines = [json.loads(l) for l in open("outputs/demo/run/metrics.jsonl")]
first, last = lines[:10], lines[-10:]
mean = lambda xs: sum(x["loss"] for x in xs) / len(xs)
print(f"loss: first 10 steps {mean(first):.4f} → last 10 steps {mean(last):.4f} ({len(lines)} steps)")
PY
echo "metrics: outputs/demo/run/metrics.jsonl | wandb (offline): outputs/demo/run/wandb | weights: outputs/demo/run/transformer"
