"""Fixtures of the HTTP API's tests: a real stack serving HTTP, and HTTP helpers.

``http_stack`` is one stack for the whole package (a gateway with its HTTP port, one encoder, one
language worker, each a process on 127.0.0.1, real Mooncake, ZMQ and gRPC), shared by the tests
that leave it as they found it; tests that kill a worker start their own.
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.procs import ServiceProcess, free_port
from tests.e2e.conftest import Stack, noise_image, png_bytes, start_stack

ARCH = "qwen2_5_vl"


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


IMAGE_URL = data_url(png_bytes(noise_image(21, 112)))


def image_message(text: str, url: str = IMAGE_URL) -> dict:
    image = {"type": "image_url", "image_url": {"url": url}}
    return {"role": "user", "content": [image, {"type": "text", "text": text}]}


def wait_for(condition: Callable[[], object], timeout_s: float, what: str) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """The data of each Server-Sent Event of a streamed answer: JSON objects, then "[DONE]"."""
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        yield data if data == "[DONE]" else json.loads(data)


def outcomes(stack: Stack) -> dict[tuple[str, str], float]:
    """The gateway's ``epd_gateway_requests_total`` by (outcome, api), from its metrics port."""
    text = httpx.get(f"http://127.0.0.1:{stack.metrics_ports['gateway']}/metrics").text
    found = {}
    for line in text.splitlines():
        if line.startswith("epd_gateway_requests_total{"):
            labels, value = line[len("epd_gateway_requests_total{") :].split("} ")
            pairs = dict(item.split("=") for item in labels.split(","))
            found[(pairs["outcome"].strip('"'), pairs["api"].strip('"'))] = float(value)
    return found


def start_http_stack(model_dir: Path, log_dir: Path, **kwargs) -> Stack:
    """A stack whose gateway serves HTTP on a free port, with metrics."""
    return start_stack(model_dir, log_dir, http_port=0, metrics=True, **kwargs)


@pytest.fixture(scope="session")
def http_stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = start_http_stack(tiny_model_dir(ARCH), tmp_path_factory.mktemp("http-stack"))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def client(http_stack: Stack) -> openai.OpenAI:
    """The official ``openai`` client on the shared stack."""
    return openai.OpenAI(base_url=http_stack.http_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> str:
    """The name the shared stack serves its checkpoint as."""
    return tiny_model_dir(ARCH).name


@pytest.fixture
def http(http_stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=http_stack.http_url, timeout=120) as client:
        yield client


def start_side_gateway(stack: Stack, log_dir: Path, *args: str) -> tuple[ServiceProcess, str]:
    """Another gateway process in front of ``stack``'s workers (as static workers), serving
    HTTP with its own settings ``args``; returns it and its HTTP URL."""
    port, registry, http_port = free_port(), free_port(), free_port()
    command = ["serve", "gateway", "--port", str(port), "--registry-port", str(registry),
               "--http-port", str(http_port), "--health-poll-s", "0.5",
               "--encoders", *(p.address for p in stack.encoders),
               "--languages", *(p.address for p in stack.languages), *args]  # fmt: skip
    proc = ServiceProcess(f"gateway-{port}", command, f"127.0.0.1:{port}", log_dir)
    try:
        proc.wait_healthy(60)
    except BaseException:
        proc.stop()
        raise
    return proc, f"http://127.0.0.1:{http_port}"
