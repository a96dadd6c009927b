"""``epd ray up`` on a local Ray (loopback only) serves a request end to end with its defaults,
as a user starts it, on this machine; an actor that cannot be placed is reported at once with
what it asks for; the placement arithmetic on its own."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray")


ENV = dict(
    os.environ,
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",
    RAY_AUTH_MODE="disabled",
    RAY_USAGE_STATS_ENABLED="0",
    GLOG_minloglevel="2",
)


def ray_up(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", "ray", "up", *args],
        capture_output=True, text=True, env=ENV, timeout=timeout,
    )  # fmt: skip


def test_ray_up_with_its_defaults_serves_the_demo_request(tiny_model_dir) -> None:
    """No CPU flags: the defaults ask for 2.1 CPUs, and a 2-CPU machine must start them."""
    from common.procs import free_port

    port = free_port()
    model = str(tiny_model_dir("qwen2_vl"))
    proc = ray_up("--encoders", "1", "--languages", "1", "--once", "--model-path", model,
                  "--gateway-port", str(port))  # fmt: skip
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert f"gateway actor on 127.0.0.1:{port}" in out
    assert "answer: " in out and "finish: length" in out
    assert "completion 16" in out


def test_an_actor_that_cannot_be_placed_is_reported_at_once(tiny_model_dir) -> None:
    start = time.monotonic()
    proc = ray_up("--once", "--num-cpus", "2", "--language-cpus", "4",
                  "--model-path", str(tiny_model_dir("qwen2_vl")), "--gateway-port", "0",
                  timeout=120)  # fmt: skip
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert "cannot place every actor: language-0 (4 CPU) larger than any node" in said, said[-3000:]
    assert "the cluster has 2 CPU and 0 GPU on 1 node(s)" in said
    assert time.monotonic() - start < 90  # seconds, not the 300 s startup timeout


def test_placement_arithmetic() -> None:
    from services.ray_launcher import Need, local_cpus, placement_problem

    args = argparse.Namespace(num_cpus=None, gateways=1, encoders=1, languages=1,
                              encoder_cpus=1.0, language_cpus=1.0)  # fmt: skip
    assert local_cpus(args, 2) == 3  # 2.1 asked: 3 logical CPUs on a 2-CPU machine
    assert local_cpus(args, 16) == 16
    assert local_cpus(argparse.Namespace(**{**vars(args), "num_cpus": 2}), 16) == 2
    node = {"CPU": 2.0, "GPU": 0.0}
    fine = [Need("gateway-0", 0.1, 0), Need("encoder-0", 1, 0), Need("language-0", 0.5, 0)]
    assert placement_problem(fine, [node]) == ("", False)
    message, for_good = placement_problem([*fine, Need("language-1", 1, 0)], [node])
    assert for_good and "ask for 2.6 CPU and 0 GPU in all" in message
    message, _ = placement_problem([Need("language-0", 0.5, 1)], [node, node])
    assert "language-0 (0.5 CPU, 1 GPU) larger than any node" in message
    assert "4 CPU and 0 GPU on 2 node(s)" in message
