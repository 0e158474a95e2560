#!/usr/bin/env bash
# Install specbatch and its test dependencies. torch is installed first and pinned to its CPU release on
# machines without an NVIDIA GPU (pip's own configuration says where packages come from).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.4"
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
"$PY" -m pip install -q -e '.[test]'
# the report test opens report.html in a real headless browser: Debian's chromium, where apt can install it
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) \
    || echo "install.sh: could not install chromium (tests/test_report.py needs it)" >&2
fi
