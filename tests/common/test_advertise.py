"""The address a worker advertises (``common.advertise``): derived from the route to the
gateway when it binds every interface, refused at start when no peer could reach it, and
refused by the registry when a remote caller registers a loopback address."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.advertise import advertised_host, transfer_host, unreachable_reason

# A documentation address (RFC 5737): never this host's; routed by the default route, if any.
REMOTE = "192.0.2.77"


def test_all_local_keeps_loopback():
    assert advertised_host("", "127.0.0.1", "127.0.0.1:50052") == "127.0.0.1"
    assert advertised_host("", "0.0.0.0", "localhost:50052") == "127.0.0.1"
    assert advertised_host("", "0.0.0.0", "") == "127.0.0.1"
    assert transfer_host("", "127.0.0.1", "127.0.0.1:50052") == "127.0.0.1"


def test_unspecified_is_never_advertised():
    with pytest.raises(ValueError, match="--advertise-host '0.0.0.0' is not an address"):
        advertised_host("0.0.0.0", "0.0.0.0", "")
    with pytest.raises(ValueError, match="--transfer-host"):
        transfer_host("::", "127.0.0.1", "")


def test_loopback_to_a_remote_gateway_is_refused_at_start():
    with pytest.raises(ValueError, match=f"loopback address, but gateway {REMOTE}"):
        advertised_host("", "127.0.0.1", f"{REMOTE}:50052")
    with pytest.raises(ValueError, match="--transfer-host 127.0.0.1 is a loopback"):
        transfer_host("127.0.0.1", "10.1.2.3", f"{REMOTE}:50052")


def test_an_address_of_another_host_is_refused_at_start():
    with pytest.raises(ValueError, match=f"--advertise-host {REMOTE} is not an address of this"):
        advertised_host(REMOTE, "0.0.0.0", "127.0.0.1:50052")
    with pytest.raises(ValueError, match="does not resolve"):
        advertised_host("no-such-host.invalid", "0.0.0.0", "127.0.0.1:50052")


def test_registry_refuses_loopback_from_a_remote_caller():
    assert unreachable_reason("127.0.0.1:7100", "ipv4:127.0.0.1:5555") == ""
    assert unreachable_reason("10.0.0.5:7100", "ipv4:10.0.0.5:5555") == ""
    assert "loopback" in unreachable_reason("127.0.0.1:7100", "ipv4:10.0.0.5:5555")
    assert "loopback" in unreachable_reason("[::1]:7100", "ipv6:[fd00::5]:5555")
    assert "unspecified" in unreachable_reason("0.0.0.0:7100", "ipv4:127.0.0.1:5555")
    assert unreachable_reason("127.0.0.1:7100", "unix:/tmp/s") == ""


@pytest.mark.parametrize(
    "args,message",
    [
        ((), "--advertise-host (here: --host) 127.0.0.1 is a loopback address"),
        (("--host", "0.0.0.0", "--advertise-host", REMOTE), "is not an address of this host"),
        (("--host", "0.0.0.0", "--transfer-host", "127.0.0.1"), "--transfer-host 127.0.0.1"),
    ],
)
def test_a_worker_that_peers_could_not_reach_exits_at_start(args, message, tmp_path):
    """As a pod starts it: ``epd serve`` exits 2 with the reason, before loading anything."""
    done = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "language", "--model-path",
         str(tmp_path), "--gateway", f"{REMOTE}:50052", *args],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr[-2000:]
    assert message in done.stderr, done.stderr[-2000:]
