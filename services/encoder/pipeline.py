"""The encoder without gRPC or shipping: messages + images -> ``EncodedPrompt``.

Two halves: ``prepare`` (synchronous: intake, validation, resize, tokenization, positions; raises
``InvalidInput``, or ``Overloaded`` when the pixel budget is full) and ``submit`` (asynchronous:
the ViT loop, cache). ``encode`` does both and waits. Thread-safe; ``prepare`` may run on many
threads at once. A prepared prompt holds a share of the pixel budget until the ViT consumed its
patches: submit it or ``discard`` it.

``prepare`` works in the order that keeps memory bounded: image count; source bytes and headers
(size, pixel and aspect limits, no pixels decoded); the prompt's length from the headers' token
counts and the tokenized text; the pixel budget; and only then decoding, the cache lookup and,
on a miss, resizing and the image processor.

Messages are ``ChatMessage`` objects or template-style dicts::

    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}

A dict image part takes its image from ``{"type": "image", "image": x}`` or, when it has none,
from the next entry of ``images`` (PIL images, encoded bytes or ``ImageSource``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from common.transfer.layout import parse_dtype

from .batcher import EncodeTask, VisionBatcher
from .budget import PixelBudget
from .cache import EmbeddingCache
from .checkpoint import load_checkpoint
from .config import EncoderConfig
from .errors import InvalidInput, Overloaded
from .intake import ImageInput, ImageIntake, OpenedImage
from .messages import normalize_messages
from .preprocess import ImagePreprocessor
from .prompt import PromptBuilder, template_messages
from .types import EncodedPrompt, PreparedImage, Prompt, RequestLimits
from .vision import VisionTower

MIB = 1 << 20


class EncoderPipeline:
    def __init__(self, model_path: str | Path, config: EncoderConfig | None = None) -> None:
        self.config = config or EncoderConfig()
        self.checkpoint = load_checkpoint(model_path)
        self.intake = ImageIntake(self.config)
        self.preprocessor = ImagePreprocessor(
            self.checkpoint, self.config.min_pixels, self.config.max_pixels
        )
        self.prompts = PromptBuilder(self.checkpoint)
        self.tower = VisionTower(
            self.checkpoint, self.config.device, self.config.dtype, self.config.linear_kernel
        )
        # Rows leave the ViT in the deployment's wire dtype, whatever the tower computes in.
        self.rows_dtype = parse_dtype(self.config.transfer.dtype)
        cache_bytes = self.config.cache_mb << 20
        self.cache = EmbeddingCache(cache_bytes) if cache_bytes else None
        self.budget = PixelBudget(self.config.max_queued_pixel_mb << 20)
        self.batcher = VisionBatcher(
            lambda pixels, grids: self.tower.split(self.tower.forward(pixels, grids), grids),
            self.cache,
            self.config.max_batch_patches,
            self.rows_dtype,
            self.budget.release_image,
        )
        # Observer of each prepared request: seconds of decoding + preprocessing. Metrics set it.
        self.on_prepare: Callable[[float], None] | None = None

    def prepare(
        self,
        messages: Sequence,
        images: Sequence[ImageInput] = (),
        limits: RequestLimits | None = None,
    ) -> Prompt:
        """Validate and tokenize a request; raises ``InvalidInput`` naming the problem."""
        start = time.perf_counter()
        prompt = self._prepare(messages, images, limits)
        if self.on_prepare is not None:
            self.on_prepare(time.perf_counter() - start)
        return prompt

    def _prepare(
        self, messages: Sequence, images: Sequence[ImageInput], limits: RequestLimits | None
    ) -> Prompt:
        """Every check the headers and the text allow comes before any pixel is decoded."""
        limits = limits or RequestLimits()
        chat, sources = normalize_messages(messages, images)
        max_images = min(x for x in (self.config.max_images, limits.max_images) if x > 0)
        if len(sources) > max_images:
            raise InvalidInput(f"request has {len(sources)} images; the limit is {max_images}")
        opened = [self.intake.open(source, index) for index, source in enumerate(sources)]
        plans = [self.preprocessor.plan(item.width, item.height) for item in opened]
        ids = self.prompts.text_ids(template_messages(chat))
        max_tokens = min(
            x for x in (self.config.prompt_token_limit, limits.max_prompt_tokens) if x > 0
        )
        self.prompts.check_length(ids, [plan.num_tokens for plan in plans], max_tokens)
        need = sum(plan.pixel_bytes for plan in plans)
        if not self.budget.try_reserve(need):
            raise Overloaded(
                f"encoder pixel budget full: the request's images need {need / MIB:.1f} MiB of "
                f"patches, {self.budget.used_bytes / MIB:.1f} of "
                f"{self.budget.capacity_bytes / MIB:.0f} MiB are queued"
            )
        try:
            prompt = self.prompts.build(ids, self._decode(opened))
        except BaseException:
            self.budget.release(need)
            raise
        # the reservation passes to the images that hold patches; hits and duplicates give back
        held = 0
        for image in {id(im): im for im in prompt.images}.values():
            if image.pixel_values is not None:
                image.held_bytes = image.pixel_values.numel() * image.pixel_values.element_size()
                held += image.held_bytes
        self.budget.release(need - held)
        return prompt

    def _decode(self, opened: list[OpenedImage]) -> list[PreparedImage]:
        """Decode, key and (on a cache miss) cut into patches; one object per distinct image."""
        by_key: dict[bytes, PreparedImage] = {}
        out = []
        for index, item in enumerate(opened):
            img = self.intake.decode(item, index)
            key = self.preprocessor.cache_key(img)
            image = by_key.get(key)
            if image is None:
                rows = self.cache.get(key) if self.cache is not None else None
                if rows is not None:
                    image = self.preprocessor.cached(rows, key, img)
                else:
                    image = self.preprocessor.prepare(img, key)
                by_key[key] = image
            out.append(image)
        return out

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
            num_items=len(prompt.images),
            image_hashes=[im.key.hex() for im in prompt.images],
            image_token_counts=[im.num_tokens for im in prompt.images],
            num_cache_hits=task.num_cache_hits,
            encode_s=task.encode_s,
        )

    def close(self) -> None:
        self.batcher.close()
