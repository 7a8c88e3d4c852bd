#!/usr/bin/env bash
# The GPU machine's run (../shared/gpu/README.md): CUDA tests of the GPU step, the GPU benchmark over plans
# made here (.dev/plans: `python -m bench.gpu_bench --gpu-device cpu --hardware h100 --work .dev/plans
# --tokens 2 --rounds 1` on the CPU tier; the machine has no network and planning there costs device time),
# a per-token profile, the probe (the GPU step's kernel latency included) and, with PEER=1, the
# transformers + CUDA graphs peer (PROBE=0 skips the probe; OMP_AB=1 adds bench.gpu_ab under three OpenMP wait settings). Writes $OUT/gpu.md, $OUT/h100-probed.json and $OUT/log. Expects
# PYTHONPATH with the staged wheels and models/ assembled.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
THREADS=${THREADS:-8}
{
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; nproc
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_kernels.py tests/test_gpu_step.py 2>&1 | tail -4
  timeout 300 python3 -m bench.gpu_bench --hardware h100 --reuse-plans --work .dev/plans --tokens ${TOKENS:-64} --rounds ${ROUNDS:-3} \
    --threads "$THREADS" --out "$OUT/gpu.md" 2>&1 | grep -v Warning
  for f in 1 0.5 0.25 0.1; do
    echo "profile plan-$f"; timeout 60 python3 -m bench.gpu_profile --plan .dev/plans/plan-$f --threads "$THREADS" 2>&1 | tail -3
  done
  [ "${PROBE:-1}" = 1 ] && timeout 120 python3 -m tandem.cli probe --threads "$THREADS" --out "$OUT/h100-probed.json" 2>&1 | tail -3
  [ -n "${PEER:-}" ] && timeout 200 python3 -m bench.hf_cuda_graph 2>&1 | tail -3
  # Gemma 3 270M when staged (bench/gpu_stage_model.sh; plans made here into .dev/g3plans, its profile carried)
  g3=models/gemma-3-270m-q4_k_m.gguf
  if [ -f "$g3" ] && [ -d .dev/g3plans ]; then
    timeout 300 python3 -m bench.gpu_bench --model "$g3" --profile profiles/gemma-3-270m-q4_k_m/profile --hardware h100 \
      --reuse-plans --work .dev/g3plans --tokens ${TOKENS:-64} --rounds ${ROUNDS:-3} --threads "$THREADS" \
      --out "$OUT/gpu_gemma3.md" 2>&1 | grep -v Warning
  fi
  # OMP_AB=1: plans vs layer offload interleaved under libgomp's default, a long spin count and active waiting
  if [ -n "${OMP_AB:-}" ]; then
    for env in "X=1" "GOMP_SPINCOUNT=20000000" "OMP_WAIT_POLICY=active"; do
      echo "A/B with $env"; env "$env" timeout 110 python3 -m bench.gpu_ab --plans .dev/plans --threads "$THREADS" 2>&1 | tail -4
    done
  fi
} 2>&1 | tee "$OUT/log"
