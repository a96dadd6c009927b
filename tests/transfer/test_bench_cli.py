"""``epd transfer-bench`` is a contract: its flags, its JSON keys and its exit status."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.transfer_protocol import JSON_KEYS


def _epd() -> list[str]:
    script = Path(sys.executable).parent / "epd"
    if script.exists():
        return [str(script)]
    found = shutil.which("epd")
    return [found] if found else [sys.executable, "-m", "services.cli"]


@pytest.mark.parametrize(
    ("transport", "tokens", "transfers"), [("mooncake", 300, 2), ("shm", 200, 1)]
)
def test_transfer_bench_json(transport: str, tokens: int, transfers: int) -> None:
    args = ["transfer-bench", "--tokens", str(tokens), "--default-tokens", "256"]
    args += ["--hidden", "64", "--deepstack", "1", "--dtype", "fp32", "--transport", transport]
    args += ["--rooms", "2", "--repeats", "2", "--json"]
    done = subprocess.run(_epd() + args, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout.strip().splitlines()[-1])
    assert tuple(record) == JSON_KEYS
    assert (record["tokens"], record["rooms"], record["transfers"]) == (tokens, 2, transfers)
    row_bytes = 64 * 2 * 4  # hidden x (1 + deepstack) x fp32
    assert record["bytes"] >= 2 * tokens * (row_bytes + 16)  # rows + fill id + 3 positions
    assert record["checksum_ok"] is True
    assert record["leaked_blocks_sender"] == record["leaked_blocks_receiver"] == 0
    assert record["protocol_ms"] > 0 and record["raw_ms"] > 0
    assert record["ratio"] == pytest.approx(record["raw_ms"] / record["protocol_ms"], abs=1e-2)


def test_transfer_bench_rejects_bad_flags() -> None:
    done = subprocess.run(
        _epd() + ["transfer-bench", "--tokens", "0", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0 and "--tokens" in done.stderr
