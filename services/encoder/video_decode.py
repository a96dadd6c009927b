"""Encoded video bytes -> its header facts, then the sampled frames as RGB arrays (PyAV).

Two steps, so limits come before pixels:

* ``probe_video`` opens the container, reads its header (streams, frame size, rate, duration,
  declared frame count) and checks the limits there; then it demuxes the video stream's packets
  *without decoding them* to count the frames the file really holds (bounded by the frame
  limit, so a header that understates its length cannot make us read more) and to see the span
  of their timestamps. A declared frame count that disagrees with the packets is a lying header
  and is refused, unless the timestamps fill the duration it declares (a variable-rate AVI
  counts time-base ticks, not frames); the frame rate is the header's, or the timestamps' when
  the header has none or counts ticks (``frame_rate``). Once every limit
  passed, the first frame is decoded for the stream's display matrix (a phone's portrait clip
  is stored landscape; a mirrored clip is stored flipped): the header's size is the displayed
  one.
* ``decode_frames`` decodes the stream once, front to back, and hands each wanted frame (by
  index) to a callback as 8-bit RGB, shown as the display matrix says (``display_transform``:
  the quarter turns and flips FFmpeg's own autorotation applies); given more than one worker,
  the conversion and the callback run on worker threads while the decoder goes on. Frames not
  wanted are decoded (the codec needs them) but never converted. Every frame must have the
  header's stored size. Between two frames it asks the
  request's ``StopCheck``, which raises ``DeadlineExpired`` once the deadline passed and
  ``RequestCancelled`` once the room was cancelled: a long clip is not decoded for a request
  that already ended.

Every other failure is an ``InvalidInput``: corrupt, truncated, audio-only, unsupported, zero
frames, over a limit, or lying about its length.

NOTE: only the container demuxers in ``CONTAINERS`` are ever used (FFmpeg's
``format_whitelist``): playlist and concat demuxers (HLS, ffconcat) would otherwise open the
files or URLs a crafted "video" names.
"""

from __future__ import annotations

import collections
import contextlib
import io
import math
import struct
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np

from .decode import DecodeLimits, check_size
from .errors import InvalidInput
from .stop import StopCheck

CONTAINERS = "mov,mp4,matroska,webm,avi,mpegts,flv,ogg"  # demuxers a video may use
# What PyAV raises on bytes it cannot make sense of (text it cannot decode is a ValueError).
UNREADABLE = (av.FFmpegError, ValueError, TypeError, OverflowError, EOFError, MemoryError)


@dataclass(frozen=True)
class VideoLimits:
    """What a video may be, checked from its header and packets before any frame is decoded."""

    max_seconds: float = 600.0
    max_frames: int = 36_000  # frames in the file (not sampled ones)
    max_streams: int = 8
    frame: DecodeLimits = DecodeLimits(max_pixels=8_294_400)  # per frame (4K UHD)


@dataclass(frozen=True)
class VideoHeader:
    """What probing a video found: the facts sampling and the budget need. ``width`` and
    ``height`` are the frames' as displayed: a phone's portrait clip is stored landscape with a
    display rotation (a mirrored clip with a flip), and its frames are shown as the display
    matrix says as they are decoded."""

    width: int
    height: int
    num_frames: int  # video packets (= frames) in the stream
    fps: float  # its average frame rate
    codec: str
    rotation: int = 0  # degrees counter-clockwise the stored frames are turned: 0, 90, 180, 270
    mirrored: bool = False  # stored frames are flipped left-right before they are turned

    @property
    def stored_size(self) -> tuple[int, int]:
        """(width, height) of the frames as stored (before the rotation)."""
        turned = self.rotation in (90, 270)
        return (self.height, self.width) if turned else (self.width, self.height)

    @property
    def duration_s(self) -> float:
        return self.num_frames / self.fps


def probe_video(data: bytes, limits: VideoLimits) -> VideoHeader:
    """The header facts of ``data`` once they passed ``limits`` (then its first frame is decoded,
    for its display rotation only)."""
    with _reading(data) as container:
        if len(container.streams) > limits.max_streams:
            raise InvalidInput(
                f"video container has {len(container.streams)} streams; "
                f"the limit is {limits.max_streams}"
            )
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            raise InvalidInput(f"file has no video stream (streams: {', '.join(kinds)})")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        if ctx is None or not ctx.name:
            raise InvalidInput("video stream uses an unsupported codec")
        width, height = int(ctx.width or 0), int(ctx.height or 0)
        if width <= 0 or height <= 0:
            raise InvalidInput("video header has no frame size (corrupt or unsupported)")
        check_size(width, height, limits.frame)
        rate = stream.average_rate or stream.guessed_rate
        header_fps = float(rate) if rate else 0.0
        declared_s = _declared_seconds(stream, container)
        if declared_s > limits.max_seconds:
            raise InvalidInput(
                f"video is {declared_s:.1f} s long; the limit is {limits.max_seconds:g} s"
            )
        declared = int(stream.frames or 0)
        if declared > limits.max_frames:
            raise InvalidInput(f"video has {declared} frames; the limit is {limits.max_frames}")
        num_frames, timed_s = _scan_packets(container, stream, limits.max_frames)
        codec = ctx.name
    if num_frames == 0:
        raise InvalidInput("video stream holds no frames")
    fps = frame_rate(header_fps, declared, num_frames, timed_s, declared_s)
    if num_frames / fps > limits.max_seconds:
        raise InvalidInput(
            f"video is {num_frames / fps:.1f} s long ({num_frames} frames at {fps:g} fps); "
            f"the limit is {limits.max_seconds:g} s"
        )
    rotation, mirrored = _display(data)
    if rotation in (90, 270):
        width, height = height, width
    return VideoHeader(width, height, num_frames, fps, codec, rotation, mirrored)


