"""The HTTP port's credentials, on a gateway served in-process (no workers needed): the public
port's API keys (401 in OpenAI's shape, ``/health`` open, refusals counted), its TLS files
(served over HTTPS, a renewed certificate picked up without a restart), who sees worker
addresses on the status page, and a served model name with slashes."""

from __future__ import annotations

import shutil
import socket
import ssl
import time
from pathlib import Path

import httpx
import pytest

from common.procs import free_port
from services.gateway.config import GatewayConfig
from services.gateway.registry import Role
from services.gateway.server import serve
from tests.common.pki import make_ca, write_secret
from tests.http.conftest import wait_for

WORKER = "10.1.2.3:4567"
CHAT = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    root = tmp_path_factory.mktemp("pki")
    ca, other = make_ca(root, "ca"), make_ca(root, "other-ca")
    return {"ca": ca, "server": ca.issue("server"), "renewed": other.issue("renewed"),
            "other": other}  # fmt: skip


@pytest.fixture
def start(tmp_path):
    """``start(**config)`` serves a gateway with HTTP on a free port; stopped after the test."""
    handles = []

    def make(worker: bool = False, **fields):
        """With ``worker``, a language worker at an unused address registers (for the page)."""
        fields.setdefault("ready_delay_s", 0.0)
        config = GatewayConfig(port=0, registry_port=0, http_port=free_port(), **fields)
        handles.append(serve(config))
        if worker:
            handles[-1].registry.heartbeat(WORKER, Role.LANGUAGE, 4, {"running": 1.0})
        return handles[-1]

    yield make
    for handle in handles:
        handle.stop(0)


def trusting(ca_file: str) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=ca_file)


def url(handle, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{handle.http_port}"


def counted(handle, outcome: str, api: str = "http") -> float:
    return handle.metrics.requests.labels(outcome, api)._value.get()


def test_health_follows_the_grpc_readiness(start) -> None:
    """/health (the HTTP readiness probe) says what the gRPC readiness says: starting within
    --ready-delay-s, ok, then stopping from the first moment of a drain."""
    handle = start(ready_delay_s=1.0)
    first = httpx.get(url(handle) + "/health")
    assert (first.status_code, first.json()["status"]) == (503, "starting")
    wait_for(lambda: httpx.get(url(handle) + "/health").status_code == 200, 10, "ready")
    handle.server.readiness.drain()  # what GatewayServer.drain does first
    drained = httpx.get(url(handle) + "/health")
    assert (drained.status_code, drained.json()["status"]) == (503, "stopping")


def test_api_keys_guard_the_api_but_not_health(start, tmp_path: Path) -> None:
    keys = write_secret(tmp_path / "keys", "key-one", "key-two")
    handle = start(api_keys_file=keys)
    with httpx.Client(base_url=url(handle)) as client:
        health = client.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        for headers, message in (
            ({}, "missing API key"),
            ({"Authorization": "Bearer nope"}, "invalid API key"),
            ({"Authorization": "Basic a2V5LW9uZQ=="}, "malformed Authorization header"),
        ):
            for method, path, body in (
                ("GET", "/v1/models", None),
                ("POST", "/v1/chat/completions", CHAT),
            ):
                reply = client.request(method, path, json=body, headers=headers)
                assert reply.status_code == 401, reply.text
                assert reply.headers["www-authenticate"] == "Bearer"
                error = reply.json()["error"]
                assert message in error["message"] and error["code"] == "invalid_api_key"
                assert error["type"] == "authentication_error"
                assert "key-one" not in reply.text
        assert counted(handle, "UNAUTHENTICATED") == 3.0  # the chat completions only
        for key in ("key-one", "key-two"):
            models = client.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert models.status_code == 200
            reply = client.post("/v1/chat/completions", json=CHAT,
                                headers={"Authorization": f"bearer {key}"})  # fmt: skip
            assert reply.status_code == 503  # past the key, refused for want of a worker
        assert counted(handle, "UNAVAILABLE") == 2.0


def test_tls_from_the_public_ports_files_and_renewed_without_restart(start, pki, tmp_path):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki["server"].cert, cert)
    shutil.copy(pki["server"].key, key)
    handle = start(tls_cert_file=str(cert), tls_key_file=str(key))
    health = httpx.get(url(handle, "https") + "/health", verify=trusting(pki["ca"].cert))
    assert health.status_code == 200
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(url(handle) + "/health")  # plaintext to a TLS port
    with pytest.raises(httpx.ConnectError):
        httpx.get(url(handle, "https") + "/health", verify=trusting(pki["other"].cert))
    # renew: another CA's certificate; new connections get it
    time.sleep(0.01)
    shutil.copy(pki["renewed"].cert, cert)
    shutil.copy(pki["renewed"].key, key)

    def issuer() -> str:
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        with socket.create_connection(("127.0.0.1", handle.http_port), timeout=5) as raw:
            with context.wrap_socket(raw) as tls:  # no server name sent (an IP)
                der = tls.getpeercert(binary_form=True)
        return ssl.DER_cert_to_PEM_cert(der)

    renewed = Path(pki["renewed"].cert).read_text()
    wait_for(lambda: issuer().split() == renewed.split(), 10, "the renewed certificate")
    reply = httpx.get(url(handle, "https") + "/health", verify=trusting(pki["other"].cert))
    assert reply.status_code == 200


