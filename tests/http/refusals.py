"""A gateway process with the request limits of ``tests/gateway/test_validation.py`` and no
workers, for the HTTP refusal tests (everything they send is refused before routing), and the
JSON builders and checks they share."""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from common.procs import ServiceProcess, free_port
from tests.gateway.test_validation import LIMITS

SERVED = "served-name"
TINY_URL = "data:image/png;base64," + base64.b64encode(b"\x89PNG").decode()
MAX_MESSAGE_MB = 1


def base() -> dict:
    """The JSON twin of ``test_validation.make_request``."""
    return {
        "model": SERVED,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": TINY_URL}},
                    {"type": "text", "text": "Describe it."},
                ],
            }
        ],
    }


def edit(fn: Callable[[dict], object], **fields: object) -> dict:
    body = base()
    body.update(fields)
    fn(body)
    return body


def add_message(body: dict, role: str = "user", content: object = "x") -> None:
    body["messages"].append({"role": role, "content": content})


def add_image(body: dict, url: object) -> None:
    body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": url}})


def image_part(url: str) -> list:
    return [{"type": "image_url", "image_url": {"url": url}}]


# name (as in test_validation.BAD) -> (body, headers, param, words the message must contain)


@dataclasses.dataclass
class Gateway:
    proc: ServiceProcess
    url: str
    metrics_port: int


def limits_gateway(log_dir: Path) -> Iterator[Gateway]:
    """A gateway process with the suite's limits, no workers, metrics on."""
    limits = [
        arg
        for f in dataclasses.fields(LIMITS)
        for arg in (f"--{f.name.replace('_', '-')}", str(getattr(LIMITS, f.name)))
    ]
    port, registry, http_port, metrics = (free_port() for _ in range(4))
    args = ["serve", "gateway", "--port", str(port), "--registry-port", str(registry),
            "--http-port", str(http_port), "--metrics-port", str(metrics),
            "--served-model-name", SERVED, "--default-max-new-tokens", "16",
            "--max-message-mb", str(MAX_MESSAGE_MB), *limits]  # fmt: skip
    proc = ServiceProcess("gateway", args, f"127.0.0.1:{port}", log_dir)
    try:
        proc.wait_healthy(60)
        yield Gateway(proc, f"http://127.0.0.1:{http_port}", metrics)
    finally:
        proc.stop()


def post(gateway: Gateway, body: dict | bytes, headers: dict | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json", **(headers or {})}
    return httpx.post(
        gateway.url + "/v1/chat/completions", content=content, headers=headers, timeout=30
    )


def assert_error(reply: httpx.Response, status: int, param: str | None, words: list[str]) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"].startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], (word, error["message"])
    return error


def counted_refusals(gateway: Gateway) -> dict[str, float]:
    """``epd_gateway_requests_total`` by outcome; every series must have ``api="http"``."""
    text = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics").text
    counted = {}
    for line in text.splitlines():
        if line.startswith("epd_gateway_requests_total{"):
            labels, value = line[len("epd_gateway_requests_total{") :].split("} ")
            pairs = dict(item.replace('"', "").split("=") for item in labels.split(","))
            assert pairs["api"] == "http", line
            counted[pairs["outcome"]] = float(value)
    return counted
