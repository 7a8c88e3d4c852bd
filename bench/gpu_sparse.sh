#!/usr/bin/env bash
# The GPU machine's run for a ReLU-sparse model (PowerInfer's case): plans with predictors against layer
# offload (llama.cpp's -ngl policy, dense CPU layers) at the same budgets, A/B interleaved (bench.gpu_ab).
# The machine has no network and a run carries at most 64 MiB, so the model is synthesized there from the
# same seed (the sha256 is checked against the one made here) and everything else is carried in .dev/sparse:
#   tokenizer.gguf (SmolLM2's tokenizer fields, no tensors), profile/, predictors/, plans/plan-<fraction>
#   (made here: `tandem plan --hardware h100 --predictors ...`), model.sha256, the gguf wheel.
# STAGE names another such folder, PREDICTORS the predictors where they came apart (a run carries 64 MiB:
# llama-1b's 63 MB of predictors travel in a run of their own, copied to /tmp there). OMP_ACTIVE=1 repeats the
# A/B with OpenMP's threads spinning; THERE=1 makes the profile, predictors and plans on that machine; KERNEL_RATES=1 times the matvec kernels alone (bench.gpu_kernel_rates). Writes $OUT/gpu_sparse.md (+ gpu_sparse_active.md) and $OUT/log.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
S=${STAGE:-.dev/sparse}
PRED=${PREDICTORS:-$S/predictors}
export PYTHONUNBUFFERED=1
THREADS=${THREADS:-8}
SHAPE=${SHAPE:-llama-350m}; SPARSITY=${SPARSITY:-0.9}; HOT_SHARE=${HOT_SHARE:-0.8}
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc; grep -m1 "model name" /proc/cpuinfo
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site "$S"/*.whl 2>&1 | tail -1
  export PYTHONPATH=/tmp/site:$PWD
  if [ -n "${THERE:-}" ]; then
    # THERE=1: profile, predictors and plans made on this machine too (pulp's wheel staged beside gguf's): for a
    # shape whose predictors do not travel (llama-2-7b: hundreds of MB), staged with only tokenizer.gguf + wheels
    stage=/tmp/stage-$SHAPE
    TANDEM_STEP_CACHE=0 /usr/bin/time -f "stage (synth, profile, predictors, plans) %e s" python3 -m bench.gpu_sparse_stage \
      --shape "$SHAPE" --sparsity "$SPARSITY" --models-dir /tmp/synthm --tokenizer "$S/tokenizer.gguf" --no-wheel \
      --fractions "${FRACTIONS:-0,0.25}" --hardware "${HARDWARE:-h100}" --out "$stage" 2>&1 | tail -3
    timeout ${AB_TIMEOUT:-330} python3 -m bench.gpu_ab --stage "$stage" --fractions "${FRACTIONS:-0,0.25}" \
      --rounds ${ROUNDS:-5} --tokens ${TOKENS:-64} --threads "$THREADS" --out "$OUT/gpu_sparse.md" 2>&1 | grep -v Warning
    exit 0
  fi
  model=/tmp/synthm/$SHAPE-synthetic-s$(python3 -c "print(round($SPARSITY*100))").Q4_0.gguf
  if [ ! -f "$model" ]; then
    /usr/bin/time -f "synth %e s" python3 -m tandem.cli synth --shape "$SHAPE" --out /tmp/synthm --sparsity "$SPARSITY" \
      --hot-share "$HOT_SHARE" --tokenizer-from "$S/tokenizer.gguf" --quiet | tail -1
  fi
  [ "$(sha256sum "$model" | cut -d' ' -f1)" = "$(cat "$S/model.sha256")" ] && echo "model sha256 matches the one made here" \
    || echo "MODEL SHA256 DIFFERS from the one made here"
  timeout ${AB_TIMEOUT:-330} python3 -m bench.gpu_ab --model "$model" --profile "$S/profile" --predictors "$PRED" \
    --plans "$S/plans" --fractions ${FRACTIONS:-0,0.1,0.25,0.5,1} --rounds ${ROUNDS:-7} --tokens ${TOKENS:-64} \
    --threads "$THREADS" --out "$OUT/gpu_sparse.md" 2>&1 | grep -v Warning
  if [ -n "${PROFILE_PLAN:-}" ]; then timeout 60 python3 -m bench.gpu_profile --model "$model" --profile "$S/profile" \
    --predictors "$PRED" --plan "$S/plans/plan-$PROFILE_PLAN" --threads "$THREADS" 2>&1 | tail -4; fi
  if [ -n "${OMP_ACTIVE:-}" ]; then
    echo "A/B with OMP_WAIT_POLICY=active"
    OMP_WAIT_POLICY=active timeout ${ACTIVE_TIMEOUT:-200} python3 -m bench.gpu_ab --model "$model" --profile "$S/profile" \
      --predictors "$PRED" --plans "$S/plans" --fractions ${ACTIVE_FRACTIONS:-0,0.1,0.25,0.5} --rounds 5 \
      --tokens ${TOKENS:-64} --threads "$THREADS" --out "$OUT/gpu_sparse_active.md" 2>&1 | grep -v Warning
  fi
  # KERNEL_RATES=1: the matvec kernels alone at the shape's matrices, default and other launch shapes
  if [ -n "${KERNEL_RATES:-}" ]; then timeout ${KERNEL_TIMEOUT:-300} python3 -m bench.gpu_kernel_rates --shape "$SHAPE" \
    --out "$OUT/gpu_kernel_rates.md" 2>&1 | grep -v "failed (" | tail -8; fi
  if [ -n "${TESTS:-}" ]; then timeout ${TESTS_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider --tb=line \
    tests/test_gpu_step.py tests/test_gpu_kernels.py 2>&1 | grep -E "Error|^/|passed|failed" | sort | uniq -c | sort -rn | head -12; fi
} 2>&1 | tee "$OUT/log"
