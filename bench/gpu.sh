#!/usr/bin/env bash
# One-command GPU benchmark (see bench/gpu_bench.py): dense on the tier, layer offload, plans at
# 10/25/50/100% of the model's bytes -> bench/gpu.md. Without CUDA the rows run on the CPU tier and
# say so. Extra arguments go to bench.gpu_bench (e.g. --tokens 8 --rounds 1 --gpu-device cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ ! -d profiles/SmolLM2-135M-Instruct.Q4_1/profile ]; then
  echo "bench/gpu.sh: no SmolLM2 profile yet; run 'make run' (or 'tandem prepare --model smollm2') first" >&2
  exit 2
fi
exec "$PY" -m bench.gpu_bench "$@"
