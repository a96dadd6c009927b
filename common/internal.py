"""Credentials of the internal gRPC surfaces, the same settings in every process.

Internal: the gateway's registry port, encoders' and language workers' gRPC. Callers are the
gateway (to workers) and the workers' registrars (to the registry). ``InternalConfig``
(``--internal-*`` flags, ``EPD_INTERNAL_*`` env, nested in the gateway's and every worker's
config) turns on either or both of:

* a shared token (``token_file``, a mounted Secret): servers refuse calls without
  ``authorization: Bearer <token>`` (``UNAUTHENTICATED``; ``grpc.health.v1`` stays open for
  probes). The file may hold several lines: servers accept any, clients send the first, so a
  token is rotated by adding the new one second, rolling, swapping the lines, rolling, and
  removing the old one.
* mutual TLS (``tls_cert_file`` + ``tls_key_file`` + ``tls_ca_file``): every process serves its
  internal port with its certificate, demands one signed by the CA from callers, and presents
  its own when it calls. ``tls_server_name`` is the name those certificates carry when they do
  not list pod IPs (one certificate for every pod, e.g. ``epd-internal``).

Both off (the default, and ``epd run``): plaintext and open, as on a laptop.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from common.auth import BearerAuthInterceptor, BearerKeys
from common.channels import ChannelSecurity
from common.cli_config import add_cli_args, field, from_cli_args
from common.grpc_server import ServerSecurity
from common.secret_files import SecretFile, read_secret_lines
from common.tls import ClientTLS, ServerTLS, check_ca, check_key_pair

ENV_PREFIX = "EPD_INTERNAL_"
FLAG_PREFIX = "internal"
TOKEN = "internal token"


@dataclass(frozen=True)
class InternalConfig:
    token_file: str = field(
        "",
        help="file holding the internal token ('' = none); one per line: servers accept any, "
        "clients send the first",
    )
    tls_cert_file: str = field(
        "", help="PEM certificate for internal gRPC, served and presented ('' = no TLS)"
    )
    tls_key_file: str = field("", help="private key of tls_cert_file")
    tls_ca_file: str = field(
        "", help="CA that signs every internal certificate (peers must present one)"
    )
    tls_server_name: str = field(
        "", help="name internal certificates carry, checked instead of the peer's host"
    )

    def __post_init__(self) -> None:
        tls = (self.tls_cert_file, self.tls_key_file, self.tls_ca_file)
        if any(tls) and not all(tls):
            raise ValueError(
                "internal mutual TLS needs all of --internal-tls-cert-file, "
                "--internal-tls-key-file and --internal-tls-ca-file (EPD_INTERNAL_TLS_*)"
            )
        if self.tls_server_name and not self.tls:
            raise ValueError("--internal-tls-server-name needs internal TLS files")
        if self.token_file:
            read_secret_lines(self.token_file)
        if self.tls:
            check_key_pair(self.tls_cert_file, self.tls_key_file)
            check_ca(self.tls_ca_file)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_file)

    @property
    def enabled(self) -> bool:
        return bool(self.token_file) or self.tls


def server_security(config: InternalConfig) -> ServerSecurity | None:
    """What an internal server demands (None when nothing is configured)."""
    if not config.enabled:
        return None
    tls = auth = None
    if config.tls:
        tls = ServerTLS(config.tls_cert_file, config.tls_key_file, config.tls_ca_file)
    if config.token_file:
        auth = BearerAuthInterceptor(BearerKeys(file=SecretFile(config.token_file)), TOKEN)
    return ServerSecurity(tls=tls, auth=auth)


def channel_security(config: InternalConfig) -> ChannelSecurity | None:
    """What an internal caller presents (None when nothing is configured)."""
    if not config.enabled:
        return None
    tls = None
    if config.tls:
        tls = ClientTLS(
            config.tls_ca_file, config.tls_cert_file, config.tls_key_file, config.tls_server_name
        )
    token = SecretFile(config.token_file) if config.token_file else None
    return ChannelSecurity(token=token, tls=tls)


def add_internal_arguments(parser: argparse.ArgumentParser) -> None:
    add_cli_args(parser, InternalConfig, ENV_PREFIX, flag_prefix=FLAG_PREFIX)


def internal_config(args: argparse.Namespace) -> InternalConfig:
    return from_cli_args(InternalConfig, args, ENV_PREFIX, flag_prefix=FLAG_PREFIX)
