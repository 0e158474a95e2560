#!/usr/bin/env bash
# Install specbatch and its test dependencies. torch is installed first and pinned to its CPU release on
# machines without an NVIDIA GPU (pip's own configuration says where packages come from).
# SPECBATCH_INSTALL=dev|production (default dev): dev installs this checkout editable with its test extra (and a
# browser for the report test); production installs `.` alone, without them (the image: deploy/Dockerfile).
# SPECBATCH_TORCH=auto|cuda|cpu (default auto) picks the torch build when none is installed yet: auto looks
# for nvidia-smi; cuda installs a CUDA build where no GPU is visible (a docker build: deploy/Dockerfile), and
# fails unless the torch it ends with is a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${SPECBATCH_TORCH:-auto}
MODE=${SPECBATCH_INSTALL:-dev}
case "$MODE" in
  dev|production) ;;
  *) echo "install.sh: SPECBATCH_INSTALL must be dev or production, not '$MODE'" >&2; exit 2 ;;
esac
case "$TORCH" in
  auto) if command -v nvidia-smi >/dev/null 2>&1; then TORCH=cuda; else TORCH=cpu; fi ;;
  cuda|cpu) ;;
  *) echo "install.sh: SPECBATCH_TORCH must be auto, cuda or cpu, not '$TORCH'" >&2; exit 2 ;;
esac
if ! "$PY" -c "import torch" 2>/dev/null; then
  if [ "$TORCH" = cuda ]; then
    "$PY" -m pip install -q "torch>=2.4"
  else
    "$PY" -m pip install -q torch==2.13.0
  fi
fi
if [ "${SPECBATCH_TORCH:-auto}" = cuda ] && ! "$PY" -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
  echo "install.sh: SPECBATCH_TORCH=cuda, but the torch installed has no CUDA (pip's configured index served" \
       "a CPU-only build, or one was installed already)" >&2
  exit 1
fi
if [ "$MODE" = production ]; then
  "$PY" -m pip install -q .
  exit 0
fi
"$PY" -m pip install -q -e '.[test]'
# the report test opens report.html in a real headless browser: Debian's chromium, where apt can install it
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq chromium >/dev/null 2>&1)) \
    || echo "install.sh: could not install chromium (tests/test_report.py needs it)" >&2
fi
