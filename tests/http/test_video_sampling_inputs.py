"""Video sampling on the HTTP API (``mm_processor_kwargs`` and keys beside a ``video_url``'s
``url``): how both levels become each video part's ``VideoSampling`` (a part's key wins), and
every bad key or value a 400 naming its JSON path, from a gateway process with no workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from protos.epd.v1 import common_pb2
from services.gateway.http.convert import to_generate_request
from services.gateway.http.errors import HttpError
from services.gateway.http.schemas import ChatCompletionRequest
from services.gateway.validation import RequestLimits
from tests.http.refusals import Gateway, assert_error, limits_gateway, post

VIDEO_URL = "data:video/mp4;base64,AAAA"


def body(*parts: dict, **fields: object) -> dict:
    """A chat body of one user turn: a video part per ``parts`` (keys beside the url), text."""
    videos = [{"type": "video_url", "video_url": {"url": VIDEO_URL, **p}} for p in parts]
    content = [*videos, {"type": "text", "text": "What happens?"}]
    return {"messages": [{"role": "user", "content": content}], **fields}


def samplings(raw: dict) -> list[common_pb2.VideoSampling]:
    request, _ = to_generate_request(ChatCompletionRequest(**raw), "", RequestLimits())
    parts = request.messages[0].content
    return [p.video.sampling for p in parts if p.WhichOneof("part") == "video"]


def test_a_parts_key_wins_over_the_request_level_one():
    kwargs = {"fps": 1.0, "max_frames": 16, "total_pixels": 1 << 33}
    first, second = samplings(
        body({"fps": 0.5, "min_pixels": 3136}, {}, mm_processor_kwargs=kwargs)
    )
    assert first == common_pb2.VideoSampling(
        fps=0.5, max_frames=16, min_pixels=3136, total_pixels=1 << 33
    )
    assert second == common_pb2.VideoSampling(fps=1.0, max_frames=16, total_pixels=1 << 33)


def test_no_keys_leave_the_encoders_defaults():
    assert samplings(body({})) == [common_pb2.VideoSampling()]
    assert samplings(body({}, mm_processor_kwargs=None)) == [common_pb2.VideoSampling()]


def test_min_above_max_across_levels_names_the_parts_key():
    with pytest.raises(HttpError) as info:
        samplings(body({"min_frames": 32}, mm_processor_kwargs={"max_frames": 16}))
    assert info.value.param == "messages[0].content[0].video_url.min_frames"
    assert "must be at most mm_processor_kwargs.max_frames (16)" in info.value.message


BAD: dict[str, tuple[dict, str, str]] = {
    "unknown request key": (
        body({}, mm_processor_kwargs={"fps": 1, "nframes": 8}),
        "mm_processor_kwargs.nframes",
        "is not a video sampling key (fps, min_frames",
    ),
    "unknown part key": (
        body({"detail": "low"}),
        "messages[0].content[0].video_url.detail",
        "is not a video sampling key",
    ),
    "request level not an object": (
        body({}, mm_processor_kwargs=[1]),
        "mm_processor_kwargs",
        "mm_processor_kwargs must be an object",
    ),
    "fps a word": (
        body({}, mm_processor_kwargs={"fps": "fast"}),
        "mm_processor_kwargs.fps",
        "must be a number, got 'fast'",
    ),
    "fps not finite": (
        b'{"messages": [{"role": "user", "content": "hi"}], "mm_processor_kwargs": {"fps": NaN}}',
        "mm_processor_kwargs.fps",
        "must be a finite number in [0.001, 1000], got nan",
    ),
    "fps negative": (
        body({"fps": -1}),
        "messages[0].content[0].video_url.fps",
        "must be a finite number in [0.001, 1000], got -1",
    ),
    "fps 0": (body({"fps": 0}), "messages[0].content[0].video_url.fps", "got 0"),
    "max_frames a float": (
        body({}, mm_processor_kwargs={"max_frames": 16.5}),
        "mm_processor_kwargs.max_frames",
        "must be an integer, got float",
    ),
    "max_frames true": (
        body({"max_frames": True}),
        "messages[0].content[0].video_url.max_frames",
        "must be an integer, got true",
    ),
    "min_pixels negative": (
        body({}, mm_processor_kwargs={"min_pixels": -5}),
        "mm_processor_kwargs.min_pixels",
        "must be in [1, 4294967295], got -5",
    ),
    "total_pixels past uint64": (
        body({"total_pixels": 1 << 64}),
        "messages[0].content[0].video_url.total_pixels",
        "must be in [1, 18446744073709551615]",
    ),
    "min_frames above max_frames": (
        body({}, mm_processor_kwargs={"min_frames": 8, "max_frames": 4}),
        "mm_processor_kwargs.min_frames",
        "mm_processor_kwargs.min_frames (8) must be at most mm_processor_kwargs.max_frames (4)",
    ),
    "min_pixels above max_pixels in a part": (
        body({}, {"min_pixels": 5000, "max_pixels": 4000}),
        "messages[0].content[1].video_url.min_pixels",
        "(5000) must be at most messages[0].content[1].video_url.max_pixels (4000)",
    ),
}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory) -> Iterator[Gateway]:
    yield from limits_gateway(tmp_path_factory.mktemp("video-sampling"))


@pytest.mark.parametrize("name", list(BAD))
def test_bad_video_sampling_is_a_400_naming_the_field(gateway, name: str) -> None:
    raw, param, words = BAD[name]
    error = assert_error(post(gateway, raw), 400, param, [words])
    assert error["type"] == "invalid_request_error"
