"""The gateway and pools that differ: encoders of another wire dtype get no image rows to send,
and a request whose language half is refused leaves nothing behind on its encoder.

Workers are added to a stack one by one with their own flags and environment (``add_worker``),
as pods of different shapes would register with one gateway.
"""

from __future__ import annotations

import json
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from common.procs import ServiceProcess, free_port
from protos.epd.v1 import encoder_pb2, encoder_pb2_grpc
from services.gateway.client import build_request
from services.gateway.keys import routing_key
from services.gateway.registry import Role, Worker
from services.gateway.routing import EncoderAffinityPolicy, RoutingKey
from services.gateway.workers import create_channel
from tests.e2e.conftest import FAST_TRANSFER_ENV, STARTUP_S, Stack, noise_image, png_bytes
from tests.e2e.test_faults import stream_in_background, wait_for

ARCH = "qwen2_5_vl"


def add_worker(
    stack: Stack,
    model_dir: Path,
    log_dir: Path,
    role: str,
    name: str,
    args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> ServiceProcess:
    """Start one more worker that registers with ``stack``'s gateway; stopped with the stack."""
    port = free_port()
    cmd = ["serve", role, "--model-path", str(model_dir), "--port", str(port)]
    cmd += ["--gateway", stack.registry_address, "--heartbeat-interval-s", "0.5", *args]
    env = {**FAST_TRANSFER_ENV, **(env or {})}
    proc = ServiceProcess(name, cmd, f"127.0.0.1:{port}", log_dir, env)
    (stack.encoders if role == "encoder" else stack.languages).append(proc)
    proc.wait_healthy(STARTUP_S)
    stack.wait_registered()
    return proc


def encoder_state(address: str) -> tuple[int, int, int]:
    """(queued requests, queued images, sender blocks in use) from the encoder's GetLoad."""
    with create_channel(address) as channel:
        load = encoder_pb2_grpc.EncoderStub(channel).GetLoad(
            encoder_pb2.GetLoadRequest(), timeout=5
        )
    used = json.loads(load.sender_stats_json or "{}").get("num_used_blocks", 0)
    return load.num_queued_requests, load.num_queued_images, used


# ---- pairing by transfer layout ----------------------------------------------------------


def image_preferred_by(address: str, other: str) -> bytes:
    """A PNG whose routing key the encoder affinity policy sends to ``address`` over ``other``."""
    workers = [Worker(a, Role.ENCODER, 8, False, None) for a in (address, other)]
    policy = EncoderAffinityPolicy(slack=4)
    for seed in range(1000):
        image = png_bytes(noise_image(500 + seed, 112))
        key: RoutingKey = routing_key(list(build_request("Which?", [image]).messages))
        if policy.order(workers, key)[0].address == address:
            return image
    raise AssertionError("no image prefers the encoder")


def test_encoders_of_another_wire_dtype_get_no_image_requests(
    tiny_model_dir, stack_factory, tmp_path
) -> None:
    model_dir = tiny_model_dir(ARCH)
    stack = stack_factory(model_dir)  # a language worker and an encoder in bfloat16 (default)
    fp32 = add_worker(
        stack, model_dir, tmp_path, "encoder", "encoder-fp32", env={"EPD_TRANSFER_DTYPE": "float32"}
    )
    bf16 = stack.encoders[0]
    workers = {w.address: w for w in stack.workers()}
    if not all(w.transfer_layout.dtype for w in workers.values()):
        pytest.skip("the workers do not advertise their transfer layout in GetLoad yet")
    assert workers[bf16.address].transfer_layout.dtype == "bfloat16"
    assert workers[fp32.address].transfer_layout.dtype == "float32"
    assert workers[bf16.address].problem == "" and workers[stack.languages[0].address].problem == ""
    assert workers[fp32.address].problem.startswith(
        "no language worker shares this transfer layout (float32, hidden "
    )
    # images that affinity alone would send to the float32 encoder go to the bfloat16 one
    with stack.client() as client:
        for i in range(3):
            if i == 0:
                image = image_preferred_by(fp32.address, bf16.address)
            else:
                image = png_bytes(noise_image(900 + i, 112))
            reply = client.generate(f"Which one? {i}", [image], max_tokens=4, timeout=60)
            assert reply.encoder == bf16.address and len(reply.token_ids) == 4
    with create_channel(fp32.address) as channel:
        load = encoder_pb2_grpc.EncoderStub(channel).GetLoad(
            encoder_pb2.GetLoadRequest(), timeout=5
        )
    assert load.num_images_encoded == 0
    # without a compatible encoder, image requests fail and say why; text still works
    bf16.kill(signal.SIGKILL)
    wait_for(
        lambda: bf16.address not in {w.address for w in stack.workers() if w.healthy},
        15,
        "the bfloat16 encoder to be dropped",
    )
    with stack.client() as client:
        with pytest.raises(grpc.RpcError) as info:
            client.generate("Which?", [png_bytes(noise_image(3, 112))], max_tokens=4, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        details = info.value.details()
        assert "no encoder shares language worker" in details
        assert "(bfloat16, hidden" in details and "encoders have: float32, hidden" in details
        assert fp32.address in details
        assert len(client.generate("Text only", max_tokens=4, timeout=30).token_ids) == 4


# ---- the encoder's room is cancelled when the language half is refused --------------------


def encoder_cancel_implemented(address: str) -> bool:
    with create_channel(address) as channel:
        try:
            encoder_pb2_grpc.EncoderStub(channel).Cancel(
                encoder_pb2.CancelRequest(room=1, reason="probe"), timeout=5
            )
        except grpc.RpcError as exc:
            return exc.code() != grpc.StatusCode.UNIMPLEMENTED
    return True


def test_language_refusal_leaves_nothing_on_the_encoder(
    tiny_model_dir, stack_factory, tmp_path
) -> None:
    model_dir = tiny_model_dir(ARCH)
    # --language-busy-wait-s 0: the language worker's refusal reaches the client at once
    gateway_args = ("--language-busy-wait-s", "0")
    stack = stack_factory(model_dir, num_languages=0, gateway_args=gateway_args)
    if not encoder_cancel_implemented(stack.encoders[0].address):
        pytest.skip("the encoder does not implement Encoder.Cancel yet")
    # one request decoding, one waiting: the next is refused at the language worker's door
    limits = ("--max-running-requests", "1", "--max-waiting-requests", "1")
    language = add_worker(stack, model_dir, tmp_path, "language", "language-small", limits)
    encoder = stack.encoders[0].address
    with stack.client() as client, ThreadPoolExecutor(2) as pool:
        running, running_done = stream_in_background(
            pool, client, "Long.", timeout=120, request_id="long", max_tokens=2000, ignore_eos=True
        )
        assert running.first_chunk.wait(60) and running.chunks, running.details
        waiting, waiting_done = stream_in_background(
            pool, client, "Next.", max_tokens=4, timeout=120
        )
        wait_for(lambda: stack.language_load().num_waiting == 1, 30, "a request to wait")
        image = png_bytes(noise_image(77, 448))
        with pytest.raises(grpc.RpcError) as info:
            client.generate("Refused.", [image], max_tokens=4, timeout=60)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert language.address in info.value.details()
        # the encoder had accepted the room: the gateway's cancel frees it at once, long
        # before the transfer's bootstrap timeout (10 s here) would
        wait_for(lambda: encoder_state(encoder) == (0, 0, 0), 2.0, "the encoder to be idle")
        assert client.abort("long")
        running_done.result(timeout=30)
        waiting_done.result(timeout=60)
    assert running.code == grpc.StatusCode.CANCELLED, (running.code, running.details)
    assert waiting.code == grpc.StatusCode.OK and waiting.num_tokens == 4, waiting.details
    stack.wait_no_leaks()
