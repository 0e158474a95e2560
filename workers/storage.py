"""Local folders and S3 prefixes behind one small interface.

Commits are create-only (`put_if_absent`): a part is written whole under its final name or not at
all, and an existing part is never overwritten — a raced retry cannot double rows. Local: a temp file
in the same folder, fsync, then `os.link` (fails if the name exists). S3: a conditional PUT
(`If-None-Match: *`). S3 credentials and endpoint come only from the standard AWS chain and
environment (`AWS_ENDPOINT_URL`, `AWS_ACCESS_KEY_ID`, profiles, instance roles); nothing here logs
them, and botocore's own debug logging is kept off.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import random
import secrets
import time
from urllib.parse import urlparse

from . import faults, logs

logs.install_redaction()  # whoever logs in a process that touches storage: no credential in any line
for _name in logs.QUIET:  # the AWS SDK's DEBUG output includes request headers: off unless asked for
    logging.getLogger(_name).setLevel(logging.WARNING)

INPUT_SUFFIXES = (".jsonl", ".parquet")


class StorageError(RuntimeError):
    """A permanent storage failure (no bucket, access denied, ...): the job stops with this message."""


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


class Storage:
    def exists(self, name: str) -> bool: ...
    def read_bytes(self, name: str) -> bytes | None: ...
    def put_if_absent(self, name: str, data: bytes) -> bool: ...
    def put(self, name: str, data: bytes) -> None: ...
    def list(self, prefix: str = "") -> list[str]: ...
    def delete(self, name: str) -> None: ...
    def uri(self, name: str) -> str: ...


# ------------------------------------------------------------------------------------------ retries

def _attempts() -> int:
    return int(os.environ.get("SPECBATCH_STORAGE_MAX_ATTEMPTS", "6"))


def _backoff(attempt: int) -> None:
    time.sleep(min(8.0, 0.2 * 2 ** (attempt - 1)) * (0.5 + random.random()))


def _retry(op: str, target: str, fn, kind: str, errors):
    """fn(), retried with exponential backoff while it fails in a way that passes with time (`errors.judge`), up
    to SPECBATCH_STORAGE_MAX_ATTEMPTS attempts; a permanent failure, or the last, raises StorageError naming the
    operation and its target. `kind` (put, get, head, list, delete) is what a test's injected fault hits."""
    attempts = _attempts()
    for attempt in range(1, attempts + 1):
        try:
            if faults.storage(kind):
                raise errors.injected(op)
            return fn()
        except Exception as exc:
            verdict = errors.judge(exc, target, attempts)
            if verdict is None:  # not a storage failure
                raise
            transient, why = verdict
            if not transient or attempt == attempts:
                raise StorageError(f"{errors.prefix}{op} {target}: {why}") from None
        _backoff(attempt)


class _LocalErrors:
    """How a local or network filesystem fails: `judge(exc, target, attempts)` is (passes with time?, why) for its
    errors (EIO, ESTALE, ... pass; no folder, no permission do not), None for any other exception; `injected(op)`
    is the transient error of a test's fault."""

    prefix = ""
    TRANSIENT = {errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.EINTR, errno.ESTALE, errno.ENOTCONN,
                 errno.ECONNRESET}

    def judge(self, exc, target, attempts):
        if not isinstance(exc, OSError):
            return None
        return exc.errno in self.TRANSIENT, exc.strerror or str(exc)

    def injected(self, op):
        return OSError(errno.EIO, "injected fault")


class _S3Errors:
    """How S3 fails, as `_LocalErrors` says: throttling, 5xx and dropped connections pass with time."""

    prefix = "S3 "
    TRANSIENT = {"Throttling", "ThrottlingException", "SlowDown", "RequestTimeout", "RequestTimeTooSkewed",
                 "InternalError", "ServiceUnavailable", "503", "500", "502", "504"}

    def judge(self, exc, target, attempts):
        from botocore.exceptions import BotoCoreError, ClientError

        if isinstance(exc, ClientError):
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            return (code in self.TRANSIENT or status >= 500 or status == 429,
                    _explain(code, err.get("Message", ""), target))
        if isinstance(exc, BotoCoreError):  # connection errors among them
            return True, f"{type(exc).__name__} after {attempts} attempts"
        return None

    def injected(self, op):
        from botocore.exceptions import ClientError

        return ClientError({"Error": {"Code": "ServiceUnavailable", "Message": "injected fault"},
                            "ResponseMetadata": {"HTTPStatusCode": 503}}, op)


