"""Venvs of their own for the peers (vLLM, aiperf, lm-eval), idempotent through a stamp file.

A peer never goes into the project's ``.venv``: vLLM pins its own torch, torchvision and
transformers. Each venv lives under ``.peers/`` at the repository root (git-ignored); its stamp
file holds the recipe it was built from, so a changed recipe rebuilds it and an unchanged one
costs nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PEERS_DIR = REPO_ROOT / ".peers"
STAMP = ".peers-stamp"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def is_current(venv: Path, recipe: str) -> bool:
    """True when ``venv`` was completely built from ``recipe``."""
    stamp = venv / STAMP
    return stamp.is_file() and stamp.read_text() == recipe and venv_python(venv).exists()


def fresh_venv(venv: Path) -> Path:
    """An empty venv at ``venv`` (whatever was there is removed: a half-built one is never
    reused); returns its python."""
    if venv.exists():
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv_python(venv)
    pip(python, "install", "-q", "--upgrade", "pip")
    return python


def pip(python: Path, *args: str) -> None:
    """``python -m pip ARGS``, failing loudly."""
    subprocess.run([str(python), "-m", "pip", *args], check=True)


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def mark_current(venv: Path, recipe: str) -> None:
    (venv / STAMP).write_text(recipe)


def say(lines: Sequence[str] | str) -> None:
    text = lines if isinstance(lines, str) else "\n".join(lines)
    print(text, file=sys.stderr, flush=True)


def ensure(venv: Path, recipe: str, what: str, installs: Sequence[Sequence[str]],
           check: Sequence[str]) -> Path:  # fmt: skip
    """The python of a working venv at ``venv`` built from ``recipe``: when missing or stale,
    a fresh one gets each of ``installs`` (``pip install -q`` arguments) in order, then
    ``check`` must run (its first word a command of the venv's ``bin``)."""
    if is_current(venv, recipe):
        return venv_python(venv)
    say(f"installing {what} into {venv}")
    python = fresh_venv(venv)
    for packages in installs:
        pip(python, "install", "-q", *packages)
    command = [str(venv / "bin" / check[0]), *check[1:]]
    subprocess.run(command, check=True, capture_output=True)
    mark_current(venv, recipe)
    return python
