"""``epd run``: the whole stack on 127.0.0.1 — G gateways, N encoders, M language workers.

Each service is a separate process (``epd serve ROLE``); every worker registers with every
gateway. Once all are healthy and registered, every gateway's public and registry address is
printed, a demo request with a generated image is streamed through the gateways (the client
takes them all and moves on from one that is unavailable) and the answer and timing breakdown
printed (a failed demo is one line, and the stack keeps serving), with a ``curl`` line for the
OpenAI-compatible HTTP API (``--http-port``, default 8000) and the status page's address; then
it keeps serving until Ctrl-C (``--once``: exit after the demo, with status 1 if it failed).
Every child is stopped on the way out, and dies with it if it is killed.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from common.procs import wait_first_exit
from services.local_stack import start_local_stack

DEMO_PROMPT = "Describe this image."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from common.models.tiny import ARCHS, DEFAULT_ARCH

    parser.add_argument("--model-path", type=Path, help="checkpoint (default: the demo model)")
    parser.add_argument(
        "--arch",
        choices=ARCHS,
        default=DEFAULT_ARCH,
        help="architecture of the generated demo model",
    )
    parser.add_argument("--gateways", type=int, default=1, help="gateway processes")
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--languages", type=int, default=1)
    parser.add_argument(
        "--gateway-port", type=int, default=50051, help="the first gateway's public port"
    )
    parser.add_argument(
        "--registry-port",
        type=int,
        default=0,
        help="the first gateway's worker registry port (0: a free one; other gateways: free)",
    )
    parser.add_argument(
        "--http-port",
        type=int,
        default=8000,
        help="the OpenAI-compatible HTTP API and the status page /dashboard (0: off)",
    )
    parser.add_argument(
        "--metrics", action="store_true", help="expose Prometheus metrics on free ports (printed)"
    )
    parser.add_argument("--once", action="store_true", help="exit after the demo request")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--log-dir", type=Path, help="service logs (default: a temp dir)")
    parser.add_argument("--startup-timeout", type=float, default=180.0)


def _say(msg: str) -> None:
    print(msg, flush=True)


def demo_image():
    """A deterministic picture with some structure: a gradient with shapes."""
    import numpy as np
    from PIL import Image, ImageDraw

    y, x = np.mgrid[0:448, 0:448]
    rgb = np.stack([x * 255 // 447, y * 255 // 447, (x + y) * 255 // 894], -1).astype(np.uint8)
    image = Image.fromarray(rgb)
    draw = ImageDraw.Draw(image)
    draw.ellipse((60, 60, 220, 220), fill=(220, 30, 30))
    draw.rectangle((250, 240, 400, 400), fill=(30, 30, 220))
    return image


def run_demo(gateway: str | list[str], max_tokens: int) -> bool:
    """Stream the demo request through ``gateway`` (one address or several); False (said in one
    line) when it failed."""
    import io

    import grpc

    from services.gateway.client import GatewayClient, format_timing

    buf = io.BytesIO()
    demo_image().save(buf, format="PNG")
    _say(f"\ndemo request: a 448x448 generated image + {DEMO_PROMPT!r}\n")
    with GatewayClient(gateway) as client:
        final = None
        sys.stdout.write("answer: ")
        try:
            for chunk in client.generate_stream(
                DEMO_PROMPT, [buf.getvalue()], max_tokens=max_tokens
            ):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                final = chunk
        except grpc.RpcError as exc:
            _say(f"\ndemo request failed: {exc.code().name}: {exc.details()}")
            return False
        _say("")
    if final is not None:
        _say(format_timing(final))
    return True


def http_hints(url: str, max_tokens: int) -> str:
    """What to try on the HTTP API: a curl line and the status page."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens}
    )
    return (
        f"or, OpenAI-style: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{body}'\nstatus page: {url}/dashboard"
    )


def _raise_interrupt(signum: int, frame: object) -> None:
    """The first SIGTERM or Ctrl-C ends the wait; later ones are ignored from here on, so that
    none lands while the first unwinds (inside a lock's wait it would leave the lock released
    twice: `timeout` signals the whole process group, and `make` passes it on as well)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    from common.models.tiny import ensure_tiny_model

    for name in ("gateways", "encoders", "languages"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.model_path is None:
        _say(f"preparing the demo checkpoint ({args.arch}) ...")
        args.model_path = ensure_tiny_model(args.arch, "demo")
    _say(f"model: {args.model_path}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="epd-run-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    _say(f"logs:  {log_dir}")
    stack = None
    # SIGTERM (a supervisor, `kill`) stops the stack like Ctrl-C does: the services run in
    # sessions of their own, so without this they would outlive us.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, _raise_interrupt)
    try:
        stack = start_local_stack(
            args.model_path,
            log_dir,
            args.encoders,
            args.languages,
            gateway_port=args.gateway_port,
            registry_port=args.registry_port,
            http_port=args.http_port or None,
            # a local, open stack: its operator may see the workers' addresses on /dashboard
            gateway_args=("--dashboard-show-addresses",) if args.http_port else (),
            metrics=args.metrics,
            startup_timeout_s=args.startup_timeout,
            on_progress=_say,
            num_gateways=args.gateways,
        )
        for name, port in stack.metrics_ports.items():
            _say(f"  metrics   {name:<12} http://127.0.0.1:{port}/metrics")
        if stack.http_url:
            _say(f"  http      {'gateway':<12} {stack.http_url} (OpenAI API, status page)")
        gateways = stack.gateway_addresses
        ok = run_demo(gateways, args.max_tokens)
        if args.once:
            return 0 if ok else 1
        _say(
            f"\nserving on {', '.join(gateways)}, worker registry on "
            f"{', '.join(stack.registry_addresses)} (Ctrl-C to stop); try: epd generate "
            f"--gateway {','.join(gateways)} --prompt 'Hello'"
        )
        if stack.http_url:
            _say(http_hints(stack.http_url, args.max_tokens))
        dead = wait_first_exit(stack.procs)
        _say(f"{dead.name} exited:\n{dead.tail()}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        if stack is not None:
            # a second Ctrl-C or SIGTERM (`timeout` signals the whole process group, a supervisor
            # may repeat itself) must not cut the stop short: it ends every service within its
            # own timeout, and the services die with this process whatever happens
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            stack.stop()
