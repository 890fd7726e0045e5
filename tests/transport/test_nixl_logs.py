"""NIXL's own log lines go to stderr: stdout belongs to --json output."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvmove.transport import NixlTransport


def test_nixl_logs_leave_stdout_alone() -> None:
    if not NixlTransport.is_available():
        pytest.skip("NIXL is not installed")
    code = "from kvmove.transport.nixl import NixlTransport; NixlTransport().close()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and "NIXL" in done.stderr
