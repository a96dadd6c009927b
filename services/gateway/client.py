"""A client of the public API, and ``epd generate``.

``GatewayClient(addresses, api_key=None, tls_ca=None)`` keeps one long-lived channel per gateway
address (``"a:p,b:p"`` or a list). A request that fails with ``UNAVAILABLE`` before its gateway
returned anything (the gateway is down, draining, or has no worker) is sent again to the next
address, within the same deadline; once a chunk was returned the error surfaces, because tokens
already handed to the caller cannot be taken back. The address that last answered is tried
first next time. With an API key every call carries ``authorization: Bearer KEY``; with a CA
file the channels use TLS. Both are optional: plaintext without a key by default.

``epd generate --gateway ADDR[,ADDR...] [--video PATH ...] [--image PATH ...] --prompt TEXT
[--max-tokens N] [--temperature T] [--n N] [--json] [--api-key KEY] [--tls-ca FILE]``: videos,
then images, are placed before the text in one user message, which the checkpoint's own chat
template renders with the generation prompt. The API key may also come from ``EPD_API_KEY``.
One choice is streamed to stdout as it comes; with ``--n`` above 1 each choice is printed once
every one finished, as ``[index] text``, in index order. With ``--json`` one JSON object is
printed (choice 0's text, token_ids and finish_reason, the request's usage and timing, and
``choices``: every choice's index, text, token_ids, finish_reason and usage).
Every failure is one line on stderr and a non-zero exit: a bad argument or unreadable file (2),
a gRPC error as ``CODE: details`` (1).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from common.channels import DEFAULT_KEEPALIVE, Keepalive
from common.sampling_bounds import MAX_N
from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.errors import REQUEST_ABORTED

MAX_MESSAGE_BYTES = 64 << 20
MAX_UINT32 = (1 << 32) - 1
API_KEY_ENV = "EPD_API_KEY"
USAGE_FIELDS = ("prompt_tokens", "cached_tokens", "completion_tokens")
TIMING_FIELDS = (
    "queue_s",
    "encode_s",
    "transfer_s",
    "prefill_s",
    "first_token_s",
    "total_s",
    "num_transfers",
    "encoder_cache_hits",
)


def build_request(
    prompt: str,
    images: list[bytes] = (),  # type: ignore[assignment]
    max_tokens: int = 0,
    temperature: float = 0.0,
    request_id: str = "",
    videos: list[bytes] = (),  # type: ignore[assignment]
    **sampling: object,
) -> gateway_pb2.GenerateRequest:
    parts = [
        common_pb2.ContentPart(video=common_pb2.VideoPart(source=common_pb2.ImageSource(data=b)))
        for b in videos
    ]
    parts += [common_pb2.ContentPart(image=common_pb2.ImageSource(data=b)) for b in images]
    parts.append(common_pb2.ContentPart(text=prompt))
    return gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=parts)],
        sampling=common_pb2.SamplingParams(
            max_new_tokens=max_tokens, temperature=temperature, **sampling
        ),
        request_id=request_id,
    )


def parse_addresses(addresses: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or ``["a:1", "b:2"]`` -> checked ``host:port`` strings, in order."""
    items = [addresses] if isinstance(addresses, str) else list(addresses)
    out = [a.strip() for item in items for a in item.split(",") if a.strip()]
    if not out:
        raise ValueError("no gateway address given (host:port)")
    for address in out:
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"gateway address {address!r} is not host:port")
    return out


def _retryable(exc: grpc.RpcError) -> bool:
    """The gateway did not take the request: UNAVAILABLE (down, draining, GOAWAY), or a
    CANCELLED that is not the gateway's own (a call caught in its server's shutdown)."""
    if not isinstance(exc, grpc.Call):
        return False
    code = exc.code()
    if code == grpc.StatusCode.CANCELLED:
        return exc.details() != REQUEST_ABORTED
    return code == grpc.StatusCode.UNAVAILABLE


