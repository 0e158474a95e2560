#!/usr/bin/env bash
# Install specbatch and its test dependencies. torch is installed first and pinned to the CPU build on
# machines without an NVIDIA GPU, so pip never pulls a multi-GB CUDA build where it cannot be used.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.4"
  elif "$PY" -c "import socket; socket.getaddrinfo('download.pytorch.org', 443)" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  else
    # No route to PyTorch's index (a mirror-only machine): its configured index serves the CPU build.
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
"$PY" -m pip install -q -e '.[test]'
