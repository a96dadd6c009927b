"""``epd generate``: every bad argument or unreachable gateway is one line on stderr and a non-zero
exit status, never a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from common.procs import free_port
from services.cli import main

ROOT = Path(__file__).resolve().parents[2]


def generate(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main(["generate", "--prompt", "hi", "--timeout", "5", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    "args, status, needle",
    [
        (["--max-tokens", "-1"], 2, "--max-tokens must be in [0, 4294967295], got -1"),
        (["--max-tokens", str(1 << 33)], 2, "--max-tokens must be in"),
        (["--temperature", "nan"], 2, "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "-1"], 2, "--temperature"),
        (["--top-p", "2"], 2, "--top-p must be in [0, 1]"),
        (["--top-k", "-5"], 2, "--top-k"),
        (["--seed", "-1"], 2, "--seed"),
        (["--timeout", "0"], 2, "--timeout must be a positive number"),
        (["--image", "/no/such/image.png"], 2, "cannot read image '/no/such/image.png'"),
        (["--image", "/"], 2, "cannot read image '/'"),
        (["--tls-ca", "/no/such/ca.pem"], 2, "cannot read CA file"),
        (["--gateway", "nonsense"], 2, "gateway address 'nonsense' is not host:port"),
        (["--gateway", "127.0.0.1:99999"], 2, "is not host:port"),
        (["--gateway", ","], 2, "no gateway address given"),
    ],
)
def test_bad_arguments_are_one_line(capsys, args: list[str], status: int, needle: str) -> None:
    code, err = generate(capsys, *args)
    assert code == status
    assert len(err.splitlines()) == 1, err
    assert err.startswith("epd generate: error: ") and needle in err, err


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["stream", "json"])
def test_unreachable_gateway_is_one_line(capsys, json_flag: list[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    code, err = generate(capsys, "--gateway", f"{dead},{dead}", *json_flag)
    assert code == 1
    assert len(err.splitlines()) == 1 and err.startswith("UNAVAILABLE: "), err


def test_argparse_errors_exit_2_without_traceback(capsys) -> None:
    code, err = generate(capsys, "--max-tokens", "many")
    assert code == 2
    assert err.splitlines()[-1].endswith("argument --max-tokens: invalid int value: 'many'")


def test_a_real_process_prints_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--prompt", "x", "--max-tokens", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "epd generate: error: --max-tokens must be in [0, 4294967295], got -1"
    )
    assert proc.stdout == ""
