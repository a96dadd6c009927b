"""TLS on the shared server and channel: server TLS, mutual TLS, a fixed server name, a renewed
certificate served without a restart, and bad files refused at start-up.

Certificates come from a CA made in the test with the ``openssl`` command."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest

from common.channels import ChannelSecurity, create_channel
from common.grpc_server import ServerSecurity
from common.tls import ClientTLS, ServerTLS
from tests.common.echo import serve_echo, unary
from tests.common.pki import make_ca


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(root, "ca"), make_ca(root, "other-ca")
    return {
        "ca": ca,
        "other": other,
        "server": ca.issue("server"),
        "client": ca.issue("client"),
        "stranger": other.issue("stranger"),
        "named": ca.issue("named", ("DNS:epd-internal",)),
        "renewed": other.issue("renewed"),
    }


def call(address: str, tls: ClientTLS | None) -> grpc.StatusCode:
    """Outcome of one short call to ``address`` on a fresh channel."""
    with create_channel(address, ChannelSecurity(tls=tls), keepalive=None) as channel:
        try:
            assert unary(channel, wait_for_ready=False) == b"ping"
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def served(tls: ServerTLS):
    server, port, echo = serve_echo(security=ServerSecurity(tls=tls))
    return server, f"127.0.0.1:{port}", echo


def test_server_tls(pki) -> None:
    server, address, echo = served(ServerTLS(pki["server"].cert, pki["server"].key))
    try:
        assert call(address, ClientTLS(pki["ca"].cert)) == grpc.StatusCode.OK
        assert call(address, None) == grpc.StatusCode.UNAVAILABLE  # plaintext client
        assert call(address, ClientTLS(pki["other"].cert)) == grpc.StatusCode.UNAVAILABLE
    finally:
        echo.release()
        server.stop(None)


def test_mutual_tls_refuses_clients_without_a_certificate_from_the_ca(pki) -> None:
    tls = ServerTLS(pki["server"].cert, pki["server"].key, pki["ca"].cert)
    assert tls.mutual
    server, address, echo = served(tls)
    ca = pki["ca"].cert
    try:
        client, stranger = pki["client"], pki["stranger"]
        assert call(address, ClientTLS(ca, client.cert, client.key)) == grpc.StatusCode.OK
        assert call(address, ClientTLS(ca)) == grpc.StatusCode.UNAVAILABLE
        refused = call(address, ClientTLS(ca, stranger.cert, stranger.key))
        assert refused == grpc.StatusCode.UNAVAILABLE
    finally:
        echo.release()
        server.stop(None)


def test_a_fixed_server_name_for_certificates_without_the_pod_address(pki) -> None:
    named = pki["named"]
    server, address, echo = served(ServerTLS(named.cert, named.key))
    try:
        ca = pki["ca"].cert
        assert call(address, ClientTLS(ca, server_name="epd-internal")) == grpc.StatusCode.OK
        assert call(address, ClientTLS(ca)) == grpc.StatusCode.UNAVAILABLE  # 127.0.0.1 unlisted
    finally:
        echo.release()
        server.stop(None)


def test_a_renewed_certificate_is_served_without_a_restart(pki, tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["server"].cert, cert)
    shutil.copy(pki["server"].key, key)
    server, address, echo = served(ServerTLS(str(cert), str(key)))
    old_ca, new_ca = ClientTLS(pki["ca"].cert), ClientTLS(pki["other"].cert)
    try:
        assert call(address, old_ca) == grpc.StatusCode.OK
        assert call(address, new_ca) == grpc.StatusCode.UNAVAILABLE
        key.write_bytes(Path(pki["renewed"].key).read_bytes())  # a torn update: key first
        assert call(address, old_ca) == grpc.StatusCode.OK  # keeps serving the old pair
        cert.write_bytes(Path(pki["renewed"].cert).read_bytes())
        assert call(address, new_ca) == grpc.StatusCode.OK
        assert call(address, old_ca) == grpc.StatusCode.UNAVAILABLE
    finally:
        echo.release()
        server.stop(None)


def test_bad_tls_files_are_start_up_errors_naming_them(pki, tmp_path: Path) -> None:
    server, client = pki["server"], pki["client"]
    with pytest.raises(ValueError, match="do not form a pair"):
        ServerTLS(server.cert, client.key)
    not_pem = tmp_path / "junk.pem"
    not_pem.write_text("hello")
    with pytest.raises(ValueError, match=f"{not_pem} is not a PEM file"):
        ServerTLS(str(not_pem), server.key)
    with pytest.raises(ValueError, match="cannot read CA file /nonexistent/ca.crt"):
        ServerTLS(server.cert, server.key, "/nonexistent/ca.crt")
    placeholder = tmp_path / "tls.crt"
    placeholder.write_text("REPLACE-ME: the PEM certificate chain\n")
    with pytest.raises(ValueError, match=f"{placeholder} still holds the REPLACE-ME placeholder"):
        ServerTLS(str(placeholder), server.key)
    with pytest.raises(ValueError, match="needs both"):
        ClientTLS(pki["ca"].cert, cert_file=client.cert)
    with pytest.raises(ValueError, match="CA file"):
        ClientTLS(server.key)
