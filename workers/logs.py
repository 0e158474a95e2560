"""Logging for the driver and the workers, with credentials kept out of every log line.

`setup(level)` configures Python logging; at `debug` the AWS SDK's own debug output is on too (it logs
request headers). Whatever the level, every log record of the process is redacted before any handler
sees it: the values of the AWS credential variables and `HF_TOKEN` in the environment, and the parts of signed
requests that identify a key (`Credential=...`, `Signature=...`, security tokens).
"""

from __future__ import annotations

import logging
import os
import re

CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                  "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
_SIGNED = re.compile(r"((?:Credential|Signature)=|[Xx]-[Aa]mz-[Ss]ecurity-[Tt]oken['\"]?[:=]\s*['\"]?)[^\s,'\"/&]+")
QUIET = ("botocore", "boto3", "urllib3", "s3transfer")  # their DEBUG output includes request headers


def redact(text: str) -> str:
    for name in CREDENTIAL_ENV:
        value = os.environ.get(name)
        if value and len(value) >= 4:
            text = text.replace(value, "***")
    return _SIGNED.sub(r"\1***", text)


def install_redaction() -> None:
    """Redact every log record this process creates (a LogRecord factory: whatever logger or handler)."""
    base = logging.getLogRecordFactory()
    if getattr(base, "_specbatch_redacts", False):
        return

    def factory(*args, **kwargs):
        record = base(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot format is left to logging's own error handling
            return record
        record.msg, record.args = redact(message), None
        return record

    factory._specbatch_redacts = True
    logging.setLogRecordFactory(factory)


def setup(level: str = "warning") -> None:
    """Log at `level` (debug, info, warning, error) with credentials redacted; quiet the AWS SDK unless debug."""
    install_redaction()
    numeric = getattr(logging, level.upper())
    logging.basicConfig(level=numeric, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger().setLevel(numeric)
    for name in QUIET:
        logging.getLogger(name).setLevel(numeric if numeric <= logging.DEBUG else logging.WARNING)


def to_file(folder: str | None) -> str | None:
    """Send this process's stdout and stderr (model loading, progress bars, warnings) to its own file in
    `folder` (None: leave them). Returns the file's path."""
    if not folder:
        return None
    import socket
    import sys

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"worker-{socket.gethostname()}-{os.getpid()}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)  # as the umask says
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path
