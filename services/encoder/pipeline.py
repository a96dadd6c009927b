"""The encoder without gRPC or shipping: messages + images and videos -> ``EncodedPrompt``.

Two halves: ``prepare`` (synchronous: intake, validation, resize, tokenization, positions; raises
``InvalidInput``, or ``Overloaded`` when the pixel budget is full) and ``submit`` (asynchronous:
the ViT loop, cache). ``encode`` does both and waits. Thread-safe; ``prepare`` may run on many
threads at once. A prepared prompt holds a share of the pixel budget until the ViT consumed its
patches: submit it or ``discard`` it.

``prepare`` works in the order that keeps memory bounded: image and video counts; source bytes
and headers (size, pixel and aspect limits, no pixels decoded; a video's container probed and
its frames planned, ``video_sampling``); the prompt's length from the headers' token counts and
the tokenized text; the pixel budget; and only then decoding, the cache lookup and, on a miss,
resizing and the image processor (a video: its chosen frames, one ViT unit per frame group).

Messages are ``ChatMessage`` objects or template-style dicts::

    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}

A dict image part takes its image from ``{"type": "image", "image": x}`` or, when it has none,
from the next entry of ``images`` (PIL images, encoded bytes or ``ImageSource``); a video part
is ``{"type": "video", "video": VideoInput | bytes | str}``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from common.transfer.layout import parse_dtype

from .batcher import EncodeTask, VisionBatcher
from .budget import PixelBudget
from .cache import EmbeddingCache
from .checkpoint import load_checkpoint
from .config import EncoderConfig
from .errors import InvalidInput, Overloaded
from .intake import ImageInput, ImageIntake, OpenedImage, OpenedVideo, VideoIntake, naming
from .messages import normalize_messages
from .preprocess import ImagePreprocessor
from .prompt import MediaShape, PromptBuilder, template_messages
from .source_keys import Decoded, SourceKeys, source_digest
from .stop import StopCheck
from .types import (
    EncodedPrompt,
    MediaItem,
    PreparedImage,
    PreparedVideo,
    Prompt,
    RequestLimits,
    VideoInput,
)
from .video_prep import VideoPreprocessor
from .video_sampling import VideoPlan, VideoSettings
from .vision import VisionTower

MIB = 1 << 20
SOURCE_KEYS = 65536  # entries of the bytes -> key table (~100 bytes each)


@dataclass(frozen=True)
class OpenedItem:
    """An image or a video of a request whose header passed the limits (nothing decoded)."""

    opened: OpenedImage | OpenedVideo
    index: int  # among the request's images, or among its videos
    shape: MediaShape  # what its placeholder expands to
    pixel_bytes: int  # its patches
    plan: VideoPlan | None = None  # a video's frames and size


class EncoderPipeline:
    def __init__(self, model_path: str | Path, config: EncoderConfig | None = None) -> None:
        self.config = config or EncoderConfig()
        self.checkpoint = load_checkpoint(model_path)
        self.intake = ImageIntake(self.config)
        self.tower = VisionTower(
            self.checkpoint,
            self.config.device,
            self.config.dtype,
            self.config.linear_kernel,
            self.config.vision_attention,
            self.config.cpu_kernels,
        )
        self.preprocessor = ImagePreprocessor(  # patches in the tower's dtype
            self.checkpoint,
            self.config.min_pixels,
            self.config.max_pixels,
            self.tower.dtype,
            self.tower.native,
        )
        self.prompts = PromptBuilder(self.checkpoint)
        self.video_intake = VideoIntake(self.config)
        defaults = video_defaults(self.config, self.preprocessor.factor)
        self.videos = VideoPreprocessor(self.preprocessor, defaults)
        # Rows leave the ViT in the deployment's wire dtype, whatever the tower computes in.
        self.rows_dtype = parse_dtype(self.config.transfer.dtype)
        cache_bytes = self.config.cache_mb << 20
        self.cache = EmbeddingCache(cache_bytes) if cache_bytes else None
        # what decoding which bytes gave: a repeated item whose rows are cached is not decoded
        self.source_keys = SourceKeys(SOURCE_KEYS) if self.cache is not None else None
        self.budget = PixelBudget(self.config.max_queued_pixel_mb << 20)
        self.batcher = VisionBatcher(
            lambda pixels, grids: self.tower.split(self.tower.forward(pixels, grids), grids),
            self.cache,
            self.config.max_batch_patches,
            self.rows_dtype,
            self.budget.release_image,
            # NOTE: on a CPU one image fills the cores, so a bigger batch only adds waiting; on
            # a GPU batching buys throughput: the patch budget alone
            max_batch_s=self.config.max_batch_ms / 1e3 if self.tower.device.type == "cpu" else 0.0,
        )
        # Observer of each prepared request: seconds of decoding + preprocessing. Metrics set it.
        self.on_prepare: Callable[[float], None] | None = None
        # Observer of each decoded video: (frames sampled, seconds decoding + preprocessing).
        self.on_video: Callable[[int, float], None] | None = None
        self._video_lock = threading.Lock()
        self.num_video_frames = 0  # lifetime totals, under _video_lock
        self.video_decode_s = 0.0

    def prepare(
        self,
        messages: Sequence,
        images: Sequence[ImageInput] = (),
        limits: RequestLimits | None = None,
        stop: StopCheck | None = None,
    ) -> Prompt:
        """Validate and tokenize a request; raises ``InvalidInput`` naming the problem, and
        ``DeadlineExpired`` or ``RequestCancelled`` when ``stop`` says so while a video decodes
        (its deadline passed, its room was cancelled)."""
        start = time.perf_counter()
        prompt = self._prepare(messages, images, limits, stop)
        if self.on_prepare is not None:
            self.on_prepare(time.perf_counter() - start)
        return prompt

    def _prepare(
        self,
        messages: Sequence,
        images: Sequence[ImageInput],
        limits: RequestLimits | None,
        stop: StopCheck | None,
    ) -> Prompt:
        """Every check the headers and the text allow comes before any pixel is decoded."""
        limits = limits or RequestLimits()
        chat, sources = normalize_messages(messages, images)
        max_items = min(x for x in (self.config.max_images, limits.max_images) if x > 0)
        num_videos = sum(isinstance(s, VideoInput) for s in sources)
        if len(sources) > max_items:
            what = "images and videos" if num_videos else "images"
            raise InvalidInput(f"request has {len(sources)} {what}; the limit is {max_items}")
        if num_videos > self.config.max_videos:
            raise InvalidInput(
                f"request has {num_videos} videos; the limit is {self.config.max_videos}"
            )
        max_tokens = min(
            x for x in (self.config.prompt_token_limit, limits.max_prompt_tokens) if x > 0
        )
        opened = self._open(sources, max_tokens)
        ids = self.prompts.text_ids(template_messages(chat))
        self.prompts.check_length(ids, [item.shape for item in opened], max_tokens)
        need = sum(item.pixel_bytes for item in opened)
        if not self.budget.try_reserve(need):
            raise Overloaded(
                f"encoder pixel budget full: the request's images need {need / MIB:.1f} MiB of "
                f"patches, {self.budget.used_bytes / MIB:.1f} of "
                f"{self.budget.capacity_bytes / MIB:.0f} MiB are queued"
            )
        try:
            prompt = self.prompts.build(ids, self._decode(opened, stop))
        except BaseException:
            self.budget.release(need)
            raise
        # the reservation passes to the units that hold patches; hits and duplicates give back
        held = 0
        for image in {id(im): im for im in prompt.images}.values():
            image.held_bytes = image.patch_bytes
            held += image.held_bytes
        self.budget.release(need - held)
        return prompt

    def _open(self, sources: list, max_tokens: int) -> list[OpenedItem]:
        """Each source read and its header checked, in prompt order. A video's default total
        pixel budget is 90% of ``max_tokens`` (the request's prompt limit: the language worker's
        context) when the encoder sets none, so a long video is sampled smaller, not refused."""
        out: list[OpenedItem] = []
        num_images = num_videos = 0
        for source in sources:
            if isinstance(source, VideoInput):
                video = self.video_intake.open(source, num_videos)
                with naming(num_videos, "video"):
                    settings = VideoSettings.resolve(source.sampling, self.videos.defaults)
                    if not (source.sampling.total_pixels or self.config.video_total_pixels):
                        fit = int(max_tokens * 0.9) * self.preprocessor.factor**2
                        settings = replace(settings, total_pixels=min(settings.total_pixels, fit))
                    plan = self.videos.plan(video.header, settings)
                shape = MediaShape(plan.grid_thw, True, plan.timestamps)
                out.append(OpenedItem(video, num_videos, shape, plan.pixel_bytes, plan))
                num_videos += 1
                continue
            image = self.intake.open(source, num_images)
            height, width = self.preprocessor.target_size(image.width, image.height)
            patch = self.preprocessor.patch_size
            shape = MediaShape((1, height // patch, width // patch))
            cost = self.preprocessor.plan(image.width, image.height).pixel_bytes
            out.append(OpenedItem(image, num_images, shape, cost))
            num_images += 1
        return out

    def _decode(self, opened: list[OpenedItem], stop: StopCheck | None) -> list[MediaItem]:
        """Decode, key and (on a cache miss) cut into patches; one object per distinct item.
        An item whose bytes were seen before and whose rows are cached is not decoded."""
        by_key: dict[bytes, MediaItem] = {}
        out: list[MediaItem] = []
        for item in opened:
            if isinstance(item.opened, OpenedVideo):
                media = self._decode_video(item.opened, item.plan, item.index, stop)
            else:
                media = self._decode_image(item.opened, item.index, by_key)
            media = by_key.setdefault(media.key, media)  # the same item twice: one object
            out.append(media)
        return out

    def _decode_image(
        self, opened: OpenedImage, index: int, by_key: dict[bytes, MediaItem]
    ) -> PreparedImage:
        digest = None
        if self.source_keys is not None and opened.data is not None:
            digest = source_digest(b"image", opened.data)
            known = self.source_keys.get(digest)
            if known is not None:
                seen = by_key.get(known.key)
                if seen is not None:
                    return seen
                rows = self.cache.get(known.key) if known.key in self.cache else None
                if rows is not None:  # (an absent key's miss is counted below, once)
                    return self.preprocessor.cached(rows, known.key, known.width, known.height)
        img = self.intake.decode(opened, index)
        key = self.preprocessor.cache_key(img)
        if digest is not None:
            self.source_keys.put(digest, Decoded(key, img.width, img.height))
        seen = by_key.get(key)
        if seen is not None:
            return seen
        rows = self.cache.get(key) if self.cache is not None else None
        if rows is not None:
            return self.preprocessor.cached(rows, key, img.width, img.height)
        return self.preprocessor.prepare(img, key)

    def _decode_video(
        self, video: OpenedVideo, plan: VideoPlan, index: int, stop: StopCheck | None
    ) -> PreparedVideo:
        digest = None
        if self.source_keys is not None:
            digest = source_digest(b"video", video.data, VideoPreprocessor.plan_meta(plan))
            known = self.source_keys.get(digest)
            if known is not None:
                prepared = self.videos.cached(known.key, plan, self.cache)
                if prepared is not None:
                    return prepared
        start = time.perf_counter()
        with naming(index, "video"):
            prepared = self.videos.prepare(video.data, video.header, plan, self.cache, stop)
        seconds = time.perf_counter() - start
        if digest is not None:
            self.source_keys.put(digest, Decoded(prepared.key))
        with self._video_lock:
            self.num_video_frames += prepared.num_frames
            self.video_decode_s += seconds
        if self.on_video is not None:
            self.on_video(prepared.num_frames, seconds)
        return prepared

    def video_totals(self) -> tuple[int, float]:
        """(video frames decoded, seconds spent on videos) since the start."""
        with self._video_lock:
            return self.num_video_frames, self.video_decode_s

    def discard(self, prompt: Prompt) -> None:
        """A prepared prompt that will not be submitted: give its pixel budget back."""
        for image in prompt.images:
            self.budget.release_image(image)

    def make_task(
        self,
        prompt: Prompt,
        on_done: Callable[[EncodedPrompt | None, BaseException | None], None],
        deadline: float = float("inf"),
    ) -> EncodeTask:
        """The ViT task of ``prompt`` (not queued yet: ``batcher.submit`` queues it).
        ``on_done`` runs on the loop thread, unless the task is cancelled."""

        def finish(task: EncodeTask, error: BaseException | None) -> None:
            if error is not None:
                on_done(None, error)
                return
            on_done(self._encoded(prompt, task), None)

        return EncodeTask(prompt.images, finish, deadline)

    def submit(
        self,
        prompt: Prompt,
        on_done: Callable[[EncodedPrompt | None, BaseException | None], None],
        deadline: float = float("inf"),
    ) -> EncodeTask:
        """Queue ``prompt``'s images on the ViT loop; ``on_done`` runs on the loop thread."""
        task = self.make_task(prompt, on_done, deadline)
        self.batcher.submit(task)
        return task

    def encode(
        self,
        messages: Sequence,
        images: Sequence[ImageInput] = (),
        limits: RequestLimits | None = None,
        timeout_s: float | None = None,
    ) -> EncodedPrompt:
        """``prepare`` + ``submit`` and wait for the result."""
        prompt = self.prepare(messages, images, limits)
        done = threading.Event()
        result: list = [None, None]

        def on_done(encoded: EncodedPrompt | None, error: BaseException | None) -> None:
            result[0], result[1] = encoded, error
            done.set()

        self.submit(prompt, on_done)
        if not done.wait(timeout_s):
            raise TimeoutError("encoding did not finish in time")
        if result[1] is not None:
            raise result[1]
        return result[0]

    def _encoded(self, prompt: Prompt, task: EncodeTask) -> EncodedPrompt:
        return EncodedPrompt(
            fill_ids=prompt.fill_ids,
            positions=prompt.positions,
            image_rows=task.image_rows(self.checkpoint.row_width, self.rows_dtype),
            image_mask=prompt.image_mask,
            mrope_delta=prompt.mrope_delta,
            num_items=len(prompt.items),
            image_hashes=[item.key.hex() for item in prompt.items],
            image_token_counts=[item.num_tokens for item in prompt.items],
            num_cache_hits=task.num_cache_hits,
            encode_s=task.encode_s,
        )

    def close(self) -> None:
        self.batcher.close()


def video_defaults(config: EncoderConfig, factor: int) -> VideoSettings:
    """The encoder's video sampling defaults (and bounds), its 0s resolved for a checkpoint
    whose merged patch is ``factor`` pixels wide: per frame 128 to 768 merged patches, in all
    90% of the longest prompt's worth of pixels (qwen-vl-utils' rules; a request whose prompt
    limit is lower gets 90% of that, see ``_open``)."""
    return VideoSettings(
        fps=config.video_fps,
        min_frames=config.video_min_frames,
        max_frames=config.video_max_frames,
        min_pixels=config.video_min_pixels or 128 * factor**2,
        max_pixels=config.video_max_pixels or 768 * factor**2,
        total_pixels=config.video_total_pixels or int(config.prompt_token_limit * 0.9) * factor**2,
    )
