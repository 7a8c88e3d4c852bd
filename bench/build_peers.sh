#!/usr/bin/env bash
# Builds the performance peer (llama.cpp via llama-cpp-python) into bench/peers/venv, with the extras of
# its OpenAI-compatible server (the peer of bench/serve_load.py).
# Benchmark environment only: never used by tests. Takes ~12-15 minutes on 2 cores.
#
# On CPUs with AMX (Sapphire Rapids on) the native build's AMX matrix kernels die with SIGILL at their first
# tile load (llama-cpp-python 0.3.36, measured 2026-11-28 on a 2-core Xeon VM, also with the process's tile
# permission granted), so there the build keeps -march=native minus AMX: llama.cpp then runs its
# AVX-512 / VNNI kernels, its fastest that work here. The flags it was built with are in peers/venv/.build-flags.
set -euo pipefail
cd "$(dirname "$0")"
VENV=peers/venv
FLAGS="-DGGML_NATIVE=ON"
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  FLAGS="$FLAGS -DCMAKE_C_FLAGS='$NO_AMX' -DCMAKE_CXX_FLAGS='$NO_AMX'"
fi
built_with=$(cat "$VENV/.build-flags" 2>/dev/null || echo "-DGGML_NATIVE=ON")
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null && [ "$built_with" = "$FLAGS" ]; then
  echo "llama-cpp-python already built in bench/$VENV ($FLAGS)"
else
  mkdir -p peers
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$VENV/bin/pip" install -q --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
  "$VENV/bin/pip" install -q "llama-cpp-python==0.3.36"  # its dependencies (the built wheel is kept)
  echo "$FLAGS" > "$VENV/.build-flags"
fi
# (llama_cpp.server imports without its extras; its app needs uvicorn, fastapi, sse-starlette)
if ! "$VENV/bin/python" -c "import llama_cpp.server.app, uvicorn, sse_starlette" 2>/dev/null; then
  # the [server] extras only (uvicorn, fastapi, sse-starlette, ...); the built wheel above is kept
  CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$VENV/bin/pip" install -q "llama-cpp-python[server]==0.3.36"
fi
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server.app, uvicorn; print('llama-cpp-python', llama_cpp.__version__, '+ server')"
