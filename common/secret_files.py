"""Secrets read from files (mounted Kubernetes Secrets), re-read when the file changes.

A ``SecretFile`` holds the non-empty, non-comment lines of one file: API keys, internal tokens.
Secrets never travel on a command line; a file path does. Kubernetes updates a mounted Secret
by swapping a symlink, so the file is re-read when its identity (inode, size, mtime) changes,
checked at most once per ``recheck_s``: a rotated key takes effect without a restart.

Invariants: a ``SecretFile`` always holds at least one secret. A file missing or empty at
construction is a ``ValueError`` naming it (a start-up error); one that later becomes unreadable
or empty keeps the last good secrets (and says so once in the log), so a half-written update
never locks every caller out. A file that still holds the deployment's placeholder
(``REPLACE-ME``, as shipped in ``deploy/k8s``) is refused like an empty one: a service never
runs with a secret that is published in this repository.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)
RECHECK_S = 1.0
PLACEHOLDER = "REPLACE-ME"


def check_not_placeholder(path: str | Path, text: str) -> None:
    """``ValueError`` when ``text`` (the content of ``path``) is an unfilled placeholder."""
    if PLACEHOLDER in text:
        raise ValueError(
            f"{path} still holds the {PLACEHOLDER} placeholder: put the real secret there "
            "(docs/security.md)"
        )


def read_secret_lines(path: str | Path) -> tuple[str, ...]:
    """The secrets in ``path``: one per line, surrounding blanks stripped; empty lines and lines
    starting with ``#`` skipped. Raises ``ValueError`` when there is none or it is unreadable."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read secret file {path}: {exc}") from None
    check_not_placeholder(path, text)
    stripped = (line.strip() for line in text.splitlines())
    lines = tuple(line for line in stripped if line and not line.startswith("#"))
    if not lines:
        raise ValueError(f"secret file {path} holds no secret (one per line)")
    return lines


class SecretFile:
    """The secrets of one file, kept current; ``values()`` is cheap enough to call per RPC."""

    def __init__(self, path: str | Path, recheck_s: float = RECHECK_S) -> None:
        self.path = str(path)
        self._recheck_s = recheck_s
        self._lock = threading.Lock()
        self._stamp = self._identity()
        self._values = read_secret_lines(self.path)
        self._checked_at = time.monotonic()
        self._warned = False

    def values(self) -> tuple[str, ...]:
        """Every secret in the file (the first is the one a client sends)."""
        now = time.monotonic()
        if now - self._checked_at < self._recheck_s:
            return self._values
        with self._lock:
            if now - self._checked_at >= self._recheck_s:
                self._checked_at = now
                self._reload()
            return self._values

    def first(self) -> str:
        return self.values()[0]

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _reload(self) -> None:
        stamp = self._identity()
        if stamp == self._stamp:
            return
        try:
            values = read_secret_lines(self.path)
        except ValueError as exc:
            if not self._warned:
                log.warning("%s; keeping the secrets read before", exc)
                self._warned = True
            return
        self._stamp, self._values, self._warned = stamp, values, False
        log.info("secret file %s changed: %d secret(s) loaded", self.path, len(values))
