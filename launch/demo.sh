#!/usr/bin/env bash
# Usage: bash launch/demo.sh            (NPROC=2 by default; CP degree = NPROC; RECIPE=recipes/demo.yaml)
# The embedded demo on CPU, no downloads: set up → make media + the recipe family's tiny pipeline (at the recipe's
# data.source and model.pretrained_path) → cache latents → CP training. Extra arguments go to the trainer.
set -euo pipefail
cd "$(dirname "$0")/.."
NPROC=${NPROC:-2}
RECIPE=${RECIPE:-recipes/demo.yaml}
bash launch/setup.sh
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} WANDB_SILENT=true
run() { echo "+ $*"; "$@"; }
run .venv/bin/python -m train.demo --recipe "$RECIPE"
run .venv/bin/python -m train.prepare --recipe "$RECIPE"
run .venv/bin/python -m train.launch --config_file configs/accelerate/cpu.yaml --num_processes "$NPROC" \
    train/finetune.py --recipe "$RECIPE" --set parallel.cp="$NPROC" "$@"
OUT=$(.venv/bin/python -c "from train.config import load_recipe; print(load_recipe('$RECIPE').output_dir)")
OUT="$OUT" .venv/bin/python - <<'PY'
import json, os
lines = [json.loads(l) for l in open(os.path.join(os.environ["OUT"], "metrics.jsonl"))]
first, last = lines[:10], lines[-10:]
mean = lambda xs: sum(x["loss"] for x in xs) / len(xs)
print(f"loss: first 10 steps {mean(first):.4f} → last 10 steps {mean(last):.4f} ({len(lines)} steps)")
PY
echo "metrics: $OUT/metrics.jsonl | report: $OUT/report.md | samples: $OUT/samples/step_*/ | wandb (offline): $OUT/wandb | weights: $OUT/transformer"
