"""TLS material for gRPC servers and channels, read from PEM files (mounted Secrets).

``ServerTLS``: a certificate chain and its key, plus optionally the CA that signs clients
(mutual TLS: a client without a certificate from that CA fails the handshake). Its credentials
are dynamic: before each new connection's handshake grpc asks for the current certificate, and
the files are re-read when they changed, so a renewed certificate is served without a restart
(established connections keep theirs). A renewal that cannot be read (half-written, key and
certificate that do not match) keeps the previous material and is logged.

``ClientTLS``: the CA that signs the servers (empty: the system's roots), optionally the
client's own certificate and key (mutual TLS), and the name the server's certificate must carry
when it differs from the host in the address (one internal certificate for every pod, whose pod
IPs no certificate lists). A channel reads them when it is created.

Every file is checked when the object is built (exists, parses, the key matches the
certificate): a bad file is a ``ValueError`` naming it, at start-up rather than at the first
handshake.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc

from common.secret_files import check_not_placeholder

log = logging.getLogger(__name__)


def read_pem(path: str, what: str) -> bytes:
    """The bytes of the PEM file ``path``; ``ValueError`` naming ``what`` when unusable."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    check_not_placeholder(path, data.decode("utf-8", "replace"))
    if b"-----BEGIN " not in data:
        raise ValueError(f"{what} {path} is not a PEM file")
    return data


def check_key_pair(cert_file: str, key_file: str) -> None:
    """``ValueError`` unless ``cert_file`` holds a certificate chain that ``key_file`` signs."""
    read_pem(cert_file, "certificate")
    read_pem(key_file, "private key")
    try:
        ssl.create_default_context().load_cert_chain(cert_file, key_file)
    except ssl.SSLError as exc:
        raise ValueError(
            f"certificate {cert_file} and key {key_file} do not form a pair: {exc.reason}"
        ) from None


def check_ca(ca_file: str) -> None:
    """``ValueError`` unless ``ca_file`` holds at least one CA certificate."""
    read_pem(ca_file, "CA file")
    try:
        ssl.create_default_context().load_verify_locations(cafile=ca_file)
    except ssl.SSLError as exc:
        raise ValueError(f"CA file {ca_file} holds no usable certificate: {exc.reason}") from None


def file_stamps(paths: tuple[str, ...]) -> tuple:
    """What tells a file's replacement apart (inode, size, mtime) for each of ``paths``; None
    for a missing one. Equal stamps: nothing was renewed."""
    stamps = []
    for path in paths:
        try:
            st = os.stat(path)
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


@dataclass(frozen=True)
class ServerTLS:
    cert_file: str
    key_file: str
    client_ca_file: str = ""  # set: mutual TLS, clients must present a certificate it signed

    def __post_init__(self) -> None:
        check_key_pair(self.cert_file, self.key_file)
        if self.client_ca_file:
            check_ca(self.client_ca_file)

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    def _configuration(self):
        pair = (read_pem(self.key_file, "private key"), read_pem(self.cert_file, "certificate"))
        roots = read_pem(self.client_ca_file, "CA file") if self.mutual else None
        return grpc.ssl_server_certificate_configuration([pair], root_certificates=roots)

    def credentials(self) -> grpc.ServerCredentials:
        """Credentials that follow the files (see the module docstring)."""
        files = tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)
        lock = threading.Lock()
        seen = [file_stamps(files)]

        def fetch():
            stamp = file_stamps(files)
            with lock:
                if stamp == seen[0]:
                    return None
                seen[0] = stamp
            try:
                check_key_pair(self.cert_file, self.key_file)
                configuration = self._configuration()
            except ValueError as exc:
                log.warning("TLS files changed but cannot be used (%s); serving the old ones", exc)
                return None
            log.info("TLS certificate %s reloaded", self.cert_file)
            return configuration

        return grpc.dynamic_ssl_server_credentials(
            self._configuration(), fetch, require_client_authentication=self.mutual
        )


@dataclass(frozen=True)
class ClientTLS:
    ca_file: str = ""  # "" = the system's root CAs
    cert_file: str = ""  # with key_file: this client's certificate (mutual TLS)
    key_file: str = ""
    server_name: str = ""  # the name servers' certificates carry ("" = the address's host)

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("a client certificate needs both its cert file and its key file")
        if self.ca_file:
            check_ca(self.ca_file)
        if self.cert_file:
            check_key_pair(self.cert_file, self.key_file)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=read_pem(self.ca_file, "CA file") if self.ca_file else None,
            private_key=read_pem(self.key_file, "private key") if self.key_file else None,
            certificate_chain=read_pem(self.cert_file, "certificate") if self.cert_file else None,
        )

    def options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []
