#!/usr/bin/env bash
# One-command GPU benchmark (see bench/gpu_bench.py): dense on the tier, layer offload, plans at
# 10/25/50/100% of the model's bytes -> bench/gpu.md. Without CUDA the rows run on the CPU tier and
# say so. Extra arguments go to bench.gpu_bench (e.g. --tokens 8 --rounds 1 --gpu-device cpu). SPARSE=<shape>
# adds plans with predictors on a synthetic ReLU-sparse model (below).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if [ ! -d profiles/SmolLM2-135M-Instruct.Q4_1/profile ]; then
  echo "bench/gpu.sh: no SmolLM2 profile yet; run 'make run' (or 'tandem prepare --model smollm2') first" >&2
  exit 2
fi
"$PY" -m bench.gpu_bench "$@"
# SPARSE=<synth shape> (make bench-gpu SPARSE=llama-350m): a ReLU-sparse synthetic model at 90% sparsity
# (made, profiled and its predictors trained once, under bench/synthetic-models), plans with predictors for
# this machine (probed) against layer offload, interleaved -> .dev/sparse-<shape>/gpu_sparse.md
if [ -n "${SPARSE:-}" ]; then
  "$PY" -m bench.gpu_sparse_stage --shape "$SPARSE" --hardware auto --no-wheel --out ".dev/sparse-$SPARSE"
  "$PY" -m bench.gpu_ab --stage ".dev/sparse-$SPARSE" --fractions 0,0.1,0.25,0.5,1 --rounds "${ROUNDS:-7}" \
    --out ".dev/sparse-$SPARSE/gpu_sparse.md"  # bench/gpu_sparse.md is the curated H200 record
fi
