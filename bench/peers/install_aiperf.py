"""Install ``aiperf`` (NVIDIA's OpenAI-API load generator) into ``.peers/aiperf-venv``.

A venv of its own: aiperf pins its own transformers and friends. Idempotent through a stamp;
``python -m bench.peers.install_aiperf`` prints the path of its ``aiperf`` command.
"""

from __future__ import annotations

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
    what = f"{AIPERF} (a minute or two, ~1.2 GB)"
    venvs.ensure(venv, RECIPE, what, [[AIPERF]], ["aiperf", "--version"])
    return aiperf_command(venv)


def main() -> int:
    print(ensure_aiperf())
    return 0


if __name__ == "__main__":
    sys.exit(main())
