#!/usr/bin/env bash
# The test command (README): every test, CPU only. pytest's exit code 5 (no tests collected) fails.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