class GatewayClient:
    """Channels to one or more gateways; a context manager."""

    def __init__(
        self,
        addresses: str | Sequence[str],
        api_key: str | None = None,
        tls_ca: str | Path | bytes | None = None,
        tls_server_name: str = "",
        keepalive: Keepalive = DEFAULT_KEEPALIVE,
    ) -> None:
        """``keepalive``: how the channels ping their gateway; a gateway cut off ends the calls
        to it ``UNAVAILABLE`` within ``keepalive.timeout_s`` while they carry data, or
        ``time_s + timeout_s``, and the next request goes to the next gateway."""
        self.addresses = parse_addresses(addresses)
        credentials = None
        if tls_ca is not None:
            roots = tls_ca if isinstance(tls_ca, bytes) else Path(tls_ca).read_bytes()
            credentials = grpc.ssl_channel_credentials(root_certificates=roots)
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            *keepalive.channel_options(),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        self.channels = [
            grpc.secure_channel(a, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(a, options=options)
            for a in self.addresses
        ]
        self.stubs = [gateway_pb2_grpc.GatewayStub(c) for c in self.channels]
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None
        self._lock = threading.Lock()
        self._preferred = 0
        self._serving: dict[str, int] = {}  # request id -> gateway index, while in flight

    @property
    def stub(self) -> gateway_pb2_grpc.GatewayStub:
        """The first gateway's stub (direct calls; no retry, no key)."""
        return self.stubs[0]

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for channel in self.channels:
            channel.close()

    # ---- attempts across gateways ----------------------------------------------------------
    def attempt_order(self) -> list[int]:
        """Gateway indices to try, the one that answered last first."""
        with self._lock:
            first = self._preferred
        n = len(self.addresses)
        return [(first + i) % n for i in range(n)]

    def _answered(self, index: int) -> None:
        with self._lock:
            self._preferred = index

    def _track(self, request_id: str, index: int | None) -> None:
        if not request_id:
            return
        with self._lock:
            if index is None:
                self._serving.pop(request_id, None)
            else:
                self._serving[request_id] = index

    # ---- the API -----------------------------------------------------------------------------
    def generate_stream(
        self, prompt: str, images: list[bytes] = (), timeout: float | None = None, **kw: object
    ) -> RetryingStream:
        return self.stream_request(build_request(prompt, list(images), **kw), timeout)

    def stream_request(
        self, request: gateway_pb2.GenerateRequest, timeout: float | None = None
    ) -> RetryingStream:
        """``Generate`` with retries on the next gateway until the first chunk arrived."""
        return RetryingStream(self, request, timeout)

    def generate(
        self, prompt: str, images: list[bytes] = (), timeout: float | None = None, **kw: object
    ) -> gateway_pb2.GenerateResponse:
        return self.unary_request(build_request(prompt, list(images), **kw), timeout)

    def unary_request(
        self, request: gateway_pb2.GenerateRequest, timeout: float | None = None
    ) -> gateway_pb2.GenerateResponse:
        """``GenerateUnary``, sent to the next gateway while they answer UNAVAILABLE."""
        deadline = None if timeout is None else time.monotonic() + timeout
        order = self.attempt_order()
        for n, index in enumerate(order):
            self._track(request.request_id, index)
            try:
                reply = self.stubs[index].GenerateUnary(
                    request, timeout=_left(deadline), metadata=self.metadata
                )
            except grpc.RpcError as exc:
                expired = deadline is not None and time.monotonic() >= deadline
                if n == len(order) - 1 or expired or not _retryable(exc):
                    raise
                continue
            finally:
                self._track(request.request_id, None)
            self._answered(index)
            return reply
        raise AssertionError("unreachable: the last attempt returns or raises")

    def abort(self, request_id: str, timeout: float = 5.0) -> bool:
        """Abort ``request_id`` on the gateway serving it (every gateway if not known here)."""
        with self._lock:
            hint = self._serving.get(request_id)
        order = self.attempt_order()
        if hint is not None:
            order = [hint] + [i for i in order if i != hint]
        error: grpc.RpcError | None = None
        for index in order:
            try:
                reply = self.stubs[index].Abort(
                    gateway_pb2.AbortRequest(request_id=request_id),
                    timeout=timeout,
                    metadata=self.metadata,
                )
                return reply.aborted
            except grpc.RpcError as exc:
                if not isinstance(exc, grpc.Call) or exc.code() not in (
                    grpc.StatusCode.NOT_FOUND,
                    grpc.StatusCode.UNAVAILABLE,
                ):
                    raise
                if error is None or exc.code() == grpc.StatusCode.NOT_FOUND:
                    error = exc  # NOT_FOUND says more than a gateway that is down
        assert error is not None
        raise error


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


class RetryingStream:
    """A ``Generate`` call that moves to the next gateway on UNAVAILABLE until the first chunk.

    Iterate it for the chunks; ``cancel()`` (from any thread) ends it with CANCELLED. Errors are
    the gRPC ones (``grpc.RpcError`` with ``code()`` and ``details()``).
    """

    def __init__(
        self, client: GatewayClient, request: gateway_pb2.GenerateRequest, timeout: float | None
    ) -> None:
        self._client = client
        self._request = request
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._order = client.attempt_order()
        self._attempt = -1
        self._lock = threading.Lock()
        self._cancelled = False
        self._started = False  # a chunk was returned: no more retries
        self._call = None
        self._start_next()

    def _start_next(self) -> None:
        self._attempt += 1
        index = self._order[self._attempt]
        self._client._track(self._request.request_id, index)
        call = self._client.stubs[index].Generate(
            self._request, timeout=_left(self._deadline), metadata=self._client.metadata
        )
        with self._lock:
            self._call = call
            cancelled = self._cancelled
        if cancelled:
            call.cancel()

    @property
    def tried(self) -> list[str]:
        """The gateways this stream was sent to, in order; the last one is serving it."""
        return [self._client.addresses[i] for i in self._order[: self._attempt + 1]]

    def __iter__(self) -> Iterator[gateway_pb2.GenerateChunk]:
        return self

    def __next__(self) -> gateway_pb2.GenerateChunk:
        while True:
            try:
                chunk = next(self._call)
            except StopIteration:
                self._client._track(self._request.request_id, None)
                raise
            except grpc.RpcError as exc:
                if not self._may_retry(exc):
                    self._client._track(self._request.request_id, None)
                    raise
                self._start_next()
                continue
            if not self._started:
                self._started = True
                self._client._answered(self._order[self._attempt])
            return chunk

    def _may_retry(self, exc: grpc.RpcError) -> bool:
        with self._lock:
            cancelled = self._cancelled
        return (
            not self._started
            and not cancelled
            and _retryable(exc)
            and self._attempt + 1 < len(self._order)
            and (self._deadline is None or self._deadline > time.monotonic())
        )

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()


# ---- results ---------------------------------------------------------------------------------


def result_dict(reply: gateway_pb2.GenerateResponse | gateway_pb2.GenerateChunk) -> dict:
    """A reply (or a final chunk) as plain data; a unary reply adds ``choices``, every one."""
    out = {
        "text": reply.text,
        "token_ids": list(reply.token_ids),
        "finish_reason": _finish_name(reply.finish_reason),
        "usage": _usage(reply.usage),
        "timing": {name: getattr(reply.timing, name) for name in TIMING_FIELDS},
    }
    if isinstance(reply, gateway_pb2.GenerateResponse):
        out["choices"] = [
            {
                "index": choice.index,
                "text": choice.text,
                "token_ids": list(choice.token_ids),
                "finish_reason": _finish_name(choice.finish_reason),
                "usage": _usage(choice.usage),
            }
            for choice in reply.choices
        ]
    return out


def _finish_name(reason: int) -> str:
    return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def _usage(usage: gateway_pb2.Usage) -> dict[str, int]:
    return {name: getattr(usage, name) for name in USAGE_FIELDS}


def format_timing(
    reply: gateway_pb2.GenerateResponse | gateway_pb2.GenerateChunk,
    finals: Sequence[gateway_pb2.GenerateChunk] = (),
) -> str:
    """The finish reason, token counts and timing of ``reply``; with ``finals`` (the final
    chunk of every choice, ``reply`` the last to finish) each choice's finish reason and
    completion tokens, in index order, and their sum."""
    d = result_dict(reply)
    t, u = d["timing"], d["usage"]
    finish, completion = d["finish_reason"], str(u["completion_tokens"])
    if len(finals) > 1:
        ordered = sorted(finals, key=lambda chunk: chunk.index)
        finish = ", ".join(_finish_name(c.finish_reason) for c in ordered)
        counts = [c.usage.completion_tokens for c in ordered]
        completion = f"{sum(counts)} ({' + '.join(map(str, counts))})"
    ms = {k: f"{v * 1000:.1f} ms" for k, v in t.items() if k.endswith("_s")}
    return (
        f"finish: {finish}   tokens: prompt {u['prompt_tokens']}"
        f" (cached {u['cached_tokens']}), completion {completion}\n"
        f"timing: queue {ms['queue_s']} | encode {ms['encode_s']} | transfer "
        f"{ms['transfer_s']} ({t['num_transfers']} transfers) | prefill {ms['prefill_s']} | "
        f"first token {ms['first_token_s']} | total {ms['total_s']}"
    )


# ---- epd generate ----------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--gateway",
        default="127.0.0.1:50051",
        help="gateway host:port; several, comma-separated, are tried in turn while unavailable",
    )
    parser.add_argument("--image", type=Path, action="append", default=[], help="image file")
    parser.add_argument(
        "--video", type=Path, action="append", default=[], help="video file (MP4, WebM, ...)"
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64, help="0 = the gateway's default")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling; 0 = off")
    parser.add_argument("--top-k", type=int, default=0, help="top-k sampling; 0 = off")
    parser.add_argument("--seed", type=int, default=None, help="seed of reproducible sampling")
    parser.add_argument(
        "--n", type=int, default=1, help=f"choices to generate, 1 to {MAX_N} (choice i: seed + i)"
    )
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--api-key", default=None, help=f"API key sent as a bearer token [env {API_KEY_ENV}]"
    )
    parser.add_argument("--tls-ca", type=Path, default=None, help="CA file: connect with TLS")
    parser.add_argument(
        "--tls-server-name", default="", help="name the gateway's certificate is checked for"
    )


