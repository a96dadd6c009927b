"""Install EleutherAI's ``lm-eval`` (the evaluation harness) into ``.peers/lm-eval-venv``.

A venv of its own, like aiperf's: lm-eval pins its own datasets, transformers and torch. CPU
torch goes in first and pinned (lm-eval asks for an unpinned ``torch``, which would otherwise
pull a multi-GB CUDA build). The ``api`` extra brings what its ``local-completions`` and
``local-chat-completions`` models need, and ``transformers`` (the project's pin) the tokenizer
they read the checkpoint directory's with (log-likelihood requests are sent as token ids, and the
context's length is counted in them). Idempotent through a stamp;
``python -m bench.peers.install_lm_eval`` prints the path of its ``lm_eval`` command.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.peers import venvs

VENV = venvs.PEERS_DIR / "lm-eval-venv"
TORCH = "torch==2.13.0"  # the CPU wheel of the local wheel folder; first, so no CUDA build comes
LM_EVAL = "lm-eval[api]==0.4.13"
TRANSFORMERS = "transformers==5.23.0"
RECIPE = f"{TORCH} {LM_EVAL} {TRANSFORMERS} 1\n"


def lm_eval_command(venv: Path = VENV) -> Path:
    return venv / "bin" / "lm_eval"


def ensure_lm_eval(venv: Path = VENV) -> Path:
    """The ``lm_eval`` command of a working venv at ``venv``, building it when missing or
    stale."""
    what = f"{LM_EVAL} (a minute or two, ~1.8 GB)"
    installs = [[TORCH], [TORCH, LM_EVAL, TRANSFORMERS]]
    check = ["python", "-c", "import lm_eval.models.openai_completions, transformers"]
    venvs.ensure(venv, RECIPE, what, installs, check)
    return lm_eval_command(venv)


def main() -> int:
    print(ensure_lm_eval())
    return 0


if __name__ == "__main__":
    sys.exit(main())
