"""An HTTP request's life on a live stack: client disconnects, deadlines, duplicate ids, a full
queue. Each ends with one clear answer (or none, for a client that left), and afterwards both
workers hold nothing of it (their GetLoad figures: no requests, rooms, blocks or KV slots
outside the radix cache)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.http.conftest import image_message, outcomes, sse_events, start_side_gateway, wait_for

LONG = {"max_tokens": 2000, "ignore_eos": True}  # seconds of decode on the test checkpoint


def running(stack) -> int:
    load = stack.language_load()
    return load.num_running + load.num_waiting + load.num_receiving


def body(text: str, **fields) -> dict:
    return {"messages": [image_message(f"{text} {uuid.uuid4().hex[:8]}")], **LONG, **fields}


def test_disconnect_mid_stream_frees_the_request_on_both_workers(http_stack, http) -> None:
    before = outcomes(http_stack).get(("CANCELLED", "http"), 0)
    with http.stream("POST", "/v1/chat/completions", json=body("Go on.", stream=True)) as reply:
        assert reply.status_code == 200
        for i, event in enumerate(sse_events(reply)):
            assert event["choices"][0]["finish_reason"] is None
            if i == 5:
                break  # leaving the block closes the connection mid-stream
    assert running(http_stack) <= 1
    start = time.monotonic()
    wait_for(lambda: running(http_stack) == 0, 5.0, "the language worker to drop the request")
    assert time.monotonic() - start < 2.0, "the disconnect took long to reach the worker"
    http_stack.wait_no_leaks()
    wait_for(
        lambda: outcomes(http_stack).get(("CANCELLED", "http"), 0) == before + 1,
        5.0,
        "the request to count as CANCELLED",
    )


def test_disconnect_while_waiting_for_a_whole_answer(http_stack) -> None:
    """A non-streamed request whose client gives up is cancelled too, long before its 2000
    tokens would have been decoded."""
    with httpx.Client(base_url=http_stack.http_url, timeout=1.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post("/v1/chat/completions", json=body("Take your time."))
    wait_for(lambda: running(http_stack) == 0, 3.0, "the language worker to drop the request")
    http_stack.wait_no_leaks()


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_deadline_is_504(http_stack, http, stream: bool) -> None:
    headers = {"X-Request-Timeout": "0.8"}
    start = time.monotonic()
    if not stream:
        reply = http.post("/v1/chat/completions", json=body("Too slow."), headers=headers)
        assert reply.status_code == 504, reply.text
        error = reply.json()["error"]
        assert error["type"] == "timeout_error" and error["code"] == "deadline_exceeded"
    else:
        payload = body("Too slow.", stream=True)
        with http.stream("POST", "/v1/chat/completions", json=payload, headers=headers) as reply:
            assert reply.status_code == 200  # the stream began before the deadline passed
            events = list(sse_events(reply))
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == "deadline_exceeded", events[-2]
        assert any(e["choices"] and e["choices"][0]["delta"].get("content") for e in events[:-2])
    assert time.monotonic() - start < 3.0
    wait_for(lambda: running(http_stack) == 0, 5.0, "the request to be freed")
    http_stack.wait_no_leaks()


def test_a_live_request_id_is_409_for_another_request(http_stack, http) -> None:
    request_id = f"http-{uuid.uuid4().hex[:8]}"
    headers = {"X-Request-Id": request_id}
    payload = body("Mine.", stream=True)
    with http.stream("POST", "/v1/chat/completions", json=payload, headers=headers) as reply:
        assert reply.headers["x-request-id"] == request_id
        events = sse_events(reply)  # kept open: dropping it would close the connection
        first = next(events)
        assert first["id"] == f"chatcmpl-{request_id}"
        with httpx.Client(base_url=http_stack.http_url, timeout=30) as other:
            refused = other.post("/v1/chat/completions", json=body("Theirs."), headers=headers)
        assert refused.status_code == 409, refused.text
        assert f"'{request_id}' is already in flight" in refused.json()["error"]["message"]
        assert next(events)["id"] == first["id"]  # the first one is untouched
    wait_for(lambda: running(http_stack) == 0, 5.0, "the request to be freed")
    http_stack.wait_no_leaks()


def test_a_full_queue_is_429_at_once(http_stack, tmp_path) -> None:
    """A gateway admitting one request: the second is refused at once, the first completes."""
    gateway, url = start_side_gateway(http_stack, tmp_path, "--max-queued", "1")
    try:
        with httpx.Client(base_url=url, timeout=120) as client, ThreadPoolExecutor(1) as pool:
            started = threading.Event()

            def first() -> list:
                payload = body("First.", stream=True, max_tokens=300)
                with client.stream("POST", "/v1/chat/completions", json=payload) as reply:
                    out = []
                    for event in sse_events(reply):
                        out.append(event)
                        started.set()
                    return out

            done = pool.submit(first)
            assert started.wait(60)
            start = time.monotonic()
            refused = client.post("/v1/chat/completions", json=body("Second.", max_tokens=4))
            assert time.monotonic() - start < 1.0
            assert refused.status_code == 429, refused.text
            assert refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert error["message"] == "gateway queue is full (1 requests in flight)"
            assert error["type"] == "rate_limit_error"
            events = done.result(timeout=120)
        assert events[-1] == "[DONE]"
        finish = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
        assert finish[-1] == "length"
        usage = json.dumps(events[-2])
        assert "error" not in usage
    finally:
        gateway.stop()
    http_stack.wait_no_leaks()
