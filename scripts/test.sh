#!/usr/bin/env bash
# The test command (README): every test, CPU only. pytest's exit code 5 (no tests collected) fails.
# Tests run in pytest-xdist workers, a test file each at a time: one per core, at most 4 (SPECBATCH_TEST_WORKERS
# overrides; 0 runs them in this process), each computing on one thread (tests/conftest.py). Most of the suite waits
# on processes (Ray workers, jobs, S3) or computes with tiny models that one thread runs best.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WORKERS=${SPECBATCH_TEST_WORKERS:-$("$PY" -c 'import os
print(min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))')}
"$PY" -m pytest -q -n "$WORKERS" --dist loadfile --durations=15 "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit "$rc"