def display_transform(matrix: Sequence[int]) -> tuple[int, bool]:
    """(degrees counter-clockwise, mirrored) that show frames stored under FFmpeg's display
    ``matrix`` (9 int32, ``AV_PKT_DATA_DISPLAYMATRIX``) as FFmpeg's own autorotation does: its
    angle rounded to a quarter turn, and the flips its signs say (a mirrored frame is flipped
    left-right, then turned). (0, False) for a matrix without an angle."""
    a, b, c, d = (v / 65536 for v in (matrix[0], matrix[1], matrix[3], matrix[4]))
    if math.hypot(a, c) == 0 or math.hypot(b, d) == 0:
        return 0, False
    clockwise = round(math.degrees(math.atan2(b / math.hypot(b, d), a / math.hypot(a, c))))
    quarter = round(clockwise / 90) % 4
    if quarter == 1:  # FFmpeg: transpose "cclock_flip" when c > 0, else "clock"
        return (90, True) if c > 0 else (270, False)
    if quarter == 3:  # "clock_flip" when c < 0, else "cclock"
        return (270, True) if c < 0 else (90, False)
    vflip = d < 0  # upside down: a left-right flip turned half way
    if quarter == 2 and a < 0:  # "hflip" (and "vflip": both make a half turn)
        return (180, False) if vflip else (0, True)
    return (180, True) if vflip else (0, False)  # "vflip" alone, or nothing


def _display(data: bytes) -> tuple[int, bool]:
    """``display_transform`` of ``data``'s video stream. NOTE: PyAV reads the display matrix
    from decoded frames only, so the first frame is decoded (after every limit passed)."""
    with _reading(data) as container:
        for frame in container.decode(container.streams.video[0]):
            for side in frame.side_data:
                if side.type == av.sidedata.sidedata.Type.DISPLAYMATRIX and side.buffer_size >= 36:
                    # FFmpeg stores the matrix as native int32
                    return display_transform(struct.unpack("=9i", bytes(side)[:36]))
            return 0, False
    raise InvalidInput("video stream holds no decodable frame")


def decode_frames(
    data: bytes,
    header: VideoHeader,
    wanted: list[int],
    on_frame: Callable[[int, np.ndarray], None],
    stop: StopCheck | None = None,
    workers: int = 1,
) -> None:
    """Decode ``data`` and call ``on_frame(index, rgb [H, W, 3] uint8)`` for every frame index
    in ``wanted`` (ascending; repeats allowed): on this thread in index order when ``workers``
    is 1, else on up to ``workers`` threads at once, so each wanted frame's RGB conversion and
    ``on_frame``'s work (a resize) overlap the decoding of the next ones (both release the GIL).
    ``stop.check`` before each frame (``DeadlineExpired``, ``RequestCancelled``)."""
    if not wanted:
        return
    todo = sorted(set(wanted))
    with _reading(data) as container, FrameHandoff(workers) as handoff:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        index, pos = 0, 0
        for frame in container.decode(stream):
            if stop is not None:
                stop.check(f"decoding the video (frame {index} of {header.num_frames})")
            if index == todo[pos]:
                stored_w, stored_h = header.stored_size
                if (frame.width, frame.height) != (stored_w, stored_h):
                    raise InvalidInput(
                        f"video frame {index} is {frame.width}x{frame.height}; the header says "
                        f"{stored_w}x{stored_h}"
                    )
                handoff.run(_deliver, header, frame, index, on_frame)
                pos += 1
                if pos == len(todo):
                    return
            index += 1
    raise InvalidInput(
        f"video decoded to {index} frames, fewer than its {header.num_frames} packets "
        "(corrupt or truncated)"
    )


