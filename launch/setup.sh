#!/usr/bin/env bash
# Usage: bash launch/setup.sh      — create .venv and install pinned dependencies (idempotent).
# CPU machines get the CPU torch 2.13.0; on a GPU machine install your CUDA torch==2.13.0 into .venv first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q -r requirements.txt
.venv/bin/python -m pip install -q --no-deps -e .
echo "setup done: $(.venv/bin/python -c 'import torch, diffusers; print("torch", torch.__version__, "diffusers", diffusers.__version__)')"
