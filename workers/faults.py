"""Test hooks, all of them: faults a test asks for through environment variables, fired in whichever process
reaches them (the driver, a worker, a tensor-parallel rank). Unset, every hook is off.

- `SPECBATCH_FAULT_<NAME>=MARKER`: `once(NAME)` is true the first time any process reaches it (it creates the
  file MARKER), so a fault fires once per test even across worker restarts. Names: `EXIT_IN_INIT` (a worker
  dies while loading its models), `EXIT_ONCE` (dies mid-shard, before committing), `HANG_ONCE` (stops making
  progress), `RANK_EXIT` (rank 1 of a tensor-parallel group dies at its 5th step).
- `SPECBATCH_FAULT_GATE=DIR`: `gate(phase)` stops a worker at a point of its life (`init`: models loaded, not
  ready yet; `process`: a shard generated, not committed) until a test has looked at it: it writes
  `DIR/<pid>.<phase>` (holding its Ray node's id) and waits until that file is gone (the test removed it, or killed the process);
  `DIR/open` turns the gate off.
- `SPECBATCH_FAULT_OOM_ROWS=N`: `oom_rows()`; a worker's batches of more than N rows run out of memory.
- `SPECBATCH_FAULT_FASTPATH=raise|nan`: `step_fault()` (each worker gives it to its engines) makes the first step
  of every shape on the fast path fail (raise: capture or compilation fails; nan: non-finite logits), through the
  engine's `step_fault` hook (specdec/exec/runner.py); on CPU the runners then take the static steps, to have them
  fail.
- `SPECBATCH_STORAGE_FAULTS="put:2,get:1"`: `storage(kind)` is true for the next N storage calls of that kind
  (put, get, head, list, delete) in this process, which then fail as a transient error would (workers/storage.py).
"""

from __future__ import annotations

import os
import time

_storage_left: dict[str, int] | None = None  # storage faults still to fire in this process, by kind


def once(name: str) -> bool:
    """True once per marker file named by SPECBATCH_FAULT_<NAME> (created on first use)."""
    marker = os.environ.get(f"SPECBATCH_FAULT_{name}")
    if not marker:
        return False
    try:  # create-only: of two workers reaching it at once, exactly one fires
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def gate(phase: str) -> None:
    """Wait at the gate SPECBATCH_FAULT_GATE for a test to release (or kill) this process."""
    folder = os.environ.get("SPECBATCH_FAULT_GATE")
    if not folder or os.path.exists(os.path.join(folder, "open")):
        return
    stop = os.path.join(folder, f"{os.getpid()}.{phase}")
    with open(stop + ".tmp", "w") as f:
        f.write(_node_id())
    os.rename(stop + ".tmp", stop)  # seen whole or not at all
    while os.path.exists(stop) and not os.path.exists(os.path.join(folder, "open")):
        time.sleep(0.01)


def _node_id() -> str:
    """This process's Ray node (hex), or '' outside Ray."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id() or ""
    except Exception:
        return ""


def oom_rows() -> int:
    """N of SPECBATCH_FAULT_OOM_ROWS (0: off)."""
    return int(os.environ.get("SPECBATCH_FAULT_OOM_ROWS", "0"))


def step_fault():
    """The engine's `step_fault` hook from this process's environment (SPECBATCH_FAULT_FASTPATH; None: off)."""
    mode = os.environ.get("SPECBATCH_FAULT_FASTPATH")
    return (lambda key: mode) if mode else None


def storage(kind: str) -> bool:
    """Whether this storage call of `kind` fails (SPECBATCH_STORAGE_FAULTS, read at the first call)."""
    global _storage_left
    if _storage_left is None:
        _storage_left = {}
        for item in filter(None, os.environ.get("SPECBATCH_STORAGE_FAULTS", "").split(",")):
            op, _, n = item.partition(":")
            _storage_left[op.strip()] = int(n or 1)
    if _storage_left.get(kind, 0) > 0:
        _storage_left[kind] -= 1
        return True
    return False


def storage_left() -> dict[str, int]:
    """The storage faults this process has still to fire, by kind."""
    return dict(_storage_left or {})

