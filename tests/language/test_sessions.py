"""Sessions on the language worker (``Open`` / ``Submit``), the server in its own process."""

from __future__ import annotations

import re
import secrets
import threading
import time

import grpc
import pytest

from common.models.hf_reference import HFReference
from protos.epd.v1 import common_pb2, language_pb2, language_pb2_grpc
from tests.language.test_grpc import server, text_request  # noqa: F401 (the fixture)


class Reader:
    """Reads a session's stream on a thread: chunks by request, messages as they came."""

    def __init__(self, stub, session_id: str | None = None) -> None:
        self.session_id = session_id or secrets.token_hex(16)
        self.stream = stub.Open(language_pb2.LanguageSessionRequest(session_id=self.session_id))
        self.first = next(self.stream)  # the session is open
        self.messages: list[language_pb2.LanguageOutputs] = []
        self.chunks: dict[str, list] = {}
        self.ended: dict[str, threading.Event] = {}
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def expect(self, request_id: str) -> None:
        self.ended[request_id] = threading.Event()
        self.chunks[request_id] = []

    def _read(self) -> None:
        try:
            for message in self.stream:
                self.messages.append(message)
                for chunk in message.chunks:
                    self.chunks[chunk.request_id].append(chunk)
                    if chunk.last:
                        self.ended[chunk.request_id].set()
        except grpc.RpcError as exc:
            self.error = exc

    def wait(self, request_id: str, timeout_s: float = 60) -> list:
        assert self.ended[request_id].wait(timeout_s), f"{request_id} did not end"
        return self.chunks[request_id]

    def close(self) -> None:
        self.stream.cancel()
        self._thread.join(10)


def submit(stub, reader: Reader, request, timeout_s: float = 60):
    reader.expect(request.request_id)
    request.session_id, request.timeout_s = reader.session_id, timeout_s
    return stub.Submit(request, timeout=30)


def wait_idle(stub, timeout_s: float = 10) -> language_pb2.LanguageLoad:
    deadline = time.monotonic() + timeout_s
    while True:
        load = stub.GetLoad(language_pb2.LanguageLoadRequest())
        if load.num_running == load.num_waiting == 0 or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def tokens(chunks) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


def test_session_streams_every_request_as_generate_would(server):  # noqa: F811
    model, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    reader = Reader(stub)
    try:
        assert not reader.first.chunks
        prompts = {f"s{i}": f"session prompt number {i}" for i in range(4)}
        for rid, text in prompts.items():
            submit(stub, reader, text_request(rid, text, 8))
        ref = HFReference(model)
        for rid, text in prompts.items():
            chunks = reader.wait(rid)
            assert tokens(chunks) == ref.generate(ref.build_inputs(text, []), 8)
            assert [c.last for c in chunks] == [False] * (len(chunks) - 1) + [True]
            final = chunks[-1]
            assert final.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            assert final.usage.completion_tokens == 8 and final.status_code == 0
        # one message per step carries the chunks of several requests
        assert max(len(m.chunks) for m in reader.messages) > 1
    finally:
        reader.close()
    assert wait_idle(stub).num_radix_locked_tokens == 0


def test_session_echo_and_refusals_name_the_problem(server):  # noqa: F811
    _, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    reader = Reader(stub)
    try:
        echo = language_pb2.LanguageGenerateRequest(
            request_id="echo",
            prompt_text="echo this prompt",
            echo=True,
            sampling=common_pb2.SamplingParams(max_new_tokens=2),
        )
        submit(stub, reader, echo)
        chunks = reader.wait("echo")
        assert chunks[0].prompt_text == "echo this prompt"
        assert all(not c.prompt_text for c in chunks[1:])
        with pytest.raises(grpc.RpcError) as err:  # bad sampling: as Generate refuses it
            bad = text_request("bad", "x")
            bad.sampling.top_p = 2.0
            submit(stub, reader, bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "top_p" in err.value.details()
        # over max_seq_len: the request's last chunk carries the status Generate ends with
        submit(stub, reader, text_request("long", "too long", max_new_tokens=4090))
        (last,) = reader.wait("long")
        assert last.last and last.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert re.match(r"prompt is \d+ tokens and max_new_tokens is 4090", last.error)
        unknown = text_request("nobody", "x")
        unknown.session_id = "not-a-session"
        with pytest.raises(grpc.RpcError) as err:
            stub.Submit(unknown, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "not-a-session" in err.value.details()
        for session_id in (reader.session_id, ""):  # taken, missing
            with pytest.raises(grpc.RpcError) as err:
                next(stub.Open(language_pb2.LanguageSessionRequest(session_id=session_id)))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "session" in err.value.details()
    finally:
        reader.close()


def test_abort_ends_one_request_and_the_session_end_aborts_the_rest(server):  # noqa: F811
    _, channel, _ = server
    stub = language_pb2_grpc.LanguageServiceStub(channel)
    reader = Reader(stub)
    for rid in ("long-a", "long-b"):
        request = text_request(rid, f"a long answer please {rid}", max_new_tokens=2000)
        request.sampling.ignore_eos = True
        submit(stub, reader, request)
    found = stub.Abort(language_pb2.LanguageAbortRequest(request_id="long-a"))
    assert found.found
    last = reader.wait("long-a")[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_ABORT
    assert not reader.ended["long-b"].is_set()  # the other one goes on
    reader.close()  # the caller went away: its requests are aborted
    load = wait_idle(stub)
    assert load.num_running == load.num_waiting == 0
    assert load.num_radix_locked_tokens == 0
    assert load.num_kv_slots_used == load.num_radix_tokens  # only the cache holds slots
