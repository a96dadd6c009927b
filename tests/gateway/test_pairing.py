"""Pairing encoders with language workers by transfer layout, the sequence-length limit, and
what ListWorkers says about workers that get no traffic. Workers are registry entries with test
double channels; the orchestrator's choices are made without calling any worker."""

from __future__ import annotations

import grpc
import pytest

from protos.epd.v1 import common_pb2, registry_pb2, registry_pb2_grpc
from services.gateway.config import GatewayConfig
from services.gateway.errors import GatewayError
from services.gateway.metrics import GatewayMetrics
from services.gateway.orchestrator import Orchestrator
from services.gateway.registry import Role, Worker, WorkerRegistry
from services.gateway.routing import (
    LeastLoadPolicy,
    RoutingKey,
    compatible,
    describe_layout,
    no_pair_message,
    pair,
    transfer_layout,
    worker_problems,
)
from tests.gateway.test_routing import FakeChannel, no_stubs

BF16 = common_pb2.TransferLayout(
    hidden_size=3584, num_deepstack=0, dtype="bfloat16", block_size=128
)
FP32 = common_pb2.TransferLayout(hidden_size=3584, num_deepstack=0, dtype="float32", block_size=128)
QWEN3 = common_pb2.TransferLayout(
    hidden_size=2048, num_deepstack=3, dtype="bfloat16", block_size=128
)


def worker(address: str, role: Role, layout=None, max_seq_len: int = 0) -> Worker:
    descriptor = {} if layout is None else {"transfer_layout": layout}
    if role == Role.LANGUAGE:
        descriptor["max_seq_len"] = max_seq_len
    return Worker(address, role, 8, False, FakeChannel(address), descriptor=descriptor)


def test_layouts() -> None:
    old = worker("e0:1", Role.ENCODER)
    empty = worker("e1:1", Role.ENCODER, common_pb2.TransferLayout())
    assert transfer_layout(old) is None and transfer_layout(empty) is None
    assert describe_layout(BF16) == "bfloat16, hidden 3584, deepstack 0, block 128"
    assert describe_layout(None) == "no layout advertised"
    bf16, fp32 = worker("e:1", Role.ENCODER, BF16), worker("l:1", Role.LANGUAGE, FP32)
    assert not compatible(bf16, fp32)
    assert compatible(bf16, worker("l:2", Role.LANGUAGE, BF16))
    assert compatible(old, fp32) and compatible(bf16, worker("l:3", Role.LANGUAGE))
    block_64 = common_pb2.TransferLayout()
    block_64.CopyFrom(BF16)
    block_64.block_size = 64
    assert not compatible(bf16, worker("l:4", Role.LANGUAGE, block_64))


def test_pair_takes_the_language_worker_first_then_its_encoders() -> None:
    enc_bf16 = worker("e-bf16:1", Role.ENCODER, BF16)
    enc_fp32 = worker("e-fp32:1", Role.ENCODER, FP32)
    enc_old = worker("e-old:1", Role.ENCODER)
    lang_fp32 = worker("l-fp32:1", Role.LANGUAGE, FP32)
    lang_bf16 = worker("l-bf16:1", Role.LANGUAGE, BF16)
    assert pair([lang_fp32, lang_bf16], [enc_bf16, enc_fp32]) == (lang_fp32, [enc_fp32])
    assert pair([lang_bf16], [enc_bf16, enc_fp32, enc_old]) == (lang_bf16, [enc_bf16, enc_old])
    # the preferred language worker has no encoder of its layout: the next one that has
    lang_qwen3 = worker("l-q3:1", Role.LANGUAGE, QWEN3)
    assert pair([lang_qwen3, lang_bf16], [enc_bf16]) == (lang_bf16, [enc_bf16])
    assert pair([lang_qwen3], [enc_bf16, enc_fp32]) is None
    message = no_pair_message([lang_qwen3, lang_fp32], [enc_bf16])
    assert message == (
        "no encoder shares language worker l-q3:1's transfer layout (bfloat16, hidden 2048, "
        "deepstack 3, block 128) (nor that of the 1 other language workers); encoders have: "
        "bfloat16, hidden 3584, deepstack 0, block 128 (e-bf16:1)"
    )


def test_worker_problems_say_why_a_worker_gets_no_traffic() -> None:
    enc_bf16 = worker("e-bf16:1", Role.ENCODER, BF16)
    enc_fp32 = worker("e-fp32:1", Role.ENCODER, FP32)
    enc_old = worker("e-old:1", Role.ENCODER)
    lang_bf16 = worker("l-bf16:1", Role.LANGUAGE, BF16)
    lang_q3 = worker("l-q3:1", Role.LANGUAGE, QWEN3)
    dead = worker("e-dead:1", Role.ENCODER, FP32)
    dead.healthy = False
    problems = worker_problems([enc_bf16, enc_fp32, lang_bf16, lang_q3, dead])
    assert "e-bf16:1" not in problems and "l-bf16:1" not in problems
    assert problems["e-fp32:1"].startswith(
        "no language worker shares this transfer layout (float32, hidden 3584, deepstack 0, "
        "block 128); language workers have: bfloat16, hidden 2048"
    )
    assert problems["l-q3:1"].startswith("no encoder shares this transfer layout (bfloat16, hidden")
    assert problems["l-q3:1"].endswith("it serves text-only requests only")
    assert problems["e-dead:1"].startswith("unhealthy")
    # an encoder without a layout is paired with anything: the Qwen3 worker now has a partner
    problems = worker_problems([enc_bf16, enc_old, lang_bf16, lang_q3])
    assert "advertises no transfer layout" in problems["e-old:1"]
    assert "l-q3:1" not in problems
    lonely = worker_problems([enc_bf16, worker("l-text:1", Role.LANGUAGE, FP32)])
    assert "no language worker shares" in lonely["e-bf16:1"]
    assert "no encoder shares" in lonely["l-text:1"]
    assert worker_problems([enc_bf16]) == {
        "e-bf16:1": "no healthy language worker to send image rows to"
    }
    assert worker_problems([lang_bf16]) == {}  # a text-only deployment is fine


