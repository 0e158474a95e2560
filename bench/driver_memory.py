"""Driver memory vs input size: the driver's input pass (scan: row counts, shard descriptions,
duplicate-id check) over N short rows, each size in a fresh process, peak RSS printed.

    python bench/driver_memory.py [--rows 10000,100000,1000000]

The driver keeps an 8-byte hash per row for the duplicate check and one small record per shard;
prompts are never held (workers read their own rows).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def child(path: str) -> None:
    from workers.inputs import scan

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    shards, total = scan(path, "id", 256)
    dt = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rows": total, "shards": len(shards), "peak_mb": peak / 1024,
                      "growth_mb": (peak - base) / 1024, "scan_s": dt}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="10000,100000,1000000")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    print(f"{'rows':>9s} {'shards':>7s} {'peak RSS MB':>12s} {'growth MB':>10s} {'bytes/row':>10s} {'scan s':>7s}")
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.rows.split(",")):
            path = os.path.join(tmp, f"rows{n}.jsonl")
            with open(path, "w") as f:
                for i in range(n):
                    f.write(json.dumps({"id": f"row-{i:09d}", "prompt": f"Say hello to person number {i}."}) + "\n")
            out = subprocess.run([sys.executable, __file__, "--child", path], capture_output=True, text=True,
                                 check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            r = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"{r['rows']:9d} {r['shards']:7d} {r['peak_mb']:12.1f} {r['growth_mb']:10.1f} "
                  f"{r['growth_mb'] * 2**20 / r['rows']:10.1f} {r['scan_s']:7.2f}")


if __name__ == "__main__":
    main()
