"""The encoder service's domain logic, behind the gRPC servicer.

``accept`` runs synchronously on the caller's thread: queue bound, intake, validation, resize,
tokenization and positions. A bad request raises ``InvalidInput`` and nothing is queued; a full
queue or pixel budget raises ``Overloaded``; a deadline passing while a video decodes stops the
decode at the next frame and raises ``DeadlineExpired``. Either way the room is failed at the
sender, so a language worker already waiting on it learns at once. While ``accept`` runs, the
room is *being accepted* in the ``RoomTable`` with the request's ``StopCheck``: a ``cancel``
then fails it at once (at the sender too), the decode stops at its next frame, and ``accept``
raises ``RequestCancelled`` having given its pixel budget back. An accepted room gets its
deadline (the request's ``timeout_s``, else ``default_timeout_s``), announced to the sender
(``expect``); its images go to the ViT loop (dropped unencoded if the deadline passes first);
when its rows are ready the shipper hands them to the sender. ``cancel`` ends a room in any
state; ``wait`` reports the outcome. The room's state lives in one place, the ``RoomTable``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from common.transfer.layout import BufferLayout, dtype_name, layout_for

from .config import EncoderConfig
from .errors import DeadlineExpired, InvalidInput, Overloaded, RequestCancelled, RoomInUse
from .pipeline import EncoderPipeline
from .rooms import RoomRecord, RoomTable
from .shipping import DiscardingSender, Sender, Shipper
from .stop import StopCheck
from .types import EncodedPrompt, EncodeRequest, RoomStatus

logger = logging.getLogger(__name__)

MAX_REASON_CHARS = 200  # of a cancel reason, which travels on to the receiver
OnEncoded = Callable[[EncodedPrompt | None, BaseException | None], None]


@dataclass(frozen=True)
class Accepted:
    room: int
    num_tokens: int
    num_images: int
    num_image_tokens: int
    image_hashes: list[str]


@dataclass(frozen=True)
class LoadReport:
    num_queued_requests: int  # accepted, not yet handed to the sender
    num_queued_images: int  # images waiting for the ViT
    num_waiting_for_blocks: int  # encoded, the sender short of blocks
    queued_pixel_bytes: int  # image patches held by queued requests
    num_forwards: int
    num_images_encoded: int
    cache: dict  # CacheStats fields (empty when the cache is off)
    sender: dict  # the sender's stats (free blocks, bytes sent, ...)
    sender_endpoint: str
    transfer_layout: BufferLayout  # the rows it sends (wire dtype)
    max_prompt_tokens: int  # longest prompt it accepts after image expansion
    num_video_frames: int = 0  # video frames decoded since the start
    video_decode_s: float = 0.0  # seconds spent probing, decoding and cutting videos


def create_sender(config: EncoderConfig, layout: BufferLayout) -> Sender:
    """The transfer plane's sender for ``layout`` (or the discarding one)."""
    if config.sender == "none":
        return DiscardingSender()
    from common.transfer.sender import EmbeddingSender

    return EmbeddingSender(config.transfer, layout)