LOCAL, S3 = _LocalErrors(), _S3Errors()


def _explain(code: str, message: str, what: str) -> str:
    bucket = urlparse(what).netloc
    if code == "NoSuchBucket":
        return f"bucket {bucket!r} does not exist"
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
        return f"access denied to bucket {bucket!r} ({code}); check the AWS credentials in the environment"
    return f"{code} {message}".strip()


# -------------------------------------------------------------------------------------------- local

class LocalStorage(Storage):
    """A folder. Names stay inside it (a name that resolves outside is refused); transient OS errors are
    retried (`_retry`)."""

    def __init__(self, root: str):
        self.root = os.path.realpath(root)

    def _path(self, name: str) -> str:
        path = os.path.realpath(os.path.join(self.root, name))
        if path != self.root and not path.startswith(self.root + os.sep):
            raise StorageError(f"{name!r} resolves outside the output folder {self.root}")
        return path

    def exists(self, name):
        return os.path.exists(self._path(name))

    def read_bytes(self, name):
        path = self._path(name)

        def read():
            try:
                with open(path, "rb") as f:
                    return f.read()
            except FileNotFoundError:
                return None

        return _retry("read", path, read, "get", LOCAL)

    def _temp(self, path: str, data: bytes) -> str:
        """`data` in a new temp file beside `path`, synced: created 0666 less the umask, as any file the user's
        programs create, so that the part it becomes is as readable as they are (mkstemp's are 0600)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = os.path.join(os.path.dirname(path), f".tmp-{os.getpid()}-{secrets.token_hex(8)}")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        return tmp

    def put_if_absent(self, name, data):
        path = self._path(name)

        def put():
            tmp = self._temp(path, data)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            finally:
                os.unlink(tmp)

        return _retry("write", path, put, "put", LOCAL)

    def put(self, name, data):
        path = self._path(name)
        _retry("write", path, lambda: os.replace(self._temp(path, data), path), "put", LOCAL)

    def list(self, prefix=""):
        if not os.path.isdir(self.root):
            return []
        out = []
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                rel = os.path.relpath(os.path.join(dirpath, f), self.root)
                if rel.startswith(prefix) and not f.startswith(".tmp-"):
                    out.append(rel)
        return sorted(out)

    def delete(self, name):
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass

    def uri(self, name):
        return self._path(name)


# ----------------------------------------------------------------------------------------------- S3

def _client():
    import boto3
    from botocore.config import Config

    # retries are ours (below), so botocore's own are off and every attempt is counted once
    return boto3.session.Session().client("s3", config=Config(retries={"max_attempts": 1, "mode": "standard"},
                                                               connect_timeout=10, read_timeout=60))


class S3Storage(Storage):
    def __init__(self, uri: str):
        u = urlparse(uri)
        self.bucket = u.netloc
        self.prefix = u.path.lstrip("/")
        if self.prefix and not self.prefix.endswith("/"):
            self.prefix += "/"
        self.s3 = _client()

    def _key(self, name):
        return self.prefix + name

    def uri(self, name):
        return f"s3://{self.bucket}/{self._key(name)}"

    def exists(self, name):
        from botocore.exceptions import ClientError

        def head():
            try:
                self.s3.head_object(Bucket=self.bucket, Key=self._key(name))
                return True
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise

        return _retry("HeadObject", self.uri(name), head, "head", S3)

    def read_bytes(self, name):
        from botocore.exceptions import ClientError

        def get():
            try:
                return self.s3.get_object(Bucket=self.bucket, Key=self._key(name))["Body"].read()
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise

        return _retry("GetObject", self.uri(name), get, "get", S3)

    def put_if_absent(self, name, data):
        from botocore.exceptions import ClientError

        def put():
            try:
                self.s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=data, IfNoneMatch="*")
                return True
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412",
                                                                  "ConditionalRequestConflict"):
                    return False
                raise

        return _retry("PutObject", self.uri(name), put, "put", S3)

    def put(self, name, data):
        _retry("PutObject", self.uri(name),
               lambda: self.s3.put_object(Bucket=self.bucket, Key=self._key(name), Body=data), "put", S3)

    def list(self, prefix=""):
        return [o["name"] for o in self.list_objects(prefix)]

    def list_objects(self, prefix="") -> list[dict]:
        """`list`, with each object's size and ETag (the listing has them: no request more)."""
        def ls():
            out = []
            pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            for page in pages:
                out.extend({"name": o["Key"][len(self.prefix):], "size": o["Size"], "etag": o["ETag"].strip('"')}
                           for o in page.get("Contents", []))
            return sorted(out, key=lambda o: o["name"])

        return _retry("ListObjectsV2", f"s3://{self.bucket}/{self._key(prefix)}", ls, "list", S3)

    def download(self, name: str, dest: str, size: int | None = None, chunk: int = 8 << 20) -> int:
        """Stream one object into the local file `dest` (created or truncated), never whole in memory; a
        dropped connection resumes where it stopped (a ranged GET of the same version, `If-Match` its ETag).
        Returns the bytes written."""
        etag: list[str] = []
        with open(dest, "wb") as f:
            def get():
                if size is not None and f.tell() >= size:
                    return
                args = {"Bucket": self.bucket, "Key": self._key(name)}
                if f.tell():
                    args.update(Range=f"bytes={f.tell()}-", IfMatch=etag[0])
                resp = self.s3.get_object(**args)
                if not etag:
                    etag.append(resp["ETag"])
                for block in resp["Body"].iter_chunks(chunk):
                    f.write(block)

            _retry("GetObject", self.uri(name), get, "get", S3)
            return f.tell()

    def delete(self, name):
        _retry("DeleteObject", self.uri(name),
               lambda: self.s3.delete_object(Bucket=self.bucket, Key=self._key(name)), "delete", S3)


