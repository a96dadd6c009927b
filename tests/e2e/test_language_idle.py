"""A language worker whose request waits for its room costs no CPU, and keeps its deadline.

Real processes: the worker is ``epd serve language`` started like a pod; the room's encoder is a
real transfer sender (``bench.peer.Peer``) in its own process that takes the
worker's init and never submits the data, so the room waits in WAITING_FOR_INPUT, heartbeats
flowing both ways.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from bench.peer import Peer
from common.procs import ServiceProcess, free_port
from common.transfer.config import TransferConfig
from common.transfer.layout import layout_for
from common.transfer.types import RoomState
from protos.epd.v1 import common_pb2, language_pb2, language_pb2_grpc
from services.language.model.config import TextModelConfig

IDLE_S = 6.0
MAX_CPU_SHARE = 0.05


def process_cpu_s(pid: int) -> float:
    """utime + stime of every thread of ``pid``, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def sender_state(sender: Peer, room: int) -> RoomState | None:
    try:
        return RoomState(sender.ask("call", "poll", room))
    except RuntimeError:  # KeyError in the peer: no init for the room yet
        return None


@pytest.fixture
def worker_and_sender(tiny_model_dir, tmp_path):
    model = tiny_model_dir("qwen2_5_vl")
    config = TransferConfig()
    text = TextModelConfig.from_pretrained(model)
    sender = Peer("sender", config, layout_for(config, text.hidden_size, text.num_deepstack))
    port = free_port()
    args = ["serve", "language", "--model-path", str(model), "--port", str(port),
            "--num-kv-slots", "4096"]  # fmt: skip
    worker = ServiceProcess("language-0", args, f"127.0.0.1:{port}", tmp_path)
    channel = grpc.insecure_channel(worker.address)
    try:
        worker.wait_healthy(120)
        yield worker, language_pb2_grpc.LanguageServiceStub(channel), sender
    finally:
        channel.close()
        worker.stop()
        sender.close()


def room_request(request_id: str, room: int, endpoint: str):
    return language_pb2.LanguageGenerateRequest(
        request_id=request_id,
        room=room,
        encoder_endpoint=endpoint,
        sampling=common_pb2.SamplingParams(max_new_tokens=4),
    )


def load(stub) -> language_pb2.LanguageLoad:
    return stub.GetLoad(language_pb2.LanguageLoadRequest(), timeout=5)


def test_waiting_for_a_room_costs_no_cpu(worker_and_sender):
    worker, stub, sender = worker_and_sender
    call = stub.Generate(room_request("idle", 1001, sender.endpoint), timeout=120)
    wait_until(
        lambda: sender_state(sender, 1001) == RoomState.WAITING_FOR_INPUT, 30, "the worker's init"
    )
    assert load(stub).num_receiving == 1
    cpu_before, start = process_cpu_s(worker.proc.pid), time.monotonic()
    time.sleep(IDLE_S)
    cpu_used, waited = process_cpu_s(worker.proc.pid) - cpu_before, time.monotonic() - start
    assert cpu_used < MAX_CPU_SHARE * waited, (
        f"the worker used {cpu_used:.2f} s of CPU in {waited:.1f} s of waiting for a room"
    )
    assert load(stub).num_receiving == 1  # still waiting, still answering
    call.cancel()
    wait_until(lambda: load(stub).num_receiving == 0, 10, "the room to be dropped")
    wait_until(lambda: load(stub).num_used_transfer_blocks == 0, 10, "the blocks to be freed")
    wait_until(lambda: sender_state(sender, 1001) == RoomState.FAILED, 10, "the sender's abort")


def test_a_room_past_the_request_deadline_ends_and_frees_everything(worker_and_sender):
    worker, stub, sender = worker_and_sender
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(room_request("late", 1002, sender.endpoint), timeout=3))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - start < 10
    wait_until(lambda: load(stub).num_receiving == 0, 10, "the room to end")
    wait_until(lambda: load(stub).num_used_transfer_blocks == 0, 10, "the blocks to be freed")
    wait_until(lambda: sender_state(sender, 1002) == RoomState.FAILED, 10, "the sender's abort")
    # the worker keeps serving
    part = common_pb2.ContentPart(text="hello")
    request = language_pb2.LanguageGenerateRequest(
        request_id="after",
        messages=[common_pb2.ChatMessage(role="user", content=[part])],
        sampling=common_pb2.SamplingParams(max_new_tokens=4),
    )
    chunks = list(stub.Generate(request, timeout=60))
    assert chunks[-1].finish_reason != common_pb2.FINISH_REASON_ERROR
