"""``epd ray up`` on a local Ray (2 CPUs, loopback only) serves a request end to end."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")


def test_ray_up_serves_the_demo_request(tiny_model_dir) -> None:
    env = dict(
        os.environ,
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        GLOG_minloglevel="2",
    )
    from common.procs import free_port

    port = free_port()
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "ray", "up", "--encoders", "1", "--languages",
         "1", "--once", "--num-cpus", "2", "--encoder-cpus", "0.5", "--language-cpus", "0.5",
         "--model-path", str(tiny_model_dir("qwen2_vl")), "--gateway-port", str(port)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert f"gateway actor on 127.0.0.1:{port}" in out
    assert "answer: " in out and "finish: length" in out
    assert "completion 16" in out