class S3Reader(io.RawIOBase):
    """A seekable read-only file over one S3 object, fetched in ranged GETs (never whole)."""

    def __init__(self, uri: str):
        u = urlparse(uri)
        self.bucket, self.key, self._uri = u.netloc, u.path.lstrip("/"), uri
        self.s3 = _client()
        head = _retry("HeadObject", uri, lambda: self.s3.head_object(Bucket=self.bucket, Key=self.key), "head", S3)
        self.size = head["ContentLength"]
        self.pos = 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self.pos

    def seek(self, offset, whence=io.SEEK_SET):
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, buf):
        if self.pos >= self.size:
            return 0
        end = min(self.size, self.pos + len(buf)) - 1
        rng = f"bytes={self.pos}-{end}"
        data = _retry("GetObject", self._uri,
                      lambda: self.s3.get_object(Bucket=self.bucket, Key=self.key, Range=rng)["Body"].read(), "get", S3)
        n = len(data)
        buf[:n] = data
        self.pos += n
        return n


# -------------------------------------------------------------------------------------- entry points


def open_storage(uri: str) -> Storage:
    return S3Storage(uri) if is_s3(uri) else LocalStorage(uri)


def list_input_files(uri: str) -> list[str]:
    """The file or object itself, or every .jsonl/.parquet below a folder or prefix, sorted."""
    return [f["path"] for f in input_files(uri)]


def input_files(uri: str) -> list[dict]:
    """`list_input_files` with what tells a file's content apart: `{path, size, etag}` on S3 (from the listing; one
    HEAD for a single object), `{path, size, mtime_ns}` locally. The output manifest records them (jobs/driver.py)."""
    if is_s3(uri):
        if uri.endswith(INPUT_SUFFIXES):
            u = urlparse(uri)
            s3 = _client()
            head = _retry("HeadObject", uri, lambda: s3.head_object(Bucket=u.netloc, Key=u.path.lstrip("/")), "head", S3)
            return [{"path": uri, "size": head["ContentLength"], "etag": head["ETag"].strip('"')}]
        st = S3Storage(uri)
        return [{"path": st.uri(o["name"]), "size": o["size"], "etag": o["etag"]}
                for o in st.list_objects() if o["name"].endswith(INPUT_SUFFIXES)]
    if os.path.isfile(uri):
        paths = [os.path.abspath(uri)]
    elif os.path.isdir(uri):
        paths = [os.path.join(os.path.abspath(uri), n) for n in LocalStorage(uri).list() if n.endswith(INPUT_SUFFIXES)]
    else:
        raise StorageError(f"input {uri!r} does not exist")
    out = []
    for path in paths:
        info = _retry("stat", path, lambda p=path: os.stat(p), "head", LOCAL)
        out.append({"path": path, "size": info.st_size, "mtime_ns": info.st_mtime_ns})
    return out


def open_input(uri: str, block: int = 8 << 20):
    """A buffered, seekable binary reader, streamed in `block`-sized ranged reads."""
    if is_s3(uri):
        return io.BufferedReader(S3Reader(uri), buffer_size=block)
    return open(uri, "rb")
