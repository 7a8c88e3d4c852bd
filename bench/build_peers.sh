#!/usr/bin/env bash
# Builds the performance peer (llama.cpp via llama-cpp-python) into bench/peers/venv.
# Benchmark environment only: never used by tests. Takes ~12-15 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")"
VENV=peers/venv
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp" 2>/dev/null; then
  echo "llama-cpp-python already built in bench/$VENV"; exit 0
fi
mkdir -p peers
python3 -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade pip
CMAKE_ARGS="-DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL=2 \
  "$VENV/bin/pip" install -q --no-cache-dir "llama-cpp-python==0.3.36"
"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
