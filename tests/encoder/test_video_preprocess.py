"""Video preprocessing against independent references on the same frames.

* frame choice and size: a plain reimplementation of qwen-vl-utils' published rules
  (``smart_nframes``, the per-frame share of the total pixel budget) and transformers' own
  ``smart_resize``;
* patches: frames decoded here with PyAV, resized with PIL, normalized by transformers' image
  processor (PIL backend, the frame alone) and laid out as transformers' video processor's
  ``patchify`` does (its view / permute, written out below: the module needs torchvision);
* rows: the checkpoint's vision tower on the whole video (grid ``(T, h, w)``) equals the rows
  of its frame groups encoded one by one, which is how the encoder runs them.
"""

from __future__ import annotations

import copy
import math
import threading

import numpy as np
import pytest
import torch
from PIL import Image

from services.encoder.config import EncoderConfig
from services.encoder.errors import InvalidInput
from services.encoder.pipeline import EncoderPipeline
from services.encoder.types import ChatMessage, ContentPart, VideoInput, VideoSampling
from services.encoder.video_decode import (
    FrameHandoff,
    VideoHeader,
    VideoLimits,
    decode_frames,
    probe_video,
)
from services.encoder.video_sampling import VideoSettings, plan_video, sample_indices
from tests.media import decoded_frames, make_video

ARCHS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


def reference_nframes(total: int, video_fps: float, s: VideoSettings) -> list[int]:
    """qwen-vl-utils ``smart_nframes`` + ``torch.linspace(...).round()``, FRAME_FACTOR = 2."""
    min_frames = math.ceil(s.min_frames / 2) * 2
    max_frames = math.floor(min(s.max_frames, total) / 2) * 2
    nframes = total / video_fps * s.fps
    nframes = min(min(max(nframes, min_frames), max_frames), total)
    nframes = math.floor(nframes / 2) * 2
    nframes = max(nframes, 2)
    return torch.linspace(0, total - 1, nframes).round().long().tolist()


SETTINGS = VideoSettings(
    fps=2.0, min_frames=4, max_frames=768, min_pixels=3136, max_pixels=50176, total_pixels=10**6
)


@pytest.mark.parametrize(
    ("total", "video_fps", "fps", "min_frames", "max_frames"),
    [
        (12, 4.0, 2.0, 4, 768),  # 3 s at 2 fps: 6 frames
        (300, 30.0, 2.0, 4, 768),  # 10 s: 20 frames
        (301, 29.97, 2.0, 4, 768),
        (7, 30.0, 2.0, 4, 768),  # short: min_frames, as far as the video has them
        (3, 25.0, 2.0, 4, 768),
        (1000, 25.0, 5.0, 4, 16),  # capped by max_frames
        (90, 30.0, 0.5, 5, 768),  # min_frames rounded up to 6
    ],
)
def test_frame_choice_follows_qwen_rules(total, video_fps, fps, min_frames, max_frames):
    settings = VideoSettings(fps, min_frames, max_frames, 3136, 50176, 10**6)
    indices = sample_indices(total, video_fps, settings, 2)
    assert indices == reference_nframes(total, video_fps, settings)
    assert len(indices) % 2 == 0 and indices == sorted(indices)