# ---- the orchestrator's choices -------------------------------------------------------------


def make_orchestrator(workers: list[Worker]) -> Orchestrator:
    registry = WorkerRegistry(5.0, FakeChannel, stub_factory=no_stubs)
    for w in workers:
        info = {"transfer_endpoint": "tcp://x"}
        registry.heartbeat(w.address, w.role, 8, {}, info, w.descriptor)
    return Orchestrator(
        GatewayConfig(), registry, LeastLoadPolicy(), LeastLoadPolicy(), GatewayMetrics(registry)
    )


def ordered(orchestrator: Orchestrator, role: Role) -> list[Worker]:
    return sorted(orchestrator.registry.healthy(role), key=lambda w: w.address)


def test_orchestrator_pairs_or_names_both_layouts() -> None:
    orchestrator = make_orchestrator(
        [
            worker("enc-a:1", Role.ENCODER, FP32),
            worker("enc-b:1", Role.ENCODER, BF16),
            worker("lang-a:1", Role.LANGUAGE, BF16),
        ]
    )
    languages = ordered(orchestrator, Role.LANGUAGE)
    language, encoders = orchestrator._pair(languages, RoutingKey())
    assert language.address == "lang-a:1" and [e.address for e in encoders] == ["enc-b:1"]
    orchestrator.registry.deregister("enc-b:1")
    with pytest.raises(GatewayError) as info:
        orchestrator._pair(languages, RoutingKey())
    assert info.value.code == grpc.StatusCode.UNAVAILABLE
    assert "lang-a:1's transfer layout (bfloat16, hidden 3584" in info.value.message
    assert "encoders have: float32, hidden 3584, deepstack 0, block 128 (enc-a:1)" in (
        info.value.message
    )
    orchestrator.registry.deregister("enc-a:1")
    with pytest.raises(GatewayError, match="no healthy encoder worker"):
        orchestrator._pair(languages, RoutingKey())


def test_language_workers_must_hold_max_new_tokens() -> None:
    orchestrator = make_orchestrator(
        [
            worker("small:1", Role.LANGUAGE, BF16, max_seq_len=256),
            worker("large:1", Role.LANGUAGE, BF16, max_seq_len=4096),
            worker("old:1", Role.LANGUAGE),  # says nothing: always qualifies
        ]
    )
    languages = ordered(orchestrator, Role.LANGUAGE)
    asked = common_pb2.SamplingParams(max_new_tokens=1000)
    fits = orchestrator._fitting(languages, 1000, asked)
    assert [w.address for w in fits] == ["large:1", "old:1"]
    assert len(orchestrator._fitting(languages, 255, asked)) == 3
    assert [w.address for w in orchestrator._fitting(languages, 256, asked)] == [
        "large:1",
        "old:1",
    ]
    orchestrator.registry.deregister("old:1")
    languages = ordered(orchestrator, Role.LANGUAGE)
    with pytest.raises(GatewayError) as info:
        orchestrator._fitting(languages, 4096, asked)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message == (
        "sampling.max_new_tokens is 4096, but the longest sequence a language worker takes is "
        "max_seq_len 4096 (large:1), prompt included"
    )
    with pytest.raises(GatewayError, match=r"is 5000 \(the gateway's default\)"):
        orchestrator._fitting(languages, 5000, common_pb2.SamplingParams())


# ---- ListWorkers over gRPC --------------------------------------------------------------------


def test_list_workers_names_the_problem(gateway_factory) -> None:
    gateway = gateway_factory()
    with grpc.insecure_channel(gateway.address) as channel:
        stub = registry_pb2_grpc.WorkerRegistryStub(channel)
        for address, role, layout, extra in (
            ("127.0.0.1:1", "encoder", BF16, {"max_prompt_tokens": 32768}),
            ("127.0.0.1:2", "encoder", FP32, {"max_prompt_tokens": 32768}),
            ("127.0.0.1:3", "language", BF16, {"max_seq_len": 8192}),
            ("127.0.0.1:4", "encoder", None, {}),
        ):
            stub.Heartbeat(
                registry_pb2.HeartbeatRequest(
                    address=address, role=role, capacity=4, transfer_layout=layout, **extra
                ),
                timeout=5,
            )
        workers = {
            w.address: w
            for w in stub.ListWorkers(registry_pb2.ListWorkersRequest(), timeout=5).workers
        }
    assert workers["127.0.0.1:1"].problem == ""
    assert workers["127.0.0.1:1"].transfer_layout == BF16
    assert workers["127.0.0.1:1"].max_prompt_tokens == 32768
    assert workers["127.0.0.1:3"].problem == "" and workers["127.0.0.1:3"].max_seq_len == 8192
    assert workers["127.0.0.1:2"].problem.startswith(
        "no language worker shares this transfer layout (float32"
    )
    assert "advertises no transfer layout" in workers["127.0.0.1:4"].problem
