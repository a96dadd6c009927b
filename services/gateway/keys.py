"""Routing keys from a request, computed without decoding any image.

An image is identified by a hash of its source as sent (bytes, base64 text, path or URL): cheap,
and stable for the repeated images affinity is for. The prompt's parts (role markers, text,
images) are hashed cumulatively so that a shared leading part gives a shared prefix hash.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.routing import RoutingKey


def image_source_hash(image: common_pb2.ImageSource) -> bytes:
    which = image.WhichOneof("source")
    if which is None:
        raise ValueError("image has no source (set data, base64, path or url)")
    value = getattr(image, which)
    raw = value if isinstance(value, bytes) else value.encode()
    return xxhash.xxh3_128_digest(raw, seed=len(which))


def video_hash(video: common_pb2.VideoPart) -> bytes:
    """A video's source hash and its sampling settings: the same clip sampled differently is
    another video (other rows, another prompt)."""
    s = video.sampling
    settings = f"{s.fps!r}:{s.min_frames}:{s.max_frames}:{s.min_pixels}:{s.max_pixels}:"
    settings += str(s.total_pixels)
    return xxhash.xxh3_128_digest(image_source_hash(video.source) + settings.encode())


def routing_key(messages: Iterable[common_pb2.ChatMessage]) -> RoutingKey:
    """The request's media hashes (one per image or video, in order: the encoder's affinity and
    the reason it needs one) and its cumulative prefix hashes."""
    images: list[bytes] = []
    prefix: list[int] = []
    state = xxhash.xxh3_64()
    for message in messages:
        state.update(b"\x00role:" + message.role.encode())
        for part in message.content:
            which = part.WhichOneof("part")
            if which == "image":
                digest = image_source_hash(part.image)
                images.append(digest)
                state.update(b"\x00img:" + digest)
            elif which == "video":
                digest = video_hash(part.video)
                images.append(digest)
                state.update(b"\x00vid:" + digest)
            elif which == "text":
                state.update(b"\x00txt:" + part.text.encode())
            else:
                continue
            prefix.append(state.intdigest())
    return RoutingKey(image_hashes=tuple(images), prefix_hashes=tuple(prefix))


def request_routing_key(request: gateway_pb2.GenerateRequest) -> RoutingKey:
    """The routing key of a chat (``routing_key``) or of a raw prompt (one hash of its text or
    token ids: requests with the same prompt go to the same worker's cache)."""
    if request.prompt_text:
        digest = xxhash.xxh3_64_intdigest(b"\x00prompt:" + request.prompt_text.encode())
    elif request.prompt_token_ids:
        raw = b"".join(i.to_bytes(4, "little") for i in request.prompt_token_ids)
        digest = xxhash.xxh3_64_intdigest(b"\x00ids:" + raw)
    else:
        return routing_key(request.messages)
    return RoutingKey(image_hashes=(), prefix_hashes=(digest,))