def _deliver(
    header: VideoHeader,
    frame: av.VideoFrame,
    index: int,
    on_frame: Callable[[int, np.ndarray], None],
) -> None:
    """``on_frame(index, rgb)`` with ``frame`` as displayed (``display_transform``)."""
    rgb = frame.to_ndarray(format="rgb24")
    if header.mirrored:
        rgb = rgb[:, ::-1]
    if header.rotation or header.mirrored:
        rgb = np.ascontiguousarray(np.rot90(rgb, header.rotation // 90))
    on_frame(index, rgb)


class FrameHandoff:
    """Runs each decoded frame's work on up to ``workers`` threads while the decoder goes on
    (inline with one). At most ``IN_FLIGHT_PER_WORKER`` frames per worker wait or run: a slow
    ``on_frame`` holds the decoder back instead of letting decoded frames pile up. Leaving the
    ``with`` block waits for every frame's work and raises the first failure, unless the block
    itself raised (then the frames still in flight are waited for and their failures dropped)."""

    IN_FLIGHT_PER_WORKER = 2

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(workers, "epd-frames") if workers > 1 else None
        self._limit = max(1, workers) * self.IN_FLIGHT_PER_WORKER
        self._in_flight: collections.deque[Future] = collections.deque()

    def __enter__(self) -> FrameHandoff:
        return self

    def run(self, fn: Callable[..., None], *args) -> None:
        if self._pool is None:
            fn(*args)
            return
        while len(self._in_flight) >= self._limit:
            self._in_flight.popleft().result()
        self._in_flight.append(self._pool.submit(fn, *args))

    def __exit__(self, kind, exc, tb) -> None:
        if self._pool is None:
            return
        try:
            while self._in_flight:
                future = self._in_flight.popleft()
                if exc is None:
                    future.result()
                else:
                    futures.wait([future])
        finally:
            for future in self._in_flight:
                future.cancel()
            self._pool.shutdown(wait=True)


@contextlib.contextmanager
def _reading(data: bytes) -> Iterator:
    """The container of ``data``, open for the ``with`` block and closed after it; a read that
    fails inside the block is an ``InvalidInput`` (corrupt or truncated)."""
    container = _open(data)
    try:
        yield container
    except InvalidInput:
        raise
    except UNREADABLE as exc:
        raise InvalidInput(f"corrupt or truncated video ({_why(exc)})") from None
    finally:
        container.close()


def _open(data: bytes):
    try:
        return av.open(io.BytesIO(data), mode="r", options={"format_whitelist": CONTAINERS})
    except av.FFmpegError as exc:
        raise InvalidInput(
            "data is not a readable video: corrupt, truncated or an unsupported format "
            f"({_why(exc)})"
        ) from None
    except (ValueError, OSError, EOFError) as exc:
        raise InvalidInput(f"corrupt or truncated video ({_why(exc)})") from None


def _why(exc: Exception) -> str:
    """FFmpeg's reason, without PyAV's placeholder file name."""
    return str(getattr(exc, "strerror", None) or exc)


def _declared_seconds(stream, container) -> float:
    """The duration the header declares (the stream's, else the container's); 0 when none."""
    if stream.duration and stream.time_base:
        return float(stream.duration * Fraction(stream.time_base))
    if container.duration:
        return container.duration / av.time_base
    return 0.0


def _scan_packets(container, stream, max_frames: int) -> tuple[int, float]:
    """(video packets with data in the stream, seconds their timestamps span: the first start
    to the last one's plus the mean interval, 0 when they do not tell), demuxed, not decoded;
    refused past the frame limit."""
    num = 0
    first = last = None
    for packet in container.demux(stream):
        if not packet.size:
            continue
        num += 1
        if num > max_frames:
            raise InvalidInput(f"video has more than {max_frames} frames (the limit)")
        if packet.pts is not None:
            first = packet.pts if first is None else min(first, packet.pts)
            last = packet.pts if last is None else max(last, packet.pts)
    if num < 2 or first is None or last <= first or not stream.time_base:
        return num, 0.0
    return num, float((last - first) * Fraction(stream.time_base)) * num / (num - 1)


def frame_rate(
    header_fps: float, declared_frames: int, num_frames: int, timed_s: float, declared_s: float
) -> float:
    """A clip's average frame rate, from what probing found: the header's rate when the header
    counts the frames the stream holds (or counts none); else the packets' timestamps, as for a
    variable-rate clip whose header counts time-base ticks, not frames (AVI) or a stream with no
    rate at all; else the declared duration. Raises InvalidInput when the header's count
    disagrees with the stream unless it is ticks (it is the declared duration at the header's
    rate, and the timestamps fill that duration): a truncated file, a header that lies; or when
    nothing gives a rate."""
    ticks = declared_s * header_fps
    counts_ticks = (
        abs(declared_frames - ticks) <= max(1.0, 0.01 * ticks) and timed_s >= 0.9 * declared_s > 0
    )
    if declared_frames not in (0, num_frames) and not counts_ticks:
        raise InvalidInput(
            f"video header says {declared_frames} frames but its stream holds {num_frames} "
            "(truncated or corrupt)"
        )
    if header_fps > 0 and declared_frames in (0, num_frames):
        return header_fps
    for seconds in (timed_s, declared_s):
        if seconds > 0:
            return num_frames / seconds
    raise InvalidInput("video has no frame rate: neither its header nor its timestamps give one")
