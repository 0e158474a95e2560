"""Inputs at scale: the driver's scan (shard offsets, duplicate-id check) and a worker's read of the first,
middle and last shard, for jsonl and Parquet inputs of N rows, local and on a moto S3 server on loopback.

    python bench/input_scale.py [--rows 1000000,10000000] [--formats jsonl,parquet] [--where local,s3]

Each measurement runs in a fresh process: scan seconds, the driver's peak RSS growth over the scan
(and per row), and the seconds to read each of three shards (`shard_size` 256). A shard is read from
the offset the scan recorded (a seek locally, a ranged GET on S3), so the last costs what the first
does. The last lines project the scan's time and memory to 100M rows, linearly from the largest size.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child(path: str) -> None:
    import threading

    import psutil

    from workers.inputs import read_shard, scan

    proc, peak, done = psutil.Process(), [0], threading.Event()

    def sample():  # the process's resident memory every 10 ms: its peak over the scan
        while not done.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.01)

    base = proc.memory_info().rss
    sampler = threading.Thread(target=sample)
    sampler.start()
    t = time.perf_counter()
    shards, total = scan(path, "id", 256)
    scan_s = time.perf_counter() - t
    done.set()
    sampler.join()
    reads = []
    for s in (shards[0], shards[len(shards) // 2], shards[-1]):
        t = time.perf_counter()
        rows = read_shard(s, "id", ["id", "prompt"])
        reads.append(time.perf_counter() - t)
        assert len(rows) == s.end - s.start
    print(json.dumps({"rows": total, "shards": len(shards), "scan_s": scan_s, "growth_mb": (peak[0] - base) / 2**20,
                      "reads": reads}))


def write_input(folder: str, n: int, fmt: str) -> str:
    path = os.path.join(folder, f"rows{n}.{fmt}")
    if fmt == "jsonl":
        with open(path, "w") as f:
            for i in range(n):
                f.write(json.dumps({"id": f"row-{i:09d}", "prompt": f"Say hello to person number {i}."}) + "\n")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        chunk = 1_000_000
        writer = None
        for start in range(0, n, chunk):
            ids = [f"row-{i:09d}" for i in range(start, min(n, start + chunk))]
            table = pa.table({"id": ids, "prompt": [f"Say hello to person number {i}." for i in
                                                    range(start, start + len(ids))]})
            writer = writer or pq.ParquetWriter(path, table.schema)
            writer.write_table(table, row_group_size=65536)
        writer.close()
    return path


def moto_server() -> tuple[object, dict]:
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "bench",
           "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}
    return server, env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1000000,10000000")
    ap.add_argument("--formats", default="jsonl,parquet")
    ap.add_argument("--where", default="local,s3")
    ap.add_argument("--child")
    args = ap.parse_args()
    if args.child:
        return child(args.child)
    server, s3env = moto_server() if "s3" in args.where else (None, {})
    if server:
        import boto3
        client = boto3.client("s3", **{"endpoint_url": s3env["AWS_ENDPOINT_URL"], "region_name": "us-east-1",
                                       "aws_access_key_id": "bench", "aws_secret_access_key": "bench"})
        client.create_bucket(Bucket="bench")
    print(f"{'rows':>9s} {'format':>7s} {'where':>5s} {'shards':>7s} {'scan s':>7s} {'growth MB':>10s} "
          f"{'B/row':>6s} {'first ms':>9s} {'middle ms':>10s} {'last ms':>8s}", flush=True)
    largest = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in args.rows.split(",")):
            for fmt in args.formats.split(","):
                path = write_input(tmp, n, fmt)
                for where in args.where.split(","):
                    target, env = path, dict(os.environ)
                    if where == "s3":
                        client.upload_file(path, "bench", os.path.basename(path))
                        target, env = f"s3://bench/{os.path.basename(path)}", {**env, **s3env}
                    out = subprocess.run([sys.executable, __file__, "--child", target], capture_output=True,
                                         text=True, cwd=ROOT, env=env)
                    if out.returncode:
                        print(out.stderr[-2000:])
                        raise SystemExit(out.returncode)
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    first, middle, last = (1e3 * x for x in r["reads"])
                    print(f"{r['rows']:9d} {fmt:>7s} {where:>5s} {r['shards']:7d} {r['scan_s']:7.1f} "
                          f"{r['growth_mb']:10.1f} {r['growth_mb'] * 2**20 / r['rows']:6.1f} {first:9.1f} "
                          f"{middle:10.1f} {last:8.1f}", flush=True)
                    largest[(fmt, where)] = r
                    if where == "s3":
                        client.delete_object(Bucket="bench", Key=os.path.basename(path))
                os.remove(path)
    for (fmt, where), r in sorted(largest.items()):
        f = 100_000_000 / r["rows"]
        print(f"# projected to 100M rows ({fmt}, {where}): scan {r['scan_s'] * f / 60:.0f} min, "
              f"driver memory +{r['growth_mb'] * f / 1024:.1f} GB, {r['shards'] * f:.0f} shards")
    if server:
        server.stop()


if __name__ == "__main__":
    main()