@pytest.mark.parametrize("num_frames", [6, 40, 400])
def test_frame_size_shares_the_total_budget(num_frames):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    header = VideoHeader(width=640, height=360, num_frames=num_frames, fps=2.0, codec="test")
    plan = plan_video(header, SETTINGS, patch_size=14, merge_size=2, temporal_patch_size=2)
    n = len(plan.indices)
    max_pixels = max(min(SETTINGS.max_pixels, SETTINGS.total_pixels * 2 / n), 3136 * 1.05)
    h, w = smart_resize(360, 640, 28, 3136, int(max_pixels))
    assert (plan.height, plan.width) == (h, w)
    assert plan.grid_thw == (n // 2, h // 14, w // 14)
    assert plan.num_tokens == n // 2 * (h // 28) * (w // 28)
    assert plan.second_per_grid_t == pytest.approx(2 / (n / num_frames * 2.0))
    times = [i / 2.0 for i in plan.indices]
    pairs = zip(times[::2], times[1::2], strict=True)
    assert plan.timestamps == pytest.approx([(a + b) / 2 for a, b in pairs])


def patchify(frames: torch.Tensor, patch: int, merge: int, temporal: int) -> torch.Tensor:
    """transformers' ``Qwen2VLVideoProcessor.patchify`` for one video ``[T, C, H, W]``."""
    num_frames, channel, height, width = frames.shape
    grid_t, grid_h, grid_w = num_frames // temporal, height // patch, width // patch
    patches = frames.view(
        1, grid_t, temporal, channel, grid_h // merge, merge, patch, grid_w // merge, merge, patch
    )
    patches = patches.permute(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(grid_t * grid_h * grid_w, channel * temporal * patch * patch)


def normalized_frame(proc, frame: Image.Image) -> torch.Tensor:
    """``[C, H, W]``: the image processor's normalization of one frame (its own patches of the
    frame, unfolded back; its first temporal copy)."""
    out = proc(images=[frame], do_resize=False, return_tensors="pt")["pixel_values"]
    p, m = int(proc.patch_size), int(proc.merge_size)
    gh, gw = frame.height // p, frame.width // p
    x = out.view(gh // m, gw // m, m, m, 3, int(proc.temporal_patch_size), p, p)[:, :, :, :, :, 0]
    return x.permute(4, 0, 2, 5, 1, 3, 6).reshape(3, frame.height, frame.width)


@pytest.fixture(scope="module")
def pipelines(model_dirs):
    config = EncoderConfig(
        device="cpu", dtype="float32", sender="none", video_min_pixels=4 * 28 * 28 * 4
    )
    pipes = {arch: EncoderPipeline(model_dirs[arch], config) for arch in ARCHS}
    yield pipes
    for pipe in pipes.values():
        pipe.close()


def video_message(data: bytes, sampling: VideoSampling | None = None) -> ChatMessage:
    video = ContentPart(video=VideoInput(data, sampling or VideoSampling()))
    return ChatMessage("user", (video, ContentPart(text="What happens?")))


@pytest.mark.parametrize("arch", ARCHS)
def test_patches_and_rows_match_the_references(pipelines, arch):
    pipe = pipelines[arch]
    data = make_video(num_frames=14, width=80, height=60, fps=4, seed=3)
    prompt = pipe.prepare([video_message(data)])
    (video,) = prompt.items
    proc = pipe.checkpoint.image_processor
    p, m, tp = int(proc.patch_size), int(proc.merge_size), int(proc.temporal_patch_size)
    # the frames, decoded, chosen and resized here
    frames = decoded_frames(data)
    plan = pipe.videos.plan(VideoHeader(80, 60, len(frames), 4.0, "mpeg4"), pipe.videos.defaults)
    assert plan.indices == tuple(reference_nframes(14, 4.0, pipe.videos.defaults))
    size = (plan.width, plan.height)
    bicubic = Image.Resampling.BICUBIC
    chosen = [Image.fromarray(frames[i]).resize(size, bicubic) for i in plan.indices]
    expected = patchify(torch.stack([normalized_frame(proc, f) for f in chosen]), p, m, tp)
    # the groups wait as frames (cut when the ViT takes them) and hold their patches' share
    assert all(g.pixel_values is None and g.pending is not None for g in video.groups)
    assert sum(g.held_bytes for g in video.groups) == plan.pixel_bytes == pipe.budget.used_bytes
    got = torch.cat([group.patches() for group in video.groups])
    assert all(g.pending is None for g in video.groups)
    assert video.grid_thw == (len(chosen) // 2, plan.height // p, plan.width // p)
    assert torch.equal(got, expected)
    # rows: the whole video in one forward == its frame groups one by one
    whole = pipe.tower.forward(expected, [video.grid_thw])
    encoded = pipe.encode([video_message(data)], timeout_s=60)
    assert encoded.image_rows.shape == whole.shape
    # (rows leave the encoder in the wire dtype)
    torch.testing.assert_close(encoded.image_rows, whole.to(encoded.image_rows.dtype))
    pipe.discard(prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_layout_and_positions(pipelines, arch):
    """Placeholders expanded as each model's processor does, positions from ``get_rope_index``
    with the video's grid (and Qwen2.5-VL's seconds per frame group)."""
    pipe = pipelines[arch]
    data = make_video(num_frames=16, width=64, height=64, fps=4, seed=4)
    prompt = pipe.prepare([video_message(data)])
    (video,) = prompt.items
    tokenizer = pipe.checkpoint.tokenizer
    text = tokenizer.decode(prompt.fill_ids[~prompt.image_mask].tolist())
    t, h, w = video.grid_thw
    per_group = h * w // 4
    assert int(prompt.image_mask.sum()) == t * per_group == video.num_tokens
    runs = int((np.diff(prompt.image_mask.astype(np.int8)) == 1).sum())  # video token runs
    if arch == "qwen3_vl":
        for stamp in video.timestamps:
            assert f"<{stamp:.1f} seconds><|vision_start|><|vision_end|>" in text
        assert runs == t
    else:
        assert "<|vision_start|><|vision_end|>" in text
        assert runs == 1
    pad = set(prompt.fill_ids[prompt.image_mask].tolist())
    assert len(pad) == 1 and pad.pop() >= pipe.checkpoint.vocab_size
    # positions: the video's temporal axis advances by group, spaced per model
    first = int(np.flatnonzero(prompt.image_mask)[0])
    step = prompt.positions[0, first + per_group] - prompt.positions[0, first]
    if arch == "qwen2_5_vl":
        spg = video.second_per_grid_t
        tps = pipe.checkpoint.config.vision_config.tokens_per_second
        assert step == int(tps * spg)
    elif arch == "qwen2_vl":
        assert step == 1
    pipe.discard(prompt)


def test_sampling_settings_change_identity(pipelines):
    pipe = pipelines["qwen2_5_vl"]
    data = make_video(num_frames=24, width=64, height=64, fps=4, seed=5)
    a = pipe.prepare([video_message(data)])
    b = pipe.prepare([video_message(data, VideoSampling(fps=1.0))])
    c = pipe.prepare([video_message(data)])
    assert a.items[0].key == c.items[0].key != b.items[0].key
    assert len(a.items[0].groups) == 6 and len(b.items[0].groups) == 3
    assert a.fill_ids[a.image_mask][0] != b.fill_ids[b.image_mask][0]
    for prompt in (a, b, c):
        pipe.discard(prompt)


@pytest.mark.parametrize("arch", ARCHS)
def test_processor_fallback_cuts_the_same_patches(pipelines, arch):
    """Where the lookup table is not used (a processor setting it does not reproduce), each
    frame goes through the image processor and one temporal slice is kept: the same values."""
    from services.encoder.video_prep import VideoPreprocessor

    pipe = pipelines[arch]
    rng = np.random.default_rng(2)
    side = pipe.preprocessor.factor * 2
    frames = [rng.integers(0, 256, (side, side, 3), dtype=np.uint8) for _ in range(2)]
    fast = pipe.videos.cut(frames)
    images = copy.copy(pipe.preprocessor)
    images._cutter = None
    slow = VideoPreprocessor(images, pipe.videos.defaults).cut(frames)
    assert torch.equal(fast, slow)


def ffmpeg_display_matrix(clockwise: int, hflip: bool, vflip: bool) -> list[int]:
    """FFmpeg's ``av_display_rotation_set`` (a clockwise turn) then ``av_display_matrix_flip``."""
    radians = -math.radians(clockwise)
    cos, sin = round(math.cos(radians)), round(math.sin(radians))
    matrix = [cos << 16, -sin << 16, 0, sin << 16, cos << 16, 0, 0, 0, 1 << 30]
    for i in range(9):  # a flip negates the matrix's first (h) or second (v) column
        matrix[i] *= -1 if (i % 3 == 0 and hflip) or (i % 3 == 1 and vflip) else 1
    return matrix


def displayed(frame: np.ndarray, matrix: list[int]) -> np.ndarray:
    """``frame`` as the display matrix maps it, from the matrix's definition: stored pixel
    (x, y) shows at (a x + c y, b x + d y), shifted to start at 0 (y grows downwards)."""
    a, b, c, d = (v >> 16 for v in (matrix[0], matrix[1], matrix[3], matrix[4]))
    ys, xs = np.mgrid[0 : frame.shape[0], 0 : frame.shape[1]]
    x2, y2 = a * xs + c * ys, b * xs + d * ys
    x2, y2 = x2 - x2.min(), y2 - y2.min()
    out = np.zeros((y2.max() + 1, x2.max() + 1, 3), np.uint8)
    out[y2, x2] = frame
    return out


@pytest.mark.parametrize("clockwise", [0, 90, 180, 270])
@pytest.mark.parametrize("flips", [(True, False), (False, True), (True, True)])
def test_display_matrix_flips_are_applied(clockwise, flips):
    """A mirrored clip (a display matrix with flips, as some cameras write): every one of the
    eight orientations is decoded as its matrix says, by the matrix's own definition."""
    matrix = ffmpeg_display_matrix(clockwise, *flips)
    data = make_video(num_frames=4, width=56, height=28, fps=4, seed=7, display_matrix=matrix)
    header = probe_video(data, VideoLimits())
    expected = [displayed(f, matrix) for f in decoded_frames(data)]
    assert (header.width, header.height) == expected[0].shape[1::-1]
    got = []
    decode_frames(data, header, list(range(4)), lambda _, rgb: got.append(rgb))
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("rotation", [0, 90, 180, 270])
def test_display_rotation_turns_frames_upright(pipelines, rotation):
    """A clip stored landscape with a display rotation (as phones write portrait clips) is
    sampled as displayed: the header's size, the frames and the grid are the upright ones."""
    pipe = pipelines["qwen2_5_vl"]
    data = make_video(num_frames=8, width=224, height=112, fps=4, seed=6, rotation=rotation)
    header = probe_video(data, VideoLimits())
    turned = rotation in (90, 270)
    assert header.rotation == rotation
    assert (header.width, header.height) == ((112, 224) if turned else (224, 112))
    plan = pipe.videos.plan(header, pipe.videos.defaults)
    assert (plan.width, plan.height) == (header.width, header.height)  # no resize here
    frames = pipe.videos.sampled_frames(data, header, plan)
    upright = [np.rot90(f, rotation // 90) for f in decoded_frames(data)]
    for got, index in zip(frames, plan.indices, strict=True):
        assert np.array_equal(got, upright[index])
    prompt = pipe.prepare([video_message(data)])
    _, grid_h, grid_w = prompt.items[0].grid_thw
    assert (grid_w * 14, grid_h * 14) == (header.width, header.height)
    pipe.discard(prompt)


@pytest.mark.parametrize("workers", [2, 3])
def test_frames_handed_to_workers_are_the_decoded_frames(workers):
    """With worker threads each wanted frame still reaches ``on_frame`` once, as decoded (a
    repeated index once), whatever order the workers finish in."""
    data = make_video(num_frames=12, width=64, height=48, fps=4, seed=3)
    header = probe_video(data, VideoLimits())
    expected = decoded_frames(data)
    got: dict[int, np.ndarray] = {}
    threads = set()

    def on_frame(index, rgb):
        assert index not in got
        threads.add(threading.current_thread().name)
        got[index] = rgb

    decode_frames(data, header, [0, 2, 2, 5, 7, 11], on_frame, workers=workers)
    assert sorted(got) == [0, 2, 5, 7, 11]
    assert all(np.array_equal(got[i], expected[i]) for i in got)
    assert all(name.startswith("epd-frames") for name in threads)


def test_a_failing_frame_on_a_worker_fails_the_decode():
    data = make_video(num_frames=8, width=32, height=32, fps=4, seed=4)
    header = probe_video(data, VideoLimits())

    def on_frame(index, rgb):
        if index == 3:
            raise InvalidInput("frame 3 is bad")

    with pytest.raises(InvalidInput, match="frame 3 is bad"):
        decode_frames(data, header, list(range(8)), on_frame, workers=2)


def test_the_handoff_holds_the_decoder_back_when_workers_fall_behind():
    """At most ``IN_FLIGHT_PER_WORKER`` frames per worker wait or run: the next ``run`` blocks
    until one is done, so decoded frames cannot pile up behind a slow callback."""
    release = threading.Event()
    limit = 2 * FrameHandoff.IN_FLIGHT_PER_WORKER
    with FrameHandoff(2) as handoff:
        for _ in range(limit):
            handoff.run(release.wait, 30)
        extra = threading.Thread(target=handoff.run, args=(release.wait, 30))
        extra.start()
        extra.join(0.3)
        assert extra.is_alive()  # blocked behind the full hand-off
        release.set()
        extra.join(30)
        assert not extra.is_alive()
