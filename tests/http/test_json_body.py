"""Request bodies through ``JsonBodyRequest``: pydantic's parser where it accepts the body, the
standard library's where it does not, so every body parses to what ``json.loads`` gives or fails
as it fails (FastAPI reports ``json.JSONDecodeError`` as a 400 naming the body; the gateway's
HTTP tests check that answer)."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.gateway.http.json_body import JsonBodyRequest

BODIES = [
    b'{"a": 1, "a": 2}',  # duplicate keys: the last
    b'{"x": 123456789012345678901234567890}',  # a big integer
    b'{"x": 1e400, "y": NaN, "z": -Infinity}',
    b'{"x": 1.0000000000000002, "y": -0.0, "z": -0, "w": 1E5}',
    b'[1, 2.5, true, null, "\\u00e9\\n"]',
    b'  {"a": [] }  ',
    b'"\\ud800"',  # a lone surrogate: only json.loads takes it
    b'\xef\xbb\xbf{"a": 1}',  # a byte-order mark: only json.loads takes it
    b'{"a": 1}x',  # trailing data
    b'{"messages": [',  # cut short
    b'{"a": "\xff"}',  # not UTF-8
    b"",
]


def parse(body: bytes):
    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "query_string": b""}
    return asyncio.run(JsonBodyRequest(scope, receive).json())


@pytest.mark.parametrize("body", BODIES)
def test_a_body_parses_to_what_json_loads_gives_or_fails_as_it_fails(body):
    try:
        want = json.loads(body)
    except ValueError as exc:
        with pytest.raises(type(exc)):
            parse(body)
        return
    assert repr(parse(body)) == repr(want)  # repr: NaN equals itself, -0.0 is told from 0.0


def test_a_large_body_of_base64_images_parses_the_same():
    from bench.peers import workloads

    (body,) = workloads.bodies(workloads.WORKLOADS["four_images"], "m", 1)
    assert parse(body) == json.loads(body)
