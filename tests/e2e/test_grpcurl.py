"""A client nobody here wrote: grpcurl, through server reflection and JSON only."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Stack, noise_image, png_bytes, start_stack

GRPCURL = Path(sys.executable).parent / "grpcurl"
MAX_TOKENS = 4

pytestmark = pytest.mark.skipif(
    not GRPCURL.exists() and shutil.which("grpcurl") is None, reason="grpcurl not installed"
)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = start_stack(tiny_model_dir("qwen2_5_vl"), tmp_path_factory.mktemp("grpcurl"))
    yield stack
    stack.stop()


def grpcurl(stack: Stack, *args: str, data: dict | None = None) -> str:
    exe = str(GRPCURL) if GRPCURL.exists() else "grpcurl"
    cmd = [exe, "-plaintext", "-max-time", "60"]
    if data is not None:
        cmd += ["-d", "@"]
    proc = subprocess.run(
        [*cmd, stack.gateway.address, *args],
        input=json.dumps(data) if data is not None else None,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one JSON object per streamed message, pretty-printed back to back, with
    the proto's own (snake_case) field names; it accepts camelCase or snake_case as input."""
    decoder, objects, pos = json.JSONDecoder(), [], 0
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
            continue
        obj, pos = decoder.raw_decode(text, pos)
        objects.append(obj)
    return objects


def test_reflection_lists_the_services(stack: Stack) -> None:
    services = set(grpcurl(stack, "list").split())
    assert {"epd.v1.Gateway", "grpc.health.v1.Health"} <= services
    assert "epd.v1.WorkerRegistry" not in services  # internal: on the registry port only
    methods = set(grpcurl(stack, "list", "epd.v1.Gateway").split())
    assert {"epd.v1.Gateway.Generate", "epd.v1.Gateway.Abort"} <= methods
    described = grpcurl(stack, "describe", "epd.v1.GenerateChunk")
    assert "finish_reason" in described and "token_ids" in described


def test_health_check(stack: Stack) -> None:
    assert json.loads(grpcurl(stack, "grpc.health.v1.Health/Check")) == {"status": "SERVING"}
    reply = grpcurl(stack, "grpc.health.v1.Health/Check", data={"service": "epd.v1.Gateway"})
    assert json.loads(reply)["status"] == "SERVING"


def _check_stream(chunks: list[dict], expected_ids: list[int]) -> None:
    assert len(chunks) >= 2
    assert all(c["request_id"] == chunks[0]["request_id"] for c in chunks)
    assert "finish_reason" not in chunks[0] and all("finish_reason" not in c for c in chunks[:-1])
    final = chunks[-1]
    assert final["finish_reason"] in ("FINISH_REASON_STOP", "FINISH_REASON_LENGTH")
    assert final["usage"]["completion_tokens"] == len(expected_ids)
    assert float(final["timing"]["total_s"]) > 0
    assert [t for c in chunks for t in c.get("token_ids", [])] == expected_ids


def test_generate_text(stack: Stack) -> None:
    data = {
        "messages": [{"role": "user", "content": [{"text": "Hello"}]}],
        "sampling": {"maxNewTokens": MAX_TOKENS},
    }
    chunks = json_stream(grpcurl(stack, "epd.v1.Gateway/Generate", data=data))
    with stack.client() as client:
        expected = list(client.generate("Hello", max_tokens=MAX_TOKENS, timeout=30).token_ids)
    _check_stream(chunks, expected)
    assert "encoder" not in chunks[-1]  # text only: empty string, omitted in JSON


@pytest.mark.parametrize("field", ["base64", "data"])
def test_generate_with_base64_image(stack: Stack, field: str) -> None:
    image = png_bytes(noise_image(5, 112))
    text = base64.b64encode(image).decode()
    source = {"base64": f"data:image/png;base64,{text}"} if field == "base64" else {"data": text}
    data = {
        "messages": [{"role": "user", "content": [{"image": source}, {"text": "What is this?"}]}],
        "sampling": {"maxNewTokens": MAX_TOKENS},
    }
    chunks = json_stream(grpcurl(stack, "epd.v1.Gateway/Generate", data=data))
    with stack.client() as client:
        reference = client.generate("What is this?", [image], max_tokens=MAX_TOKENS, timeout=30)
    _check_stream(chunks, list(reference.token_ids))
    final = chunks[-1]
    assert final["encoder"] == stack.encoders[0].address
    assert int(final["usage"]["prompt_tokens"]) == reference.usage.prompt_tokens


def test_errors_come_back_as_statuses(stack: Stack) -> None:
    exe = str(GRPCURL) if GRPCURL.exists() else "grpcurl"
    proc = subprocess.run(
        [
            exe,
            "-plaintext",
            "-d",
            '{"messages": []}',
            stack.gateway.address,
            "epd.v1.Gateway/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "InvalidArgument" in proc.stderr and "messages must not be empty" in proc.stderr
