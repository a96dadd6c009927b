"""``GatewayClient`` against real in-process gRPC servers: retry on the next gateway while one is
unavailable, never after a chunk was returned; the API key on every call; TLS with a CA file.

The servers are scripted ``Gateway`` services (they answer from a script, not from workers):
what is under test is the client's behaviour on the wire.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from protos.epd.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.client import GatewayClient, parse_addresses


class ScriptedGateway(gateway_pb2_grpc.GatewayServicer):
    """Streams ``num_chunks`` chunks, then fails with ``fail_after`` if set."""

    def __init__(self, name: str, num_chunks: int = 3, fail_after: grpc.StatusCode | None = None):
        self.name = name
        self.num_chunks = num_chunks
        self.fail_after = fail_after
        self.calls: list[tuple[str, dict[str, str]]] = []
        self.live: set[str] = set()
        self.release = threading.Event()
        self.release.set()
        self.aborted: set[str] = set()

    def _seen(self, rpc: str, context) -> None:
        self.calls.append((rpc, dict(context.invocation_metadata())))

    def Generate(self, request, context):  # noqa: N802
        self._seen("Generate", context)
        self.live.add(request.request_id)
        try:
            for i in range(self.num_chunks):
                yield gateway_pb2.GenerateChunk(text=self.name, token_ids=[i])
                self.release.wait(10)
                if request.request_id in self.aborted:  # as the gateway ends an aborted stream
                    context.abort(grpc.StatusCode.CANCELLED, "request aborted")
            if self.fail_after is not None:
                context.abort(self.fail_after, f"{self.name} failed mid-stream")
        finally:
            self.live.discard(request.request_id)

    def GenerateUnary(self, request, context):  # noqa: N802
        self._seen("GenerateUnary", context)
        if self.fail_after is not None:
            context.abort(self.fail_after, f"{self.name} refused")
        return gateway_pb2.GenerateResponse(text=self.name, token_ids=[1])

    def Abort(self, request, context):  # noqa: N802
        self._seen("Abort", context)
        if request.request_id not in self.live:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r}")
        self.aborted.add(request.request_id)
        self.release.set()
        return gateway_pb2.AbortResponse(aborted=True)


def serve(servicer: ScriptedGateway, credentials=None) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.so_reuseport", 0)])
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    if credentials is None:
        port = server.add_insecure_port("127.0.0.1:0")
    else:
        port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def servers():
    started: list[grpc.Server] = []

    def start(servicer: ScriptedGateway, credentials=None) -> str:
        server, address = serve(servicer, credentials)
        started.append(server)
        return address

    yield start
    for server in started:
        server.stop(0)


def stopped_address() -> str:
    """An address where a gateway was and is no more (connection refused)."""
    server, address = serve(ScriptedGateway("gone"))
    server.stop(0).wait()
    return address


def texts(stream) -> list[str]:
    return [chunk.text for chunk in stream]


def test_unavailable_gateway_is_skipped_and_the_next_serves(servers) -> None:
    live = ScriptedGateway("live")
    dead = stopped_address()
    with GatewayClient(f"{dead},{servers(live)}") as client:
        assert texts(client.generate_stream("hi", timeout=10)) == ["live"] * 3
        assert client.generate("hi", timeout=10).text == "live"
        # the gateway that answered is tried first from now on
        assert client.attempt_order() == [1, 0]
    assert [rpc for rpc, _ in live.calls] == ["Generate", "GenerateUnary"]


def test_unavailable_answer_before_any_chunk_moves_on(servers) -> None:
    draining = ScriptedGateway("draining", num_chunks=0, fail_after=grpc.StatusCode.UNAVAILABLE)
    live = ScriptedGateway("live")
    addresses = [servers(draining), servers(live)]
    with GatewayClient(addresses) as client:
        assert texts(client.generate_stream("hi", timeout=10)) == ["live"] * 3
    with GatewayClient(addresses) as client:
        assert client.generate("hi", timeout=10).text == "live"
    assert [rpc for rpc, _ in draining.calls] == ["Generate", "GenerateUnary"]
    assert [rpc for rpc, _ in live.calls] == ["Generate", "GenerateUnary"]


def test_no_retry_once_a_chunk_was_returned(servers) -> None:
    flaky = ScriptedGateway("flaky", num_chunks=2, fail_after=grpc.StatusCode.UNAVAILABLE)
    spare = ScriptedGateway("spare")
    with GatewayClient([servers(flaky), servers(spare)]) as client:
        stream = client.generate_stream("hi", timeout=10)
        got = []
        with pytest.raises(grpc.RpcError) as info:
            for chunk in stream:
                got.append(chunk.text)
        assert got == ["flaky", "flaky"]
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "flaky failed mid-stream" in info.value.details()
    assert spare.calls == []


def test_other_errors_and_the_last_gateway_surface(servers) -> None:
    invalid = ScriptedGateway("bad", num_chunks=0, fail_after=grpc.StatusCode.INVALID_ARGUMENT)
    spare = ScriptedGateway("spare")
    with GatewayClient([servers(invalid), servers(spare)]) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("hi", timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate_stream("hi", timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert spare.calls == []
    with GatewayClient([stopped_address(), stopped_address()]) as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("hi", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as info:
            list(client.generate_stream("hi", timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_cancel_ends_the_stream_and_abort_goes_to_the_serving_gateway(servers) -> None:
    other = ScriptedGateway("other")
    serving = ScriptedGateway("serving", num_chunks=5)
    serving.release.clear()  # holds the stream after each chunk until aborted
    with GatewayClient([stopped_address(), servers(other), servers(serving)]) as client:
        client._preferred = 2
        stream = client.generate_stream("hi", timeout=10, request_id="job-7")
        assert next(stream).text == "serving"
        assert client.abort("job-7") is True
        assert [rpc for rpc, _ in serving.calls] == ["Generate", "Abort"]
        assert other.calls == []  # the serving gateway was asked first
        stream.cancel()
        with pytest.raises(grpc.RpcError) as info:
            list(stream)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        with pytest.raises(grpc.RpcError) as info:
            client.abort("job-7")  # finished: every gateway says NOT_FOUND
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_api_key_is_sent_on_every_call(servers) -> None:
    gateway = ScriptedGateway("keyed", num_chunks=1)
    with GatewayClient(servers(gateway), api_key="s3cret") as client:
        list(client.generate_stream("hi", timeout=10, request_id="r"))
        client.generate("hi", timeout=10)
        with pytest.raises(grpc.RpcError):
            client.abort("r")
    assert [rpc for rpc, _ in gateway.calls] == ["Generate", "GenerateUnary", "Abort"]
    assert all(md.get("authorization") == "Bearer s3cret" for _, md in gateway.calls)
    with GatewayClient(servers(plain := ScriptedGateway("plain", 1))) as client:
        client.generate("hi", timeout=10)
    assert "authorization" not in plain.calls[0][1]


def make_certificates(directory: Path) -> tuple[bytes, bytes, bytes]:
    """(CA certificate, server key, server certificate for 127.0.0.1 and localhost)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=test CA")
    openssl("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n")
    sign = ("-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-extfile", "san.ext")
    openssl("x509", "-req", "-in", "server.csr", *sign, "-out", "server.pem")
    return tuple((directory / name).read_bytes() for name in ("ca.pem", "server.key", "server.pem"))


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_tls_with_a_ca_file(servers, tmp_path: Path) -> None:
    ca, key, cert = make_certificates(tmp_path)
    gateway = ScriptedGateway("tls", num_chunks=2)
    address = servers(gateway, grpc.ssl_server_credentials([(key, cert)]))
    with GatewayClient(address, api_key="k", tls_ca=tmp_path / "ca.pem") as client:
        assert texts(client.generate_stream("hi", timeout=10)) == ["tls", "tls"]
    with GatewayClient(address.replace("127.0.0.1", "localhost"), tls_ca=ca) as client:
        assert client.generate("hi", timeout=10).text == "tls"
    with GatewayClient(address) as client:  # plaintext to a TLS port fails, clearly
        with pytest.raises(grpc.RpcError) as info:
            client.generate("hi", timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert gateway.calls[0][1]["authorization"] == "Bearer k"


def test_addresses_are_checked() -> None:
    assert parse_addresses("a:1, b:2,") == ["a:1", "b:2"]
    assert parse_addresses(["a:1,b:2", "[::1]:3"]) == ["a:1", "b:2", "[::1]:3"]
    for bad in ("", "nohost", "a:", ":5", "a:b", "a:0", "a:70000"):
        with pytest.raises(ValueError):
            parse_addresses(bad)
