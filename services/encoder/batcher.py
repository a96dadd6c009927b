"""The ViT loop: one background thread batches queued images up to a patch budget.

Each step walks the queued tasks in FIFO order and, for every image still without rows:
takes the rows from the cache (a hit skips the ViT), or joins an identical image already in
this step's batch, or adds it to the batch while the patch budget allows (the first image
always fits, so an image larger than the budget runs alone). One forward runs the batch
(``grid_thw`` lists its images); its output is split per image, cast once to ``rows_dtype``
(the wire dtype: what the cache keeps and the sender ships, so a hit needs no cast), cached,
and handed out.
A task whose images all have rows is finished with ``on_done(task, None)`` on this thread, so
``on_done`` must not block (shipping runs elsewhere).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .cache import EmbeddingCache
from .types import PreparedImage
from .vision import to_host

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class EncodeTask:
    """The images of one request, waiting for their rows."""

    images: list[PreparedImage]
    on_done: Callable[[EncodeTask, BaseException | None], None]
    rows: list[torch.Tensor | None] = field(default_factory=list)
    checked: list[bool] = field(default_factory=list)  # cache looked up once (counted)
    num_cache_hits: int = 0
    queued_at: float = field(default_factory=time.monotonic)
    encode_s: float = 0.0  # ViT seconds spent on this task's batches

    def __post_init__(self) -> None:
        self.rows = [None] * len(self.images)
        self.checked = [False] * len(self.images)

    @property
    def is_ready(self) -> bool:
        return all(r is not None for r in self.rows)

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
        fill_pixels: Callable[[PreparedImage], torch.Tensor],
        cache: EmbeddingCache | None,
        max_batch_patches: int,
        rows_dtype: torch.dtype,
    ) -> None:
        self._forward = forward
        self._rows_dtype = rows_dtype
        self._fill_pixels = fill_pixels
        self._cache = cache
        self._max_batch_patches = max_batch_patches
        self._tasks: list[EncodeTask] = []
        self._cond = threading.Condition()
        self._closed = False
        self.num_forwards = 0
        self.num_images_encoded = 0
        # Observer of each forward: (number of images, seconds). Set by the metrics.
        self.on_forward: Callable[[int, float], None] | None = None
        self._thread = threading.Thread(target=self._run, name="epd-vit", daemon=True)
        self._thread.start()

    def submit(self, task: EncodeTask) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the ViT loop is closed")
            self._tasks.append(task)
            self._cond.notify()

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
            self._step(tasks)
        for task in pending:
            task.on_done(task, RuntimeError("encoder shutting down"))

    def _step(self, tasks: list[EncodeTask]) -> None:
        batch: list[PreparedImage] = []
        waiters: dict[bytes, list[tuple[EncodeTask, int]]] = {}
        num_patches = 0
        for task in tasks:
            for i, image in enumerate(task.images):
                if task.rows[i] is not None:
                    continue
                if image.key in waiters:
                    waiters[image.key].append((task, i))
                    continue
                rows = self._lookup(task, i)
                if rows is not None:
                    task.rows[i] = rows
                    continue
                if batch and num_patches + image.num_patches > self._max_batch_patches:
                    continue
                batch.append(image)
                waiters[image.key] = [(task, i)]
                num_patches += image.num_patches
        error: BaseException | None = None
        if batch:
            error = self._encode(batch, waiters)
        self._finish(tasks, waiters if error else {}, error)

    def _lookup(self, task: EncodeTask, i: int) -> torch.Tensor | None:
        if self._cache is None:
            task.checked[i] = True
            return None
        key = task.images[i].key
        rows = self._cache.peek(key) if task.checked[i] else self._cache.get(key)
        if rows is not None and not task.checked[i]:
            task.num_cache_hits += 1
        task.checked[i] = True
        return rows

    def _encode(self, batch: list[PreparedImage], waiters) -> BaseException | None:
        start = time.perf_counter()
        try:
            pixels = torch.cat([self._fill_pixels(image) for image in batch])
            per_image = self._forward(pixels, [image.grid_thw for image in batch])
        except Exception as exc:  # a failed forward fails its tasks, not the loop
            logger.exception("ViT forward failed for %d images", len(batch))
            return exc
        elapsed = time.perf_counter() - start
        self.num_forwards += 1
        self.num_images_encoded += len(batch)
        if self.on_forward is not None:
            self.on_forward(len(batch), elapsed)
        seen_tasks: set[int] = set()
        for image, rows in zip(batch, per_image, strict=True):
            rows = to_host(rows, self._rows_dtype)
            if self._cache is not None:
                self._cache.put(image.key, rows)
            image.pixel_values = None  # free the patches
            for task, i in waiters[image.key]:
                task.rows[i] = rows
                if id(task) not in seen_tasks:
                    task.encode_s += elapsed
                    seen_tasks.add(id(task))
        return None

    def _finish(self, tasks: list[EncodeTask], failed_waiters, error) -> None:
        failed = {id(t) for entries in failed_waiters.values() for t, _ in entries}
        done = [t for t in tasks if id(t) in failed or t.is_ready]
        if not done:
            return
        with self._cond:
            done_ids = {id(t) for t in done}
            self._tasks = [t for t in self._tasks if id(t) not in done_ids]
        for task in done:
            try:
                task.on_done(task, error if id(task) in failed else None)
            except Exception:
                logger.exception("on_done callback failed")
