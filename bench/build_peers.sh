#!/usr/bin/env bash
# Builds the performance peer (llama.cpp via llama-cpp-python) into bench/peers/venv, with the extras of
# its OpenAI-compatible server (the peer of bench/serve_load.py).
# Benchmark environment only: never used by tests. Takes ~12-15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"
VENV=peers/venv
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "llama-cpp-python already built in bench/$VENV"
else
  mkdir -p peers
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$VENV/bin/pip" install -q --no-cache-dir "llama-cpp-python==0.3.36"
fi
# (llama_cpp.server imports without its extras; its app needs uvicorn, fastapi, sse-starlette)
if ! "$VENV/bin/python" -c "import llama_cpp.server.app, uvicorn, sse_starlette" 2>/dev/null; then
  # the [server] extras only (uvicorn, fastapi, sse-starlette, ...); the built wheel above is kept
  CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
    "$VENV/bin/pip" install -q "llama-cpp-python[server]==0.3.36"
fi
"$VENV/bin/python" -c "import llama_cpp, llama_cpp.server.app, uvicorn; print('llama-cpp-python', llama_cpp.__version__, '+ server')"
