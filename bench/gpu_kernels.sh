#!/usr/bin/env bash
# The GPU machine's kernel run (issue 12): the GPU step's matvec kernels on a loaded model with every layer on the
# GPU (bench.gpu_kernels_ab: each distinct matvec of a token swept over launch shapes, then whole decode steps under
# the default launches, the candidate word reads and the best per matrix, interleaved, their greedy tokens compared),
# the same sweep at a 7B shape's matrices
# (bench.gpu_kernel_rates), and the CUDA tests of the GPU step. The model is `tandem synth` llama-1b, made there
# (no network; a run carries at most 64 MiB). Carried: STAGE (default .dev/k: tokenizer.gguf) and .dev/whl, staged here
# by `bash ../shared/gpu/stage.sh` and `mkdir -p .dev/k && python -c "from pathlib import Path as P; from
# bench.gpu_sparse_stage import tokenizer_only_gguf as t; t(P('models/SmolLM2-135M-Instruct.Q4_1.gguf'), P('.dev/k/tokenizer.gguf'))"`;
# then the run: `bash bench/gpu_kernels.sh` carrying .dev/whl and .dev/k (about 8 minutes).
# Writes $OUT/kernels_ab.md, $OUT/kernel_rates.md and $OUT/log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=${STAGE:-.dev/k}
export PYTHONUNBUFFERED=1
SHAPE=${SHAPE:-llama-1b}
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo; date -u
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .dev/whl/*.whl 2>&1 | tail -1
  export PYTHONPATH=/tmp/site:$PWD
  model=/tmp/synthm/$SHAPE-synthetic-s90.Q4_0.gguf
  if [ ! -f "$model" ]; then
    /usr/bin/time -f "synth %e s" python3 -m tandem.cli synth --shape "$SHAPE" --out /tmp/synthm --sparsity 0.9 \
      --tokenizer-from "$S/tokenizer.gguf" --quiet 2>&1 | tail -2
  fi
  timeout ${AB_TIMEOUT:-260} python3 -m bench.gpu_kernels_ab --model "$model" --rounds ${ROUNDS:-7} \
    --tokens ${TOKENS:-64} --threads ${THREADS:-8} --out "$OUT/kernels_ab.md" 2>"$OUT/kernels_ab.err"
  echo "kernels_ab rc=$?"; grep -v Warning "$OUT/kernels_ab.err" | tail -15
  # TESTS= (empty) leaves the tests out, RATES_SHAPE= the 7B-shape sweep
  if [ -n "${TESTS-1}" ]; then timeout ${TESTS_TIMEOUT:-120} python3 -m pytest -q -p no:cacheprovider --tb=line \
    tests/test_gpu_step.py tests/test_gpu_kernels.py tests/test_gpu_compile.py 2>&1 | grep -E "Error|^/|passed|failed" | sort | uniq -c | sort -rn | head -12; fi
  if [ -n "${RATES_SHAPE-llama-2-7b}" ]; then timeout ${RATES_TIMEOUT:-120} python3 -m bench.gpu_kernel_rates \
    --shape "${RATES_SHAPE-llama-2-7b}" --out "$OUT/kernel_rates.md" 2>"$OUT/kernel_rates.err"; echo "rates rc=$?"; fi
  date -u
} 2>&1 | tee "$OUT/log"
