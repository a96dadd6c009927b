"""Proto messages <-> domain objects (no logic beyond field mapping)."""

from __future__ import annotations

import json

from common.transfer.layout import BufferLayout, dtype_name
from protos.epd.v1 import common_pb2, encoder_pb2

from .errors import InvalidInput
from .rooms import RoomRecord
from .service import Accepted, LoadReport
from .types import (
    ChatMessage,
    ContentPart,
    EncodeRequest,
    ImageSource,
    RequestLimits,
    VideoInput,
    VideoSampling,
)


def request_from_proto(msg: encoder_pb2.EncodeRequest) -> EncodeRequest:
    limits = RequestLimits()
    if msg.HasField("limits"):
        limits = RequestLimits(msg.limits.max_images, msg.limits.max_prompt_tokens)
    return EncodeRequest(
        room=msg.room,
        request_id=msg.request_id,
        messages=tuple(_message(m) for m in msg.messages),
        limits=limits,
        timeout_s=msg.timeout_s,
    )


def _message(msg: common_pb2.ChatMessage) -> ChatMessage:
    parts = []
    for part in msg.content:
        which = part.WhichOneof("part")
        if which == "text":
            parts.append(ContentPart(text=part.text))
        elif which == "image":
            kind = part.image.WhichOneof("source")
            if kind is None:
                raise InvalidInput("image part without a source")
            parts.append(ContentPart(image=ImageSource(kind, getattr(part.image, kind))))
        elif which == "video":
            parts.append(ContentPart(video=_video(part.video)))
        else:
            raise InvalidInput("empty content part")
    return ChatMessage(msg.role, tuple(parts))


def _video(msg: common_pb2.VideoPart) -> VideoInput:
    kind = msg.source.WhichOneof("source")
    if kind is None:
        raise InvalidInput("video part without a source")
    s = msg.sampling
    try:
        sampling = VideoSampling(
            s.fps, s.min_frames, s.max_frames, s.min_pixels, s.max_pixels, s.total_pixels
        )
    except ValueError as exc:
        raise InvalidInput(f"video sampling: {exc}") from None
    return VideoInput(ImageSource(kind, getattr(msg.source, kind)), sampling)


def reply_to_proto(accepted: Accepted, sender_endpoint: str) -> encoder_pb2.EncodeReply:
    return encoder_pb2.EncodeReply(
        room=accepted.room,
        num_tokens=accepted.num_tokens,
        num_images=accepted.num_images,
        num_image_tokens=accepted.num_image_tokens,
        image_hashes=accepted.image_hashes,
        sender_endpoint=sender_endpoint,
    )


def outcome_to_proto(record: RoomRecord) -> encoder_pb2.EncodeOutcome:
    return encoder_pb2.EncodeOutcome(
        room=record.room,
        status=int(record.status),
        error=record.error,
        num_tokens=record.num_tokens,
        num_images=record.num_images,
        num_cache_hits=record.num_cache_hits,
        encode_s=record.encode_s,
    )


def load_to_proto(load: LoadReport) -> encoder_pb2.LoadReport:
    return encoder_pb2.LoadReport(
        num_queued_requests=load.num_queued_requests,
        num_queued_images=load.num_queued_images,
        num_waiting_for_blocks=load.num_waiting_for_blocks,
        queued_pixel_bytes=load.queued_pixel_bytes,
        num_forwards=load.num_forwards,
        num_images_encoded=load.num_images_encoded,
        cache=encoder_pb2.CacheStats(**load.cache) if load.cache else None,
        free_blocks=int(load.sender.get("num_free_blocks", -1)),
        sender_endpoint=load.sender_endpoint,
        sender_stats_json=json.dumps(load.sender, default=str),
        transfer_layout=layout_to_proto(load.transfer_layout),
        max_prompt_tokens=load.max_prompt_tokens,
        num_video_frames=load.num_video_frames,
        video_decode_s=load.video_decode_s,
    )


def layout_to_proto(layout: BufferLayout) -> common_pb2.TransferLayout:
    return common_pb2.TransferLayout(
        hidden_size=layout.hidden_size,
        num_deepstack=layout.num_deepstack,
        dtype=dtype_name(layout.dtype),
        block_size=layout.block_size,
    )