def state(handle, headers: dict | None = None) -> dict:
    with httpx.Client(base_url=url(handle)) as client:
        return wait_for(
            lambda: (s := client.get("/dashboard/state", headers=headers).json())["workers"] and s,
            10,
            "the sampler's first look at the registry",
        )


def test_addresses_only_for_a_key_or_when_allowed(start, tmp_path: Path) -> None:
    open_hidden = start(worker=True)
    hidden = state(open_hidden)
    assert not hidden["show_addresses"]
    (row,) = hidden["workers"]
    assert "address" not in row and row["id"].startswith("language-") and WORKER not in str(hidden)
    assert row["queue"]["running"] == 1.0

    open_shown = start(worker=True, dashboard_show_addresses=True)
    assert state(open_shown)["workers"][0]["address"] == WORKER

    # with keys on, only a valid key shows addresses, whatever the flag says
    keyed = start(worker=True, api_keys=("k1",), dashboard_show_addresses=True)
    assert WORKER not in str(state(keyed))
    assert WORKER not in str(state(keyed, {"Authorization": "Bearer wrong"}))
    assert state(keyed, {"Authorization": "Bearer k1"})["workers"][0]["address"] == WORKER
    page = httpx.get(url(keyed) + "/dashboard")  # the page itself is open, its assets local
    assert (
        page.status_code == 200 and "default-src 'self'" in page.headers["content-security-policy"]
    )
    assert "http" not in page.text.replace("http-equiv", "")  # no CDN, nothing remote


def test_dashboard_off(start) -> None:
    handle = start(dashboard=False)
    assert httpx.get(url(handle) + "/dashboard").status_code == 404
    assert httpx.get(url(handle) + "/health").status_code == 200


def test_busy_http_port_is_an_error_naming_it() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot bind HTTP port 127.0.0.1:{port}"):
            serve(GatewayConfig(port=0, registry_port=0, http_port=port))


def test_a_served_name_with_slashes(start) -> None:
    handle = start(served_model_name="Qwen/Qwen2.5-VL-7B-Instruct")
    with httpx.Client(base_url=url(handle)) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "Qwen/Qwen2.5-VL-7B-Instruct"
        assert client.get("/v1/models/Qwen/Qwen2.5-VL-7B-Instruct").status_code == 200
        assert client.get("/v1/models/Qwen/other").json()["error"]["code"] == "model_not_found"
        spec = client.get("/openapi.json").json()
        assert "/v1/models/{model}" in spec["paths"]
