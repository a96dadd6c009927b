"""The engine thread sleeps while its only work is waiting for embeddings, and wakes on arrival.

The embedding source here is a test double (``FakeSource``) whose rooms the test completes by
hand; the real receiver, in real processes, is in ``tests/e2e/test_language_idle.py``.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import pytest

from services.language.engine.request import ErrorKind, FinishReason, RequestOutput
from services.language.engine.sampling import SamplingParams
from services.language.engine_thread import (
    SHUTDOWN_ERROR,
    DuplicateRequestError,
    EngineStoppedError,
    EngineThread,
    Submission,
    coalesced_outputs,
)
from tests.language.conftest import make_image

WAIT_S = 1.5


class FakeSource:
    """Rooms finish when the test says so; ``listen`` is called the way the receiver would."""

    def __init__(self) -> None:
        self.on_ready = None
        self.added: dict[int, tuple[str, float | None]] = {}
        self.done: list = []
        self.aborted: list[int] = []
        self.released: list[int] = []
        self._lock = threading.Lock()

    def listen(self, on_ready) -> None:
        self.on_ready = on_ready

    def add_room(self, room, encoder_endpoint, deadline=None) -> None:
        self.added[room] = (encoder_endpoint, deadline)

    def finish(self, room, result) -> None:
        with self._lock:
            self.done.append((room, result))
        self.on_ready()

    def pop_done(self):
        with self._lock:
            done, self.done = self.done, []
        return done

    def abort(self, room) -> None:
        self.aborted.append(room)

    def release(self, room) -> None:
        self.released.append(room)

    def block_stats(self) -> dict:
        return {"num_free_blocks": 0, "num_used_blocks": 0}


def thread_cpu_s(thread: threading.Thread) -> float:
    """CPU seconds the thread has used (utime + stime of its /proc task)."""
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture
def setup(harness):
    h = harness("qwen2_5_vl")
    source = FakeSource()
    engine = h.engine()
    engine.embedding_source = source
    thread = EngineThread(engine, max_waiting=8)
    thread.start()
    yield h, source, thread
    thread.stop()


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def collect(stream, timeout_s: float = 60.0) -> list:
    outs = []
    while not outs or not outs[-1].finished:
        outs.append(stream.get(timeout=timeout_s))
    return outs


def test_waiting_for_embeddings_costs_no_cpu_and_arrival_wakes(setup):
    h, source, thread = setup
    case = h.case("what is this", [make_image(64, 48, 5)], 8)
    deadline = time.monotonic() + 60
    stream = thread.submit(
        Submission(
            "r1",
            SamplingParams(max_new_tokens=8),
            room=42,
            encoder_endpoint="tcp://x",
            deadline=deadline,
        )  # fmt: skip
    )
    wait_until(lambda: 42 in source.added)
    assert source.added[42] == ("tcp://x", deadline)  # the caller's deadline reaches the room
    cpu_before = thread_cpu_s(thread._thread)
    time.sleep(WAIT_S)
    cpu_used = thread_cpu_s(thread._thread) - cpu_before
    assert cpu_used < 0.05 * WAIT_S, f"engine thread used {cpu_used:.3f}s CPU while idle"
    assert thread.load().num_receiving == 1 and stream.empty()
    source.finish(42, case.inputs)
    outs = collect(stream)
    assert [t for o in outs for t in o.token_ids] == case.expected
    assert source.released == [42]


def test_a_failed_room_wakes_and_finishes_its_request(setup):
    _, source, thread = setup
    stream = thread.submit(Submission("r2", SamplingParams(), room=7, encoder_endpoint="e"))
    wait_until(lambda: 7 in source.added)
    source.finish(7, RuntimeError("room 7: sender_dead: e silent"))
    [out] = collect(stream)
    assert out.finish_reason == FinishReason.ERROR and "sender_dead" in out.error
    assert out.error_kind == ErrorKind.FAILED


def test_abort_wakes_a_waiting_request_and_frees_its_room(setup):
    _, source, thread = setup
    stream = thread.submit(Submission("r3", SamplingParams(), room=8, encoder_endpoint="e"))
    wait_until(lambda: 8 in source.added)
    thread.abort("r3", stream)
    [out] = collect(stream)
    assert out.finish_reason == FinishReason.ABORT and source.aborted == [8]
    assert not thread.is_active("r3")


def test_duplicates_are_refused_and_stop_finishes_every_request(setup):
    _, source, thread = setup
    stream = thread.submit(Submission("r4", SamplingParams(), room=9, encoder_endpoint="e"))
    with pytest.raises(DuplicateRequestError):
        thread.submit(Submission("r4", SamplingParams(), room=10, encoder_endpoint="e"))
    wait_until(lambda: 9 in source.added)
    thread.stop()
    [out] = collect(stream, timeout_s=5)
    assert out.finish_reason == FinishReason.ERROR and out.error == SHUTDOWN_ERROR
    assert source.aborted == [9]
    with pytest.raises(EngineStoppedError):
        thread.submit(Submission("r5", SamplingParams(), room=11, encoder_endpoint="e"))


def test_chats_are_tokenized_off_the_engine_thread_and_a_bad_one_fails_alone(setup, monkeypatch):
    _, _, thread = setup
    engine, seen = thread.engine, []
    tokenize = engine.tokenize_messages

    def spy(messages):
        seen.append(threading.current_thread())
        return tokenize(messages)

    monkeypatch.setattr(engine, "tokenize_messages", spy)
    chat = [{"role": "user", "content": "hello there"}]
    good = thread.submit(Submission("t1", SamplingParams(max_new_tokens=3), messages=chat))
    bad = thread.submit(Submission("t2", SamplingParams(), messages=[]))  # no message at all
    assert seen == [threading.current_thread()] * 2  # the caller's thread, not the engine's
    [failed] = collect(bad)
    assert failed.finish_reason == FinishReason.ERROR
    assert failed.error_kind == ErrorKind.INVALID_ARGUMENT
    assert "empty conversation" in failed.error
    outs = collect(good)
    assert outs[-1].finish_reason == FinishReason.LENGTH
    assert sum(len(o.token_ids) for o in outs) == 3
    assert not thread.is_active("t2")


def test_queued_outputs_are_sent_merged_and_an_error_is_never_merged():
    def out(tokens, text, reason=FinishReason.NONE, kind=ErrorKind.NONE, **kw):
        return RequestOutput("r", tokens, text, reason, error_kind=kind, **kw)

    stream = queue.Queue()
    merged = coalesced_outputs(stream)
    stream.put(out([1], "a"))
    assert next(merged) == out([1], "a")  # nothing behind it: sent at once, alone
    for tokens, text in (([2], "b"), ([3, 4], "cd")):
        stream.put(out(tokens, text))
    stream.put(out([5], "e", FinishReason.LENGTH, num_completion_tokens=5))
    assert list(merged) == [out([2, 3, 4, 5], "bcde", FinishReason.LENGTH, num_completion_tokens=5)]

    stream = queue.Queue()
    stream.put(out([1], "a"))
    stream.put(out([], "", FinishReason.ERROR, ErrorKind.DEADLINE_EXCEEDED))
    assert list(coalesced_outputs(stream)) == [
        out([1], "a"),
        out([], "", FinishReason.ERROR, ErrorKind.DEADLINE_EXCEEDED),
    ]


def test_outputs_of_different_choices_are_never_merged_and_a_choice_end_is_not_the_end():
    def out(index, tokens, text, reason=FinishReason.NONE, more=False):
        return RequestOutput("r", tokens, text, reason, index=index, more_choices=more)

    stream = queue.Queue()
    for item in (
        out(0, [1], "a"),
        out(0, [2], "b"),
        out(1, [7], "x"),
        out(0, [3], "c", FinishReason.STOP, more=True),
        out(1, [8], "y"),
        out(1, [9], "z", FinishReason.LENGTH),
    ):
        stream.put(item)
    assert list(coalesced_outputs(stream)) == [
        out(0, [1, 2], "ab"),
        out(1, [7], "x"),
        out(0, [3], "c", FinishReason.STOP, more=True),
        out(1, [8, 9], "yz", FinishReason.LENGTH),
    ]
