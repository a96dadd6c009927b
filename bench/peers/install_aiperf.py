"""Install ``aiperf`` (NVIDIA's OpenAI-API load generator) into ``.peers/aiperf-venv``.

A venv of its own: aiperf pins its own transformers and friends. Idempotent through a stamp;
``python -m bench.peers.install_aiperf`` prints the path of its ``aiperf`` command.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.peers import venvs

VENV = venvs.PEERS_DIR / "aiperf-venv"
AIPERF = "aiperf==0.13.0"
RECIPE = f"{AIPERF} 1\n"


def aiperf_command(venv: Path = VENV) -> Path:
    return venv / "bin" / "aiperf"


def ensure_aiperf(venv: Path = VENV) -> Path:
    """The ``aiperf`` command of a working venv at ``venv``, building it when missing or
    stale."""
    if venvs.is_current(venv, RECIPE):
        return aiperf_command(venv)
    venvs.say(f"installing {AIPERF} into {venv} (a minute or two, ~1.2 GB)")
    python = venvs.fresh_venv(venv)
    venvs.pip(python, "install", "-q", AIPERF)
    subprocess.run([str(aiperf_command(venv)), "--version"], check=True, capture_output=True)
    venvs.mark_current(venv, RECIPE)
    return aiperf_command(venv)


def main() -> int:
    print(ensure_aiperf())
    return 0


if __name__ == "__main__":
    sys.exit(main())
