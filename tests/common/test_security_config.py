"""Security settings: the internal credentials (``EPD_INTERNAL_*``) and the gateway's surfaces
are validated when the config is built, with messages that name the setting or the file."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from common.internal import (
    InternalConfig,
    add_internal_arguments,
    channel_security,
    internal_config,
    server_security,
)
from common.worker import add_worker_arguments, worker_configs
from services.gateway.config import GatewayConfig
from services.gateway.server import add_arguments as add_gateway_arguments
from services.gateway.server import config_from_args as gateway_config
from services.gateway.server import public_security
from tests.common.pki import make_ca, write_secret


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root)
    return ca, ca.issue("node"), write_secret(root / "token", "s3cret")


def test_everything_off_by_default() -> None:
    config = InternalConfig()
    assert not config.enabled
    assert server_security(config) is None and channel_security(config) is None
    assert public_security(GatewayConfig()) is None


def test_internal_settings_from_env_and_flags(pki, monkeypatch) -> None:
    ca, node, token = pki
    monkeypatch.setenv("EPD_INTERNAL_TOKEN_FILE", token)
    monkeypatch.setenv("EPD_INTERNAL_TLS_CERT_FILE", node.cert)
    monkeypatch.setenv("EPD_INTERNAL_TLS_KEY_FILE", node.key)
    parser = argparse.ArgumentParser()
    add_internal_arguments(parser)
    args = parser.parse_args(["--internal-tls-ca-file", ca.cert])
    config = internal_config(args)
    assert (config.token_file, config.tls_ca_file) == (token, ca.cert)
    server, client = server_security(config), channel_security(config)
    assert server.tls.mutual and server.auth is not None
    assert client.secret() == "s3cret" and client.tls.cert_file == node.cert


def test_workers_nest_the_internal_settings(pki, monkeypatch) -> None:
    _, _, token = pki
    monkeypatch.setenv("EPD_INTERNAL_TOKEN_FILE", token)
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser, "EPD_LANGUAGE_")
    configs = worker_configs(parser.parse_args(["--health-port", "8081"]), "EPD_LANGUAGE_")
    assert configs["worker"].internal.token_file == token
    assert configs["worker"].health_port == 8081


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"tls_cert_file": "x.crt"}, "needs all of --internal-tls-cert-file"),
        ({"tls_server_name": "epd-internal"}, "--internal-tls-server-name needs"),
        ({"token_file": "/nonexistent/token"}, "cannot read secret file /nonexistent/token"),
    ],
)
def test_bad_internal_settings(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        InternalConfig(**kwargs)


def test_internal_tls_files_are_checked(pki, tmp_path: Path) -> None:
    ca, node, token = pki
    with pytest.raises(ValueError, match="do not form a pair"):
        InternalConfig(tls_cert_file=node.cert, tls_key_file=ca.key, tls_ca_file=ca.cert)
    with pytest.raises(ValueError, match=f"CA file {token} is not a PEM file"):
        InternalConfig(tls_cert_file=node.cert, tls_key_file=node.key, tls_ca_file=token)


def test_gateway_surfaces(pki, monkeypatch) -> None:
    ca, node, token = pki
    monkeypatch.setenv("EPD_GATEWAY_API_KEYS", " key-a, key-b ,")
    monkeypatch.setenv("EPD_INTERNAL_TOKEN_FILE", token)
    parser = argparse.ArgumentParser()
    add_gateway_arguments(parser)
    config = gateway_config(
        parser.parse_args(["--tls-cert-file", node.cert, "--tls-key-file", node.key])
    )
    assert config.registry_port == 50052 and config.internal.token_file == token
    assert "key-a" not in repr(config)  # keys stay out of logs and tracebacks
    security = public_security(config)
    assert security.tls is not None and not security.tls.mutual
    assert security.auth.problem([("authorization", "Bearer key-b")]) is None
    assert security.auth.problem([("authorization", "Bearer key-c")]) == "invalid API key"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"port": 50052}, "port, registry_port, health_port and http_port must differ"),
        ({"port": 0, "registry_port": 0, "health_port": 50051}, None),
        ({"registry_port": 70000}, "registry_port out of range: 70000"),
        ({"tls_cert_file": "a.crt"}, "needs both --tls-cert-file and --tls-key-file"),
        ({"api_keys_file": "/nonexistent/keys"}, "cannot read secret file /nonexistent/keys"),
        ({"api_keys": ("", " ")}, "api_keys holds only empty keys"),
    ],
)
def test_bad_gateway_surfaces(kwargs, message) -> None:
    if message is None:
        GatewayConfig(**kwargs)
        return
    with pytest.raises(ValueError, match=message):
        GatewayConfig(**kwargs)


@pytest.mark.parametrize(
    "args, names",
    [
        (["--api-keys-file", "/nonexistent/keys"], "/nonexistent/keys"),
        (["--internal-token-file", "PLACEHOLDER"], "REPLACE-ME placeholder"),
        (["--tls-cert-file", "CERT", "--tls-key-file", "KEY"], "do not form a pair"),
    ],
)
def test_bad_credentials_are_one_line_start_up_errors(pki, tmp_path: Path, args, names) -> None:
    ca, node, _ = pki
    placeholder = write_secret(tmp_path / "token", "REPLACE-ME: the internal token")
    swap = {"PLACEHOLDER": placeholder, "CERT": node.cert, "KEY": ca.key}
    argv = [swap.get(a, a) for a in args]
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "serve", "gateway", "--port", "0",
         "--registry-port", "0", *argv],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epd serve: error: "), proc.stderr
    assert names in lines[0]
