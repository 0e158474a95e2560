"""Test hooks: faults a test asks for through SPECBATCH_FAULT_<NAME> environment variables."""

from __future__ import annotations

import os


def fault(name: str) -> bool:
    """Test hook: true once per marker file named by SPECBATCH_FAULT_<NAME> (created on first use), so a
    fault fires once per test even across worker restarts."""
    marker = os.environ.get(f"SPECBATCH_FAULT_{name}")
    if not marker:
        return False
    try:  # create-only: of two workers reaching it at once, exactly one fires
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True
