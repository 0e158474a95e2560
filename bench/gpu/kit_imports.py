"""Imports what the kit's stages import, in one process: the engine, the target's lookup, the GPU test files
(collected as `pytest --co` does) and the bench scripts the stages run, up to their --help.
tests/test_gpu_kit.py runs it under the image's view (view/sitecustomize.py); exit 0: all imported."""

from __future__ import annotations

import os
import re
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_test_files() -> list[str]:
    """The test files run.sh runs on the GPU (its TESTS line)."""
    with open(os.path.join(ROOT, "bench", "gpu", "run.sh")) as f:
        return re.search(r'^TESTS="([^"]+)"', f.read(), re.M).group(1).replace("+", " ").split()


def main() -> None:
    os.chdir(ROOT)
    sys.path.insert(0, ROOT)
    import pytest

    import specdec.engine  # noqa: F401
    import workers.fetch  # noqa: F401  (the third stage finds the target through it)

    rc = pytest.main(["--co", "-q", "-p", "no:cacheprovider", *gpu_test_files()])
    if rc != 0:
        sys.exit(f"kit_imports: pytest could not collect the GPU tests (exit {rc})")
    for script in ("bench/step_speed.py", "bench/policies.py", "bench/round_profile.py", "bench/paged_attention.py",
                   "bench/shape_pair.py", "bench/greedy_equality.py", "bench/gemv.py"):
        sys.argv = [script, "--help"]
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as exc:
            if exc.code not in (0, None):
                sys.exit(f"kit_imports: {script} --help exited {exc.code}")
    print("kit_imports: every import of the kit's stages succeeded")


if __name__ == "__main__":
    main()
