"""The ViT loop: one background thread batches queued images up to a patch budget.

Each step first drops the tasks whose deadline passed (never encoded), then walks the queued
tasks in FIFO order and, for every image still without rows: takes the rows from the cache (an
identical image encoded since the task was admitted), or joins an identical image already in
this step's batch, or adds it to the batch while the patch budget allows (the first image always
fits, so an image larger than the budget runs alone). With a time target (``max_batch_s``, the
CPU's) the budget is also no more patches than the last forwards' time per patch fits in it:
at Qwen2.5-VL-3B widths one 448² image already fills two cores for ~0.3 s, and a batch of six
made each of its requests wait for all six (TTFT p50 6.9 s; one image per forward: 1.9 s, at
c = 16) for no more images per second; a small tower still batches up to the patch budget. One
forward runs the batch (``grid_thw`` lists its images); its output is split per image, cast
once to ``rows_dtype`` (the wire dtype: what the cache keeps and the sender ships, so a hit
needs no cast), cached, and handed out.

Pixels: an image's patches are given back (``release``) as soon as it has rows, whichever way
they came; a finished, expired or cancelled task gives back all of its images.

A task whose images all have rows is finished with ``on_done(task, None)`` on this thread, so
``on_done`` must not block (shipping runs elsewhere); a failed forward or an expired deadline
finishes its tasks with the error. ``cancel`` removes a task (queued, or not submitted yet): it
is never finished. A task inside the running step is only marked; the loop drops it when the
step ends, so a forward never loses the pixels it is reading.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache import EmbeddingCache
from .errors import DeadlineExpired
from .types import PreparedImage
from .vision import to_host

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class EncodeTask:
    """The images of one request, waiting for their rows."""

    images: list[PreparedImage]
    on_done: Callable[[EncodeTask, BaseException | None], None]
    deadline: float = float("inf")  # time.monotonic(); past it the task is dropped unencoded
    rows: list[torch.Tensor | None] = field(default_factory=list)
    num_cache_hits: int = 0
    queued_at: float = field(default_factory=time.monotonic)
    encode_s: float = 0.0  # ViT seconds spent on this task's batches
    cancelled: bool = False
    # Called on the loop thread after a forward that gave the task rows but not all of them
    # (the encoder ships a request image by image); must not block.
    on_rows: Callable[[EncodeTask], None] | None = None

    def __post_init__(self) -> None:
        self.rows = [image.rows for image in self.images]
        self.num_cache_hits = sum(r is not None for r in self.rows)

    @property
    def is_ready(self) -> bool:
        return all(r is not None for r in self.rows)

    @property
    def has_first_rows(self) -> bool:
        """Whether the first image is encoded (some rows can go before the rest)."""
        return bool(self.rows) and self.rows[0] is not None

    def leading_rows(self) -> list[torch.Tensor]:
        """The rows of the images encoded so far from the first one on, in order."""
        out = []
        for rows in self.rows:
            if rows is None:
                break
            out.append(rows)
        return out

    def image_rows(self, row_width: int, dtype: torch.dtype) -> torch.Tensor:
        """All rows in token order."""
        if not self.rows:
            return torch.empty(0, row_width, dtype=dtype)
        return torch.cat(self.rows)  # type: ignore[arg-type]


class VisionBatcher:
    """Owns the ViT thread. ``forward(pixel_values, grids) -> per-image rows`` runs the tower."""

    def __init__(
        self,
        forward: Callable[[torch.Tensor, list[tuple[int, int, int]]], list[torch.Tensor]],
        cache: EmbeddingCache | None,
        max_batch_patches: int,
        rows_dtype: torch.dtype,
        release: Callable[[PreparedImage], None],
        max_batch_s: float = 0.0,
    ) -> None:
        self._forward = forward
        self._cache = cache
        self._max_batch_patches = max_batch_patches
        self._max_batch_s = max_batch_s  # 0: the patch budget alone
        self._s_per_patch = 0.0  # moving average over the last forwards; 0: none yet
        self._rows_dtype = rows_dtype
        self._release = release
        self._tasks: list[EncodeTask] = []
        self._in_step: set[int] = set()  # ids of the tasks the running step took
        self._cond = threading.Condition()
        self._closed = False
        self.num_forwards = 0
        self.num_images_encoded = 0
        self.num_expired = 0
        # Observer of each forward: (number of images, seconds). Set by the metrics.
        self.on_forward: Callable[[int, float], None] | None = None
        self._thread = threading.Thread(target=self._run, name="epd-vit", daemon=True)
        self._thread.start()

    def submit(self, task: EncodeTask) -> None:
        """Queue ``task`` (one already cancelled is dropped instead)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the ViT loop is closed")
            if not task.cancelled:
                self._tasks.append(task)
                self._cond.notify()
                return
        self._drop(task)

    def cancel(self, task: EncodeTask) -> None:
        """Take ``task`` off the loop unencoded, queued or not yet; it is never finished."""
        with self._cond:
            task.cancelled = True
            if task in self._tasks:
                self._tasks.remove(task)
            if id(task) in self._in_step:
                return  # the loop drops it (and its pixels) when the step ends
        self._drop(task)

    @property
    def num_queued_images(self) -> int:
        with self._cond:
            return sum(sum(r is None for r in t.rows) for t in self._tasks)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._tasks and not self._closed:
                    self._cond.wait()
                if self._closed:
                    pending, self._tasks = self._tasks, []
                    break
                tasks = list(self._tasks)
                self._in_step = {id(t) for t in tasks}
            try:
                self._step(tasks)
            finally:
                with self._cond:
                    self._in_step = set()
                for task in tasks:
                    if task.cancelled:
                        self._drop(task)
        for task in pending:
            self._end(task, RuntimeError("encoder shutting down"))

    def _step(self, tasks: list[EncodeTask]) -> None:
        now = time.monotonic()
        expired = [t for t in tasks if now > t.deadline]
        for task in expired:
            self.num_expired += 1
            waited = now - task.queued_at
            self._end(task, DeadlineExpired(f"passed after {waited:.1f}s in the ViT queue"))
        tasks = [t for t in tasks if now <= t.deadline]
        batch: list[PreparedImage] = []
        waiters: dict[bytes, list[tuple[EncodeTask, int]]] = {}
        num_patches, budget = 0, self._patch_budget()
        for task in tasks:
            for i, image in enumerate(task.images):
                if task.rows[i] is not None:
                    continue
                if image.key in waiters:
                    waiters[image.key].append((task, i))
                    continue
                rows = self._cache.peek(image.key) if self._cache is not None else None
                if rows is not None:  # encoded for another request since this one came in
                    self._give(task, i, rows)
                    task.num_cache_hits += 1
                    continue
                if batch and num_patches + image.num_patches > budget:
                    continue
                batch.append(image)
                waiters[image.key] = [(task, i)]
                num_patches += image.num_patches
        error: BaseException | None = None
        if batch:
            error = self._encode(batch, waiters)
        failed = {id(t) for entries in waiters.values() for t, _ in entries} if error else set()
        for task in tasks:
            if id(task) in failed:
                self._end(task, error)
            elif task.is_ready:
                self._end(task, None)
            elif task.on_rows is not None and task.has_first_rows:
                try:
                    task.on_rows(task)
                except Exception:
                    logger.exception("on_rows callback failed")

    def _patch_budget(self) -> int:
        """Patches the next forward may hold (its first image fits whatever its size): the
        patch budget, and with a time target no more than the recent time per patch fits in it."""
        if not self._max_batch_s or not self._s_per_patch:
            return self._max_batch_patches
        return min(self._max_batch_patches, int(self._max_batch_s / self._s_per_patch))

    def _encode(self, batch: list[PreparedImage], waiters) -> BaseException | None:
        start = time.perf_counter()
        try:
            pixels = torch.cat([image.patches() for image in batch])
            per_image = self._forward(pixels, [image.grid_thw for image in batch])
        except Exception as exc:  # a failed forward fails its tasks, not the loop
            logger.exception("ViT forward failed for %d images", len(batch))
            return exc
        elapsed = time.perf_counter() - start
        self.num_forwards += 1
        self.num_images_encoded += len(batch)
        pace = elapsed / max(1, sum(image.num_patches for image in batch))
        self._s_per_patch = pace if not self._s_per_patch else 0.7 * self._s_per_patch + 0.3 * pace
        if self.on_forward is not None:
            self.on_forward(len(batch), elapsed)
        seen_tasks: set[int] = set()
        for image, rows in zip(batch, per_image, strict=True):
            rows = to_host(rows, self._rows_dtype)
            if self._cache is not None:
                self._cache.put(image.key, rows)
            for task, i in waiters[image.key]:
                self._give(task, i, rows)
                if id(task) not in seen_tasks:
                    task.encode_s += elapsed
                    seen_tasks.add(id(task))
        return None

    def _give(self, task: EncodeTask, i: int, rows: torch.Tensor) -> None:
        task.rows[i] = rows
        self._release(task.images[i])  # the patches are no longer needed

    def _drop(self, task: EncodeTask) -> None:
        for image in task.images:
            self._release(image)

    def _end(self, task: EncodeTask, error: BaseException | None) -> None:
        """Finish ``task``: out of the queue, pixels given back, ``on_done`` unless cancelled."""
        with self._cond:
            if task in self._tasks:
                self._tasks.remove(task)
            cancelled = task.cancelled
        self._drop(task)
        if cancelled:
            return
        try:
            task.on_done(task, error)
        except Exception:
            logger.exception("on_done callback failed")