class EncoderService:
    def __init__(
        self, model_path: str | Path, config: EncoderConfig, sender: Sender | None = None
    ) -> None:
        self.config = config
        self.pipeline = EncoderPipeline(model_path, config)
        checkpoint = self.pipeline.checkpoint
        # Rows travel in the deployment's wire dtype whatever the tower computes in.
        self.layout = layout_for(config.transfer, checkpoint.hidden_size, checkpoint.num_deepstack)
        self.max_prompt_tokens = config.prompt_token_limit
        self.rooms = RoomTable(config.result_ttl_s)
        self.sender = sender if sender is not None else create_sender(config, self.layout)
        tower = self.pipeline.tower
        logger.info(
            "encoder: device %s, compute dtype %s, wire dtype %s, max prompt %d tokens, "
            "linear kernel %s, CPU kernels %s",
            tower.device,
            dtype_name(tower.dtype),
            dtype_name(self.layout.dtype),
            self.max_prompt_tokens,
            tower.linear_kernel,
            tower.cpu_kernels,
        )
        self.shipper = Shipper(
            self.sender, self.rooms, config.submit_retry_s, on_transfer_failed=self.cancel
        )

    def accept(self, request: EncodeRequest) -> Accepted:
        """Validate and queue ``request``.

        Raises ``InvalidInput``, ``Overloaded``, ``RoomInUse``, ``DeadlineExpired`` (the
        request's deadline passed while its video decoded) or ``RequestCancelled`` (``cancel``
        named the room meanwhile).
        """
        room = request.room
        try:
            deadline = self._deadline(request.timeout_s)
        except InvalidInput as exc:
            self.refuse(room, str(exc))
            raise
        stop = StopCheck(deadline)
        try:
            self.rooms.begin(room, stop)
        except ValueError as exc:
            raise RoomInUse(str(exc)) from None
        try:
            return self._accept(request, stop)
        finally:
            self.rooms.end_accept(room)

    def _accept(self, request: EncodeRequest, stop: StopCheck) -> Accepted:
        """``accept`` once the room's id is taken (``rooms.begin``)."""
        room, deadline = request.room, stop.deadline
        try:
            if self.rooms.num_active() >= self.config.max_queued_requests:
                raise Overloaded(f"encoder queue full ({self.config.max_queued_requests} requests)")
            prompt = self.pipeline.prepare(request.messages, (), request.limits, stop)
        except RequestCancelled as exc:  # ``cancel`` already failed the room, here and there
            logger.info("room %d dropped: %s", room, exc)
            raise
        except DeadlineExpired as exc:  # it stopped the decode: no caller failed the room yet
            logger.info("room %d dropped: %s", room, exc)
            self._reject(room, str(exc))
            raise
        except (InvalidInput, Overloaded) as exc:
            self._reject(room, str(exc))
            raise
        task = self.pipeline.make_task(prompt, self._on_encoded(room), deadline)
        record = RoomRecord(
            room, request.request_id, prompt.num_tokens, len(prompt.items), deadline, task=task
        )
        if self.config.ship_per_image and len(prompt.images) > 1:
            record.prompt = prompt
            task.on_rows = self._on_rows
        try:
            added = self.rooms.add(record, self.config.max_queued_requests)
        except RequestCancelled as exc:  # cancelled after its decode, before it was queued
            self.pipeline.discard(prompt)
            logger.info("room %d dropped: %s", room, exc)
            raise
        except ValueError as exc:
            self.pipeline.discard(prompt)
            raise RoomInUse(str(exc)) from None
        if not added:
            self.pipeline.discard(prompt)
            self._reject(room, "encoder queue full")
            raise Overloaded(f"encoder queue full ({self.config.max_queued_requests} requests)")
        self._announce(room, deadline)
        try:
            self.pipeline.batcher.submit(task)
        except RuntimeError as exc:  # shutting down
            self.pipeline.discard(prompt)
            self.rooms.discard(room)
            self._reject(room, str(exc))
            raise Overloaded(str(exc)) from None
        return Accepted(
            room=room,
            num_tokens=prompt.num_tokens,
            num_images=len(prompt.items),
            num_image_tokens=int(prompt.image_mask.sum()),
            image_hashes=[item.key.hex() for item in prompt.items],
        )

    def refuse(self, room: int, reason: str) -> None:
        """A request for ``room`` was refused before ``accept``: fail the room at the sender
        (unless the id is in use here, which is not this request's room to fail)."""
        if not self.rooms.known(room):
            self._reject(room, reason)

    def cancel(self, room: int, reason: str) -> bool:
        """Drop ``room`` whatever its state: a video it is decoding in ``accept`` stopped at the
        next frame, queued patches freed unencoded, encoded rows dropped, the sender's room failed
        (its blocks freed, the receiver told). False when the room is unknown here; it is then
        remembered, so its late ``Encode`` is refused."""
        reason = f"cancelled: {(reason or 'by the caller')[:MAX_REASON_CHARS]}"
        found, task = self.rooms.cancel(room, reason)
        if task is not None:
            self.pipeline.batcher.cancel(task)
        self.sender.fail(room, reason)
        logger.info("room %d %s%s", room, reason, "" if found else " (unknown here)")
        return found

    def wait(self, room: int, until: RoomStatus, timeout_s: float) -> RoomRecord:
        """The room's record once it reached ``until`` (or failed), or at the timeout."""
        return self.rooms.wait(room, until, timeout_s)

    def load(self) -> LoadReport:
        cache = self.pipeline.cache
        batcher = self.pipeline.batcher
        num_video_frames, video_decode_s = self.pipeline.video_totals()
        return LoadReport(
            num_queued_requests=self.rooms.num_active(),
            num_queued_images=batcher.num_queued_images,
            num_waiting_for_blocks=self.shipper.num_waiting_for_blocks,
            queued_pixel_bytes=self.pipeline.budget.used_bytes,
            num_forwards=batcher.num_forwards,
            num_images_encoded=batcher.num_images_encoded,
            cache=dataclasses.asdict(cache.stats()) if cache is not None else {},
            sender=self.sender.stats(),
            sender_endpoint=self.sender.endpoint,
            transfer_layout=self.layout,
            max_prompt_tokens=self.max_prompt_tokens,
            num_video_frames=num_video_frames,
            video_decode_s=video_decode_s,
        )

    def close(self) -> None:
        self.pipeline.close()
        self.shipper.close()
        self.sender.close()

    def _on_encoded(self, room: int) -> OnEncoded:
        """The ViT loop's callback for ``room`` (runs on its thread: must not block)."""

        def on_done(encoded: EncodedPrompt | None, error: BaseException | None) -> None:
            if error is not None or encoded is None:
                kind = "deadline" if isinstance(error, DeadlineExpired) else "encoding failed"
                reason = f"{kind}: {error}"
                if self.rooms.fail(room, reason):
                    self.sender.fail(room, reason)
                return
            fields = {"num_cache_hits": encoded.num_cache_hits, "encode_s": encoded.encode_s}
            if self.rooms.advance(room, RoomStatus.ENCODED, encoded=encoded, **fields):
                self.shipper.wake()

        return on_done

    def _on_rows(self, task) -> None:
        """The ViT loop encoded some of a task's images (its thread: must not block)."""
        self.shipper.wake()

    def _announce(self, room: int, deadline: float) -> None:
        """Tell the sender the room's data comes (or the room fails) before ``deadline``, so a
        receiver waiting for it meanwhile does not time out (when the sender supports it)."""
        expect = getattr(self.sender, "expect", None)
        if expect is None:
            return
        try:
            expect(room, deadline)
        except Exception:  # advisory: the transfer plane's own timeouts still hold
            logger.exception("sender.expect failed for room %d", room)

    def _deadline(self, timeout_s: float) -> float:
        """The room's deadline (``time.monotonic``) from the request's time left."""
        if not math.isfinite(timeout_s) or timeout_s < 0:
            raise InvalidInput(f"timeout_s must be a finite number >= 0 (seconds), got {timeout_s}")
        return time.monotonic() + (timeout_s or self.config.default_timeout_s)

    def _reject(self, room: int, reason: str) -> None:
        try:
            self.sender.fail(room, reason)
        except Exception:  # the rejection itself must reach the caller
            logger.exception("could not fail room %d at the sender", room)
