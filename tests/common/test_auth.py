"""Bearer secrets: files that follow rotation, constant-time matching, the server interceptor
(health open, everything else refused without a valid secret) and the client channel that
presents one. Real in-process gRPC servers and channels."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from common.auth import BearerAuthInterceptor, BearerKeys, bearer_metadata, presented_secret
from common.channels import ChannelSecurity, create_channel
from common.grpc_server import ServerSecurity
from common.secret_files import SecretFile, read_secret_lines
from tests.common.echo import SERVICE, serve_echo, stream, unary
from tests.common.pki import write_secret


def rewrite(path: Path, *lines: str) -> None:
    """New content with a new mtime, as a Secret update would leave it."""
    write_secret(path, *lines)
    stamp = time.time_ns() + 10**9
    os.utime(path, ns=(stamp, stamp))


def test_secret_lines_skip_blanks_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotation: new key below\n\n  key-one  \nkey-two\n")
    assert read_secret_lines(path) == ("key-one", "key-two")


@pytest.mark.parametrize(
    "content", [None, "", "# only a comment\n\n", "REPLACE-ME: one API key per line\n"]
)
def test_a_missing_or_empty_secret_file_is_an_error_naming_it(tmp_path: Path, content) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=str(path)):
        SecretFile(path)


def test_secret_file_follows_rotation_and_keeps_the_last_good_secrets(tmp_path: Path) -> None:
    path = tmp_path / "token"
    write_secret(path, "old")
    secrets = SecretFile(path, recheck_s=0)
    assert secrets.values() == ("old",)
    rewrite(path, "new", "old")
    assert secrets.values() == ("new", "old") and secrets.first() == "new"
    rewrite(path)  # emptied (a half-written update): keep what worked
    assert secrets.values() == ("new", "old")
    path.unlink()
    assert secrets.values() == ("new", "old")


def test_bearer_keys_accept_exactly_the_configured_secrets(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    write_secret(path, "file-key")
    keys = BearerKeys([" static-key ", ""], SecretFile(path, recheck_s=0))
    assert keys.check("static-key") and keys.check("file-key")
    for wrong in ("", "static", "static-key ", "file-key2", "FILE-KEY"):
        assert not keys.check(wrong), wrong
    rewrite(path, "rotated")
    assert keys.check("rotated") and not keys.check("file-key") and keys.check("static-key")
    with pytest.raises(ValueError):
        BearerKeys(["", "  "])


def test_presented_secret_parsing() -> None:
    assert presented_secret(bearer_metadata("abc")) == "abc"
    assert presented_secret([("authorization", "bearer  abc ")]) == "abc"
    assert presented_secret([("authorization", b"Bearer abc")]) == "abc"
    assert presented_secret([("authorization", "Basic abc")]) == ""
    assert presented_secret([("authorization", "Bearer")]) == ""
    assert presented_secret([("x-other", "Bearer abc")]) is None
    assert presented_secret(None) is None


@pytest.fixture
def keyed_server(tmp_path: Path):
    keys = BearerKeys(file=SecretFile(write_secret(tmp_path / "keys", "good-key"), recheck_s=0))
    security = ServerSecurity(auth=BearerAuthInterceptor(keys, "API key"))
    server, port, echo = serve_echo(max_streams=1, security=security)
    yield f"127.0.0.1:{port}", server, tmp_path / "keys"
    echo.release()
    server.stop(None)


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value.code(), exc.value.details()


def test_calls_without_a_valid_key_are_unauthenticated(keyed_server) -> None:
    address, server, _ = keyed_server
    with create_channel(address) as channel:
        code, message = refusal(lambda: unary(channel))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert message == "missing API key: send metadata 'authorization: Bearer <API key>'"
        code, message = refusal(lambda: unary(channel, metadata=bearer_metadata("bad-key")))
        assert (code, message) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        basic = [("authorization", "Basic good-key")]
        code, message = refusal(lambda: unary(channel, metadata=basic))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "malformed" in message
        code, _ = refusal(lambda: list(stream(channel)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        assert server.capacity.in_flight == 0  # a refused call takes no stream slot
        assert unary(channel, metadata=bearer_metadata("good-key")) == b"ping"


def test_health_is_open_and_reflection_needs_a_key(keyed_server) -> None:
    address, _, _ = keyed_server
    with create_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = [reflection_pb2.ServerReflectionRequest(list_services="")]
        code, _ = refusal(lambda: list(stub.ServerReflectionInfo(iter(ask), timeout=5)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        (answer,) = stub.ServerReflectionInfo(
            iter(ask), timeout=5, metadata=bearer_metadata("good-key")
        )
        names = {s.name for s in answer.list_services_response.service}
        assert SERVICE in names


def test_a_channel_with_a_token_file_presents_the_current_token(keyed_server) -> None:
    address, _, keys_path = keyed_server
    token = keys_path.parent / "client-token"
    write_secret(token, "good-key")
    security = ChannelSecurity(token=SecretFile(token, recheck_s=0))
    with create_channel(address, security) as channel:
        assert unary(channel) == b"ping"
        call = stream(channel)
        assert next(call) == b"started"
        call.cancel()
        rewrite(token, "other-key")  # the client rotated first: refused until the server has it
        code, message = refusal(lambda: unary(channel))
        assert (code, message) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
        rewrite(keys_path, "good-key", "other-key")
        assert unary(channel) == b"ping"
        explicit = bearer_metadata("good-key")  # metadata the caller sets itself wins
        assert unary(channel, metadata=explicit) == b"ping"
