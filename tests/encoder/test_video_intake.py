"""Bad videos: each is a clear ``InvalidInput`` naming the video, refused before decoding where
the header tells, and nothing stays held in the pixel budget."""

from __future__ import annotations

import base64
import dataclasses
import struct
import time

import numpy as np
import pytest

from services.encoder.config import EncoderConfig
from services.encoder.errors import DeadlineExpired, InvalidInput, RequestCancelled
from services.encoder.intake import VideoIntake
from services.encoder.pipeline import EncoderPipeline
from services.encoder.stop import StopCheck
from services.encoder.types import (
    ChatMessage,
    ContentPart,
    ImageSource,
    VideoInput,
    VideoSampling,
)
from services.encoder.video_decode import VideoLimits, frame_rate, probe_video
from tests.media import make_audio_only, make_empty_video, make_video


def patched(data: bytes, box: bytes, offset: int, value: int) -> bytes:
    """``data`` with the 32-bit field ``offset`` bytes into its first ``box`` set to ``value``."""
    at = data.index(box) + offset
    return data[:at] + struct.pack(">I", value) + data[at + 4 :]


GOOD = make_video(num_frames=10)

BAD = {
    "random-bytes": (lambda: b"\x00\x01 not a video " * 64, "not a readable video"),
    "truncated": (lambda: GOOD[: len(GOOD) // 2], "not a readable video"),
    "audio-only": (make_audio_only, "no video stream (streams: audio)"),
    "no-frames": (make_empty_video, "empty video data"),  # PyAV writes no container at all
    "zero-frames": (lambda: patched(GOOD, b"stsz", 12, 0), "video stream holds no frames"),
    "one-frame": (lambda: make_video(num_frames=1), "at least 2 are needed"),
    # the sample table claims 1000 frame durations for 10 frames
    "header-lies-longer": (lambda: patched(GOOD, b"stts", 12, 1000), "header says 1000 frames"),
    # the sample-size table claims 5 frames, the stream holds 10
    "header-lies-shorter": (lambda: patched(GOOD, b"stsz", 12, 5), "its stream holds 5"),
    "empty": (lambda: b"", "empty video data"),
    # containers other than video ones are never opened (an HLS playlist or an ffconcat list
    # would make FFmpeg open the files or URLs it names)
    "hls-playlist": (
        lambda: (
            b"#EXTM3U\n#EXT-X-TARGETDURATION:1\n#EXTINF:1,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n"
        ),
        "not a readable video",
    ),
    "ffconcat": (lambda: b"ffconcat version 1.0\nfile /etc/passwd\n", "not a readable video"),
    "one-frame-webm": (
        lambda: make_video(num_frames=1, codec="libvpx-vp9", container="webm"),
        "at least 2 are needed",
    ),
}


@pytest.fixture(scope="module")
def video_pipeline(qwen25_dir):
    pipe = EncoderPipeline(
        qwen25_dir,
        EncoderConfig(
            device="cpu",
            dtype="float32",
            sender="none",
            max_video_seconds=20,
            max_video_frame_pixels=320 * 240,
            max_video_bytes=1 << 20,
            max_prompt_tokens=4096,
        ),
    )
    yield pipe
    pipe.close()


def request(*videos: VideoInput, text: str = "What happens?") -> list[ChatMessage]:
    parts = [ContentPart(text="Look: "), *(ContentPart(video=v) for v in videos)]
    return [ChatMessage("user", (*parts, ContentPart(text=text)))]


def refused(pipe: EncoderPipeline, messages) -> str:
    with pytest.raises(InvalidInput) as info:
        pipe.prepare(messages)
    assert pipe.budget.used_bytes == 0
    return str(info.value)


@pytest.mark.parametrize("name", list(BAD))
def test_bad_video_is_refused_naming_it(video_pipeline, name):
    make, expected = BAD[name]
    good = VideoInput(make_video(num_frames=8, seed=1))
    message = refused(video_pipeline, request(good, VideoInput(make())))
    assert message.startswith("video 1: ") and expected in message, message
    # and the pipeline keeps serving
    prompt = video_pipeline.prepare(request(good))
    video_pipeline.discard(prompt)


def test_a_variable_rate_clip_takes_its_rate_from_its_timestamps(video_pipeline):
    # FFmpeg's AVI counts 1 ms ticks in its header (1,500 "frames") for 8 frames of 1.25 s
    times = [0, 100, 250, 400, 700, 800, 1000, 1250]
    data = make_video(times_ms=times, container="avi")
    header = probe_video(data, VideoLimits())
    assert header.num_frames == 8
    assert header.fps == pytest.approx(8 / (1.25 * 8 / 7))  # the span plus a mean interval
    prompt = video_pipeline.prepare(request(VideoInput(data)))
    video_pipeline.discard(prompt)
    (video,) = prompt.items  # 1.43 s at 2 fps: 4 frames, 2 groups
    assert (video.num_frames, video.grid_thw[0]) == (4, 2)


@pytest.mark.parametrize(
    ("facts", "fps"),
    [
        ((30.0, 90, 90, 2.9, 3.0), 30.0),  # the header counts the stream's frames: its rate
        ((30.0, 0, 90, 2.9, 0.0), 30.0),  # it counts none
        ((0.0, 90, 90, 3.0, 3.0), 30.0),  # no rate in the header: the timestamps'
        ((0.0, 0, 90, 0.0, 4.5), 20.0),  # nor timestamps: the declared duration's
        ((1000.0, 1500, 8, 1.43, 1.5), 8 / 1.43),  # ticks counted, timestamps fill the time
    ],
)
def test_frame_rate_from_what_probing_found(facts, fps):
    assert frame_rate(*facts) == pytest.approx(fps)


@pytest.mark.parametrize(
    ("facts", "message"),
    [
        ((30.0, 90, 45, 1.5, 3.0), "header says 90 frames but its stream holds 45"),
        ((30.0, 90, 45, 0.0, 3.0), "header says 90 frames but its stream holds 45"),
        # as many frames as ticks would be, but at 400 fps by the header's own duration
        ((4.0, 1000, 10, 2.5, 2.5), "header says 1000 frames but its stream holds 10"),
        ((0.0, 0, 45, 0.0, 0.0), "video has no frame rate"),
    ],
)
def test_a_rate_nothing_supports_is_refused(facts, message):
    with pytest.raises(InvalidInput, match=message):
        frame_rate(*facts)


def test_limits_from_the_header(video_pipeline):
    big = make_video(num_frames=4, width=640, height=480)
    assert "640x480 = 307200 pixels; the limit is 76800" in refused(
        video_pipeline, request(VideoInput(big))
    )
    long = make_video(num_frames=84, fps=4)  # 21 s
    assert "21.0 s long; the limit is 20 s" in refused(video_pipeline, request(VideoInput(long)))
    huge = VideoInput(ImageSource("data", bytes(2 << 20)))
    assert "video is 2097152 bytes; the limit is 1048576" in refused(video_pipeline, request(huge))


def test_sampling_beyond_the_encoder_is_refused(video_pipeline):
    data = make_video(num_frames=8)
    too_fast = VideoInput(data, VideoSampling(fps=100))
    assert "fps is 100; this encoder allows at most 2" in refused(video_pipeline, request(too_fast))
    crossed = VideoInput(data, VideoSampling(min_frames=8, max_frames=4))
    assert "min_frames 8 > max_frames 4" in refused(video_pipeline, request(crossed))


def test_too_many_videos_and_prompt_too_long(video_pipeline):
    data = make_video(num_frames=8)
    three = request(*(VideoInput(data) for _ in range(3)))
    assert "3 videos; the limit is 2" in refused(video_pipeline, three)
    long = make_video(num_frames=80, width=320, height=240, fps=4)  # 20 s at 2 fps: 40 frames
    # a per-frame floor above the frames' share of the total budget
    dense = VideoInput(long, VideoSampling(min_pixels=200_000, max_pixels=300_000))
    message = refused(video_pipeline, request(dense))
    assert "tokens" in message and "1 video), more than the limit of 4096" in message


def test_a_passed_deadline_or_a_cancel_stops_the_decode(video_pipeline):
    """The request's ``StopCheck`` is asked between frames: past its deadline, or once
    cancelled (which wins), nothing more is decoded, nothing is counted and the pixel budget is
    given back; a later deadline is met."""
    messages = request(VideoInput(make_video(num_frames=8, seed=4)))
    frames, _ = video_pipeline.video_totals()
    with pytest.raises(DeadlineExpired, match="deadline passed while decoding the video"):
        video_pipeline.prepare(messages, stop=StopCheck(time.monotonic() - 1))
    cancelled = StopCheck(time.monotonic() - 1)
    cancelled.cancel("cancelled: client went away")
    with pytest.raises(RequestCancelled, match="client went away while decoding the video"):
        video_pipeline.prepare(messages, stop=cancelled)
    assert video_pipeline.budget.used_bytes == 0
    assert video_pipeline.video_totals()[0] == frames
    prompt = video_pipeline.prepare(messages, stop=StopCheck(time.monotonic() + 60))
    assert video_pipeline.video_totals()[0] == frames + 4
    video_pipeline.discard(prompt)


def test_sources_like_images(video_pipeline, tmp_path):
    data = make_video(num_frames=8, seed=2)
    as_bytes = video_pipeline.prepare(request(VideoInput(data)))
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    as_url = video_pipeline.prepare(request(VideoInput(ImageSource("base64", url))))
    assert as_bytes.items[0].key == as_url.items[0].key
    for prompt in (as_bytes, as_url):
        video_pipeline.discard(prompt)
    path = tmp_path / "clip.mp4"
    path.write_bytes(data)
    message = refused(video_pipeline, request(VideoInput(ImageSource("path", str(path)))))
    assert "local video paths are disabled" in message
    message = refused(video_pipeline, request(VideoInput(ImageSource("url", "http://x/a.mp4"))))
    assert "video URLs are disabled" in message


@pytest.mark.parametrize("container,codec", [("mp4", "mpeg4"), ("webm", "libvpx-vp9")])
def test_random_damage_is_refused_or_decoded_never_anything_else(video_pipeline, container, codec):
    """Bytes flipped, cut or overwritten anywhere: the request is served or refused with a clear
    ``InvalidInput``; no other exception escapes and nothing stays held."""
    good = make_video(num_frames=12, codec=codec, container=container, seed=5)
    rng = np.random.default_rng(1)
    refused_count = 0
    for trial in range(45):
        data = bytearray(good)
        if trial % 3 == 0:
            for at in rng.integers(0, len(data), size=8):
                data[at] = int(rng.integers(0, 256))
        elif trial % 3 == 1:
            data = data[: int(rng.integers(1, len(data)))]
        else:
            at = int(rng.integers(0, len(data)))
            data[at : at + 64] = rng.integers(0, 256, 64, dtype=np.uint8).tobytes()
        try:
            prompt = video_pipeline.prepare(request(VideoInput(bytes(data))))
        except InvalidInput as exc:
            assert str(exc).startswith("video 0: ")
            refused_count += 1
        else:
            video_pipeline.discard(prompt)
        assert video_pipeline.budget.used_bytes == 0
    assert refused_count > 0


def test_allowed_paths_and_urls_like_images(tmp_path):
    """The image sources' policy, with the video byte limit: a file under an allowed directory
    and an http(s) URL (where private addresses are allowed) give the same video as its bytes."""
    import http.server
    import threading

    data = make_video(num_frames=8, seed=6)
    (tmp_path / "clip.mp4").write_bytes(data)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the handler's API
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = EncoderConfig(allowed_dirs=(str(tmp_path),), allow_urls=True, allow_private_urls=True)
    intake = VideoIntake(config)
    try:
        url = f"http://127.0.0.1:{server.server_port}/clip.mp4"
        sources = [data, ImageSource("path", str(tmp_path / "clip.mp4")), ImageSource("url", url)]
        opened = [intake.open(VideoInput(source), 0) for source in sources]
        assert all(o.data == data for o in opened)
        assert {o.header for o in opened} == {opened[0].header}
        small = VideoIntake(dataclasses.replace(config, max_video_bytes=100))
        with pytest.raises(InvalidInput, match=r"video 0: URL body is \d+ bytes; the limit is 100"):
            small.open(VideoInput(ImageSource("url", url)), 0)
    finally:
        server.shutdown()
        server.server_close()


def test_default_budget_follows_the_request_prompt_limit(video_pipeline):
    """With no total pixel budget set, a video is sampled to fit 90% of the request's prompt
    limit (what the gateway sends: the language worker's context), not refused."""
    from services.encoder.types import RequestLimits

    data = make_video(num_frames=80, width=320, height=240, fps=4, seed=8)  # 20 s: 40 frames
    clip = VideoInput(data, VideoSampling(min_pixels=16 * 28 * 28))  # a low per-frame floor
    wide = video_pipeline.prepare(request(clip))
    narrow = video_pipeline.prepare(request(clip), limits=RequestLimits(max_prompt_tokens=1500))
    for prompt in (wide, narrow):
        video_pipeline.discard(prompt)
    assert len(wide.items[0].groups) == len(narrow.items[0].groups) == 20  # same frames
    assert wide.items[0].num_tokens > 1500 * 0.9 >= narrow.items[0].num_tokens
    asked = VideoInput(data, VideoSampling(min_pixels=16 * 28 * 28, total_pixels=2_800_000))
    with pytest.raises(InvalidInput, match="more than the limit of 1500"):
        video_pipeline.prepare(request(asked), limits=RequestLimits(max_prompt_tokens=1500))
    assert video_pipeline.budget.used_bytes == 0
