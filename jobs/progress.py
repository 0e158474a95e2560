"""A run's progress bar and its summary.

Two throughput figures, named alike here, in `specbatch status` and in `specbatch report`:
`job_tokens_per_s`, output tokens per second of the job's wall-clock time (Ray's start, model loading and
every worker included: what a user waits for), and `worker_tokens_per_s`, output tokens per second a worker
spent on its parts (reading, generating, writing: what a worker-hour buys).
"""

from __future__ import annotations

import sys
import time
from collections import Counter

from .manifest import error_counts, rate


class Progress:
    """What this run's committed parts added up to, shown on a bar (rows, job tokens/s, acceptance, ETA)."""

    def __init__(self, total: int, done: int, enabled: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="row", disable=not enabled, file=sys.stderr,
                        dynamic_ncols=True, desc="specbatch")
        self.t0 = time.perf_counter()
        self.tokens = self.rounds = self.drafted = self.accepted = self.rows = 0
        self.worker_s = 0.0  # seconds workers spent on this run's parts
        self.errors: Counter[str] = Counter()  # error rows by reason
        self.peaks: dict[str, int] = {}  # peak GPU memory per worker
        self.paths: set[str] = set()  # how workers ran their steps
        self.workers: set[str] = set()  # worker processes that committed parts (restarts are new ones)
        self.hangs = 0
        self.retried = 0  # shards run again: their worker's process died, or its node left the cluster
        self.live = self.nodes_lost = self.workers_started = self.workers_added = 0
        self.postfix: dict[str, str] = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def add(self, res: dict) -> None:
        """A part a worker committed (its `process` result)."""
        self.rows += res["rows"]
        self.paths.add(res["step_path"])
        self.workers.add(res["worker"])
        if res["peak_gpu_bytes"] is not None:
            self.peaks[res["worker"]] = max(self.peaks.get(res["worker"], 0), res["peak_gpu_bytes"])
        self.errors.update(res["errors"])
        self.tokens += res["generated_tokens"]
        self.worker_s += res["wall_s"]
        self.rounds += res["rounds"]
        self.drafted += res["drafted_tokens"]
        self.accepted += res["accepted_tokens"]
        self.bar.update(res["rows"])
        self.postfix["job tok/s"] = f"{self.tokens / max(1e-9, self.elapsed()):.1f}"
        if self.drafted:
            self.postfix["accept"] = f"{self.accepted / self.drafted:.2f}"
        self.bar.set_postfix(self.postfix, refresh=False)

    def cluster(self, live: int, nodes_lost: int, started: int, added: int) -> None:
        """The pool as it stands: workers live (shown on the bar), nodes lost, workers started so far, and those that
        loaded their models once shards were under way (on nodes that joined, replacements)."""
        if live != self.live:
            self.postfix["workers"] = str(live)
            self.bar.set_postfix(self.postfix)
        self.live, self.nodes_lost, self.workers_started, self.workers_added = live, nodes_lost, started, added

    def say(self, text: str) -> None:
        """A line above the bar."""
        self.bar.write(text, file=sys.stderr)

    def close(self) -> None:
        self.bar.close()

    def summary(self, manifest: dict, resumed: int) -> dict:
        """The run's summary: rows (this run, earlier runs, failed by reason), workers, this run's tokens and
        throughput, acceptance, how steps ran."""
        dt = self.elapsed()
        return {
            "rows_total": manifest["input"]["rows"],
            "rows_committed": sum(p["rows"] for p in manifest["parts"].values()),
            "rows_from_earlier_runs": resumed,
            "rows_this_run": self.rows,
            "rows_failed_this_run": sum(self.errors.values()),
            "errors_by_reason": error_counts(manifest),
            "worker_processes": len(self.workers),
            "workers_killed_for_no_progress": self.hangs,
            "workers_started": self.workers_started,
            "workers_added_mid_job": self.workers_added,
            "nodes_lost": self.nodes_lost,
            "shards_retried": self.retried,
            "generated_tokens": self.tokens,
            "job_tokens_per_s": rate(self.tokens, dt) or 0.0,
            "worker_tokens_per_s": rate(self.tokens, self.worker_s),
            "mean_accepted_length": self.tokens / self.rounds if self.rounds else None,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else None,
            "wall_s": dt,
            "parts": len(manifest["parts"]),
            "step_path": ",".join(sorted(self.paths)) or None,
            "peak_gpu_gib_per_worker": {w: round(b / (1 << 30), 2) for w, b in sorted(self.peaks.items())},
        }
