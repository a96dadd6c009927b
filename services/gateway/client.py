"""A client of the public API, and ``epd generate``.

``epd generate --gateway ADDR [--image PATH ...] --prompt TEXT [--max-tokens N]
[--temperature T] [--json]``: images are placed before the text in one user message, which the
checkpoint's own chat template renders with the generation prompt. With ``--json`` one JSON
object is printed (text, token_ids, finish_reason, usage, timing); on error the exit status is
non-zero and the gRPC status name and message go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc

from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

MAX_MESSAGE_BYTES = 64 << 20


def build_request(
    prompt: str,
    images: list[bytes] = (),  # type: ignore[assignment]
    max_tokens: int = 0,
    temperature: float = 0.0,
    request_id: str = "",
    **sampling: object,
) -> gateway_pb2.GenerateRequest:
    parts = [common_pb2.ContentPart(image=common_pb2.ImageSource(data=b)) for b in images]
    parts.append(common_pb2.ContentPart(text=prompt))
    return gateway_pb2.GenerateRequest(
        messages=[common_pb2.ChatMessage(role="user", content=parts)],
        sampling=common_pb2.SamplingParams(
            max_new_tokens=max_tokens, temperature=temperature, **sampling
        ),
        request_id=request_id,
    )


class GatewayClient:
    """One channel to a gateway; a context manager."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self.stub = gateway_pb2_grpc.GatewayStub(self.channel)

    def __enter__(self) -> GatewayClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.channel.close()

    def generate_stream(
        self, prompt: str, images: list[bytes] = (), timeout: float | None = None, **kw: object
    ) -> Iterator[gateway_pb2.GenerateChunk]:
        return self.stub.Generate(build_request(prompt, list(images), **kw), timeout=timeout)

    def generate(
        self, prompt: str, images: list[bytes] = (), timeout: float | None = None, **kw: object
    ) -> gateway_pb2.GenerateResponse:
        return self.stub.GenerateUnary(build_request(prompt, list(images), **kw), timeout=timeout)

    def abort(self, request_id: str) -> bool:
        reply = self.stub.Abort(gateway_pb2.AbortRequest(request_id=request_id), timeout=5)
        return reply.aborted


def result_dict(reply: gateway_pb2.GenerateResponse | gateway_pb2.GenerateChunk) -> dict:
    t = reply.timing
    return {
        "text": reply.text,
        "token_ids": list(reply.token_ids),
        "finish_reason": common_pb2.FinishReason.Name(reply.finish_reason)
        .removeprefix("FINISH_REASON_")
        .lower(),
        "usage": {
            "prompt_tokens": reply.usage.prompt_tokens,
            "cached_tokens": reply.usage.cached_tokens,
            "completion_tokens": reply.usage.completion_tokens,
        },
        "timing": {
            "queue_s": t.queue_s,
            "encode_s": t.encode_s,
            "transfer_s": t.transfer_s,
            "prefill_s": t.prefill_s,
            "first_token_s": t.first_token_s,
            "total_s": t.total_s,
            "num_transfers": t.num_transfers,
            "encoder_cache_hits": t.encoder_cache_hits,
        },
    }


def format_timing(reply: gateway_pb2.GenerateResponse | gateway_pb2.GenerateChunk) -> str:
    d = result_dict(reply)
    t, u = d["timing"], d["usage"]
    ms = {k: f"{v * 1000:.1f} ms" for k, v in t.items() if k.endswith("_s")}
    return (
        f"finish: {d['finish_reason']}   tokens: prompt {u['prompt_tokens']}"
        f" (cached {u['cached_tokens']}), completion {u['completion_tokens']}\n"
        f"timing: queue {ms['queue_s']} | encode {ms['encode_s']} | transfer "
        f"{ms['transfer_s']} ({t['num_transfers']} transfers) | prefill {ms['prefill_s']} | "
        f"first token {ms['first_token_s']} | total {ms['total_s']}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gateway", default="127.0.0.1:50051", help="gateway host:port")
    parser.add_argument("--image", type=Path, action="append", default=[], help="image file")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=120.0, help="deadline in seconds")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    try:
        images = [p.read_bytes() for p in args.image]
    except OSError as exc:
        print(f"cannot read image: {exc}", file=sys.stderr)
        return 2
    with GatewayClient(args.gateway) as client:
        try:
            if args.json:
                reply = client.generate(
                    args.prompt,
                    images,
                    timeout=args.timeout,
                    max_tokens=args.max_tokens,
                    temperature=args.temperature,
                )
                print(json.dumps(result_dict(reply)))
                return 0
            final = None
            for chunk in client.generate_stream(
                args.prompt,
                images,
                timeout=args.timeout,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
            ):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                final = chunk
            print()
            if final is not None:
                print(format_timing(final), file=sys.stderr)
            return 0
        except grpc.RpcError as exc:
            print(f"{exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
