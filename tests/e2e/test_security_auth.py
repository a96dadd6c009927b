"""A stack with every credential on, in real processes: the public port over TLS with API
keys, the registry and the workers behind an internal token and mutual TLS.

Checked with real clients: grpcurl (TLS from a CA made here with ``openssl``, bearer keys) and
the project's own channel. Whoever lacks a credential is refused: a client without an API key,
a worker without the internal token (cannot register), a gateway without it (cannot call a
worker). With the right ones the whole stack serves an image request.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from common.channels import ChannelSecurity, create_channel
from common.procs import ServiceProcess, check_health, free_port
from common.secret_files import SecretFile
from common.tls import ClientTLS
from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.common.grpcurl import Credentials, grpcurl, needs_grpcurl, ok, refused
from tests.common.pki import make_ca, write_secret
from tests.e2e.conftest import STARTUP_S, Stack, noise_image, png_bytes, start_stack

pytestmark = needs_grpcurl
API_KEYS = ("user-key-1", "user-key-2")
TOKEN = "internal-token-0123456789"
SERVER_NAME = "epd-internal"
GATEWAY_PROTO = "protos/epd/v1/gateway.proto"
LANGUAGE_PROTO = "protos/epd/v1/language.proto"


class Secrets:
    """The PKI and secret files of the test deployment."""

    def __init__(self, root: Path) -> None:
        self.ca = make_ca(root / "pki")
        self.public = self.ca.issue("gateway-public")  # localhost, 127.0.0.1
        self.internal = self.ca.issue("internal", (f"DNS:{SERVER_NAME}",))  # no pod address
        self.api_keys = write_secret(root / "api-keys", "# one key per line", *API_KEYS)
        self.token = write_secret(root / "internal-token", TOKEN)

    def internal_env(self, token: bool = True) -> dict[str, str]:
        return {
            "EPD_INTERNAL_TOKEN_FILE": self.token if token else "",
            "EPD_INTERNAL_TLS_CERT_FILE": self.internal.cert,
            "EPD_INTERNAL_TLS_KEY_FILE": self.internal.key,
            "EPD_INTERNAL_TLS_CA_FILE": self.ca.cert,
            "EPD_INTERNAL_TLS_SERVER_NAME": SERVER_NAME,
        }

    def internal_tls(self) -> ClientTLS:
        return ClientTLS(self.ca.cert, self.internal.cert, self.internal.key, SERVER_NAME)

    def internal_grpcurl(self, token: str = TOKEN) -> Credentials:
        cert, key = self.internal.cert, self.internal.key
        return Credentials(self.ca.cert, cert, key, token, SERVER_NAME)


@pytest.fixture(scope="module")
def secrets(tmp_path_factory) -> Secrets:
    return Secrets(tmp_path_factory.mktemp("secrets"))


@pytest.fixture(scope="module")
def stack(secrets: Secrets, tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = start_stack(
        tiny_model_dir("qwen2_vl"),
        tmp_path_factory.mktemp("secure-stack"),
        gateway_args=(
            "--tls-cert-file",
            secrets.public.cert,
            "--tls-key-file",
            secrets.public.key,
            "--api-keys-file",
            secrets.api_keys,
        ),  # fmt: skip
        env=secrets.internal_env(),
        public=ChannelSecurity(token=API_KEYS[0], tls=ClientTLS(secrets.ca.cert)),
        internal=ChannelSecurity(token=SecretFile(secrets.token), tls=secrets.internal_tls()),
    )
    yield stack
    stack.stop()


def generate_request(text: str, image: bytes | None = None, max_tokens: int = 4):
    content = [common_pb2.ContentPart(text=text)]
    if image is not None:
        content.insert(0, common_pb2.ContentPart(image=common_pb2.ImageSource(data=image)))
    return gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=content)],
        sampling=common_pb2.SamplingParams(max_new_tokens=max_tokens, ignore_eos=True),
    )


def test_a_fully_secured_stack_serves_an_image_request(stack: Stack) -> None:
    image = png_bytes(noise_image(3, 112))
    with stack.channel() as channel:
        chunks = list(
            gateway_pb2_grpc.GatewayStub(channel).Generate(
                generate_request("What is this?", image), timeout=60
            )
        )
    final = chunks[-1]
    assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert final.usage.completion_tokens == 4
    assert final.encoder == stack.encoders[0].address
    assert final.language == stack.languages[0].address
    assert sum(len(c.token_ids) for c in chunks) == 4


def test_grpcurl_over_tls_with_an_api_key(stack: Stack, secrets: Secrets) -> None:
    address = stack.gateway.address
    user = Credentials(cacert=secrets.ca.cert, token=API_KEYS[1])
    assert "epd.v1.Gateway" in ok(grpcurl(address, "list", creds=user)).split()
    data = {
        "messages": [{"role": "user", "content": [{"text": "Hello"}]}],
        "sampling": {"maxNewTokens": 3, "ignoreEos": True},
    }
    reply = json.loads(ok(grpcurl(address, "epd.v1.Gateway/GenerateUnary", creds=user, data=data)))
    assert reply["finish_reason"] == "FINISH_REASON_LENGTH" and len(reply["token_ids"]) == 3


def test_the_public_port_refuses_calls_without_a_valid_key(stack: Stack, secrets: Secrets) -> None:
    address, ca = stack.gateway.address, secrets.ca.cert
    data = {"messages": [{"role": "user", "content": [{"text": "Hello"}]}]}

    def generate(creds: Credentials):
        return grpcurl(address, "epd.v1.Gateway/GenerateUnary", creds=creds, data=data,
                       proto=GATEWAY_PROTO)  # fmt: skip

    assert "missing API key" in refused(generate(Credentials(cacert=ca)), "Unauthenticated")
    wrong = Credentials(cacert=ca, token="user-key-3")
    assert "invalid API key" in refused(generate(wrong), "Unauthenticated")
    refused(grpcurl(address, "list", creds=Credentials(cacert=ca)), "Unauthenticated")
    # probes need no key (grpcurl would need reflection, which does: ask grpcio itself)
    assert check_health(address, 5.0, security=ChannelSecurity(tls=ClientTLS(ca)))
    plaintext = grpcurl(address, "grpc.health.v1.Health/Check")
    assert plaintext.returncode != 0  # TLS only


def test_internal_ports_demand_the_token_and_a_client_certificate(
    stack: Stack, secrets: Secrets
) -> None:
    internal = secrets.internal_grpcurl()
    listed = json.loads(ok(grpcurl(stack.registry_address, "epd.v1.WorkerRegistry/ListWorkers",
                                   creds=internal)))  # fmt: skip
    assert {w["address"] for w in listed["workers"]} == {
        p.address for p in stack.encoders + stack.languages
    }
    no_token = secrets.internal_grpcurl(token="")
    for address, method, proto in (
        (stack.registry_address, "epd.v1.WorkerRegistry/ListWorkers", ""),
        (stack.languages[0].address, "epd.v1.LanguageService/GetLoad", LANGUAGE_PROTO),
    ):
        refusal = refused(grpcurl(address, method, creds=no_token, data={}, proto=proto),
                          "Unauthenticated")  # fmt: skip
        assert "missing internal token" in refusal
        wrong = secrets.internal_grpcurl(token="guess")
        assert "invalid internal token" in refused(
            grpcurl(address, method, creds=wrong, data={}, proto=proto), "Unauthenticated"
        )
        tls_only = ChannelSecurity(tls=secrets.internal_tls())
        assert check_health(address, 5.0, security=tls_only)
        anonymous = Credentials(cacert=secrets.ca.cert, token=TOKEN, servername=SERVER_NAME)
        no_cert = grpcurl(address, method, creds=anonymous, data={}, proto=proto)
        assert no_cert.returncode != 0 and "Code:" not in no_cert.stderr  # handshake refused


def wait_for_log(proc: ServiceProcess, text: str, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        log = proc.log_path.read_text(errors="replace")
        if text in log:
            return log
        assert proc.alive(), proc.tail()
        time.sleep(0.2)
    raise AssertionError(f"{proc.name} never logged {text!r}:\n{proc.tail()}")


def test_a_worker_without_the_internal_token_cannot_register(
    stack: Stack, secrets: Secrets, tiny_model_dir, tmp_path: Path
) -> None:
    port = free_port()
    model = str(tiny_model_dir("qwen2_vl"))
    cmd = ["serve", "language", "--model-path", model, "--port", str(port), "--gateway",
           stack.registry_address, "--heartbeat-interval-s", "0.5"]  # fmt: skip
    worker = ServiceProcess("tokenless", cmd, f"127.0.0.1:{port}", tmp_path,
                            secrets.internal_env(token=False), stack.internal)  # fmt: skip
    try:
        worker.wait_healthy(STARTUP_S)
        log = wait_for_log(worker, "failed: UNAUTHENTICATED")
        assert "missing internal token" in log
        time.sleep(1.0)  # two more heartbeat intervals: still refused
        assert worker.address not in {w.address for w in stack.workers()}
    finally:
        worker.stop()


def test_a_gateway_without_the_internal_token_cannot_call_a_worker(
    stack: Stack, secrets: Secrets, tmp_path: Path
) -> None:
    port = free_port()
    language = stack.languages[0].address
    cmd = ["serve", "gateway", "--port", str(port), "--registry-port", "0", "--languages",
           language, "--health-poll-s", "60"]  # fmt: skip
    gateway = ServiceProcess("tokenless-gateway", cmd, f"127.0.0.1:{port}", tmp_path,
                             secrets.internal_env(token=False))  # fmt: skip
    try:
        gateway.wait_healthy(STARTUP_S)
        with create_channel(gateway.address) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(
                    generate_request("Hello"), timeout=30
                )
        assert exc.value.code() != grpc.StatusCode.OK
        assert language in exc.value.details()
        assert "missing internal token" in exc.value.details()
    finally:
        gateway.stop()
    with stack.channel() as channel:  # the worker still serves the gateway that has the token
        reply = gateway_pb2_grpc.GatewayStub(channel).GenerateUnary(
            generate_request("Hello"), timeout=30
        )
    assert reply.usage.completion_tokens == 4