def check_arguments(args: argparse.Namespace) -> dict[str, object]:
    """The sampling keywords of ``args``; ValueError naming the first bad one."""
    if not 0 <= args.max_tokens <= MAX_UINT32:
        raise ValueError(f"--max-tokens must be in [0, {MAX_UINT32}], got {args.max_tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if not (math.isfinite(args.top_p) and 0 <= args.top_p <= 1):
        raise ValueError(f"--top-p must be in [0, 1], got {args.top_p}")
    if not -1 <= args.top_k < 1 << 31:
        raise ValueError(f"--top-k must be in [-1, 2**31), got {args.top_k}")
    if args.seed is not None and not 0 <= args.seed < 1 << 64:
        raise ValueError(f"--seed must be in [0, 2**64), got {args.seed}")
    if not 1 <= args.n <= MAX_N:
        raise ValueError(f"--n must be in [1, {MAX_N}], got {args.n}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    sampling: dict[str, object] = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "n": args.n,
    }
    if args.seed is not None:
        sampling["seed"] = args.seed
    return sampling


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    sampling = check_arguments(args)
    addresses = parse_addresses(args.gateway)
    images = [_read(p, "image") for p in args.image]
    if args.video:
        sampling["videos"] = [_read(p, "video") for p in args.video]
    tls_ca = _read(args.tls_ca, "CA file") if args.tls_ca is not None else None
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    with GatewayClient(addresses, api_key, tls_ca, args.tls_server_name) as client:
        try:
            if args.json:
                reply = client.generate(args.prompt, images, timeout=args.timeout, **sampling)
                print(json.dumps(result_dict(reply)))
                return 0
            stream = client.generate_stream(args.prompt, images, timeout=args.timeout, **sampling)
            finals = _print_stream(stream, args.n)
            if finals:
                print(format_timing(finals[-1], finals), file=sys.stderr)
            return 0
        except grpc.RpcError as exc:
            print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("cancelled", file=sys.stderr)
            return 130


def _print_stream(
    stream: Iterator[gateway_pb2.GenerateChunk], n: int
) -> list[gateway_pb2.GenerateChunk]:
    """Print the answer: one choice as its text streams; several, each once all finished, as
    ``[index] text`` in index order. The final chunk of each choice, in finishing order."""
    texts: dict[int, list[str]] = {i: [] for i in range(n)}
    finals = []
    for chunk in stream:
        if n == 1:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
        else:
            texts.setdefault(chunk.index, []).append(chunk.text)
        if chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            finals.append(chunk)
    if n == 1:
        print()
        return finals
    for index in sorted(texts):
        print(f"[{index}] {''.join(texts[index])}")
    return finals
