"""A node's preflight on the workers' side (`specbatch check`): the models' sources resolve there, and the
output prefix takes a conditional (create-only) PUT and a ranged GET of a probe object, deleted after.
Checks are specdec/exec/preflight.py's dicts: `check`, `result`, `ok`.
"""

from __future__ import annotations

import os
import socket
import uuid

from specdec.exec.preflight import row

from .spec import models_used
from .storage import open_input, open_storage


def device_name(device) -> str:
    """"cuda: <GPU name>" or "cpu: <CPU model>": what the report prices a worker-hour by."""
    import torch

    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform

        model = platform.processor() or platform.machine()
    return f"cpu: {model}"


def node_checks(models=None, speculation=None) -> list[dict]:
    """This node's devices and, given the job's models, each model source it uses fetched into this node's
    cache (or found) here."""
    import torch

    from .fetch import localize, source_kind

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out = [row("devices", ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names)), True)]
    else:
        out = [row("devices", f"{device_name(torch.device('cpu'))} (no GPU)", True)]
    if models is None:
        return out
    for key, src in models_used(models, speculation).items():
        try:
            local = localize(src, key)
            out.append(row(f"model {key}", f"{source_kind(src.path)}: {src.path} -> {local.path}", True))
        except Exception as exc:  # noqa: BLE001 - what failed is the finding
            out.append(row(f"model {key}", f"{type(exc).__name__}: {exc}", False))
    return out


def storage_probe(uri: str) -> dict:
    """Write a probe object under the output prefix create-only, check that a second create-only write is
    refused and that a ranged read returns its bytes, then delete it."""
    name = f"_check-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    data = bytes(range(256)) * 16
    try:
        st = open_storage(uri)
        if not st.put_if_absent(name, data):
            return row("storage", f"{st.uri(name)}: a new object's create-only PUT was refused", False)
        try:
            if st.put_if_absent(name, b"again"):
                return row("storage", f"{uri}: a second create-only PUT of one object was not refused: parts could "
                           "be overwritten", False)
            with open_input(st.uri(name), block=512) as f:
                f.seek(1000)
                got = f.read(100)
            if got != data[1000:1100]:
                return row("storage", f"{st.uri(name)}: a ranged read returned other bytes", False)
        finally:
            st.delete(name)
        return row("storage", f"{uri}: create-only PUT, refused overwrite, ranged GET, DELETE", True)
    except Exception as exc:  # noqa: BLE001 - what failed is the finding
        return row("storage", f"{uri}: {type(exc).__name__}: {exc}", False)
