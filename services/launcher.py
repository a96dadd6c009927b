"""``epd run``: the whole stack on 127.0.0.1 — a gateway, N encoders, M language workers.

Each service is a separate process (``epd serve ROLE``) registering with the gateway. Once all
are healthy and registered, a demo request with a generated image is streamed through the
gateway and the answer and timing breakdown printed; then it keeps serving until Ctrl-C
(``--once``: exit after the demo). Every child is stopped on the way out.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from common.procs import ServiceProcess, free_port

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
    parser.add_argument("--encoders", type=int, default=1)
    parser.add_argument("--languages", type=int, default=1)
    parser.add_argument("--gateway-port", type=int, default=50051)
    parser.add_argument(
        "--metrics", action="store_true", help="expose Prometheus metrics on free ports (printed)"
    )
    parser.add_argument("--once", action="store_true", help="exit after the demo request")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--log-dir", type=Path, help="service logs (default: a temp dir)")
    parser.add_argument("--startup-timeout", type=float, default=180.0)


def _say(msg: str) -> None:
    print(msg, flush=True)


def start_stack(model_path: Path, args: argparse.Namespace, log_dir: Path) -> list[ServiceProcess]:
    """Start gateway, encoders and language workers; return them once all are healthy."""
    gateway = f"127.0.0.1:{args.gateway_port}"
    procs: list[ServiceProcess] = []

    def metrics_args() -> list[str]:
        return ["--metrics-port", str(free_port())] if args.metrics else []

    procs.append(
        ServiceProcess(
            "gateway",
            ["serve", "gateway", "--port", str(args.gateway_port), *metrics_args()],
            gateway,
            log_dir,
        )
    )
    for role, count in (("encoder", args.encoders), ("language", args.languages)):
        for i in range(count):
            port = free_port()
            procs.append(
                ServiceProcess(
                    f"{role}-{i}",
                    [
                        "serve",
                        role,
                        "--model-path",
                        str(model_path),
                        "--port",
                        str(port),
                        "--gateway",
                        gateway,
                        *metrics_args(),
                    ],
                    f"127.0.0.1:{port}",
                    log_dir,
                )
            )
    for proc in procs:
        _say(f"  starting {proc.name:<12} {proc.address}")
    for proc in procs:
        proc.wait_healthy(args.startup_timeout)
        _say(f"  healthy   {proc.name:<12} {proc.address}")
    return procs


def wait_registered(gateway: str, num_encoders: int, num_languages: int, timeout_s: float):
    from services.gateway.client import GatewayClient

    deadline = time.monotonic() + timeout_s
    with GatewayClient(gateway) as client:
        while time.monotonic() < deadline:
            workers = [w for w in client.list_workers() if w.healthy]
            roles = [w.role for w in workers]
            if roles.count("encoder") >= num_encoders and roles.count("language") >= num_languages:
                return
            time.sleep(0.2)
    raise TimeoutError("workers did not register with the gateway in time")


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


def run_demo(gateway: str, max_tokens: int) -> None:
    import io

    from services.gateway.client import GatewayClient, format_timing

    buf = io.BytesIO()
    demo_image().save(buf, format="PNG")
    _say(f"\ndemo request: a 448x448 generated image + {DEMO_PROMPT!r}\n")
    with GatewayClient(gateway) as client:
        final = None
        sys.stdout.write("answer: ")
        for chunk in client.generate_stream(DEMO_PROMPT, [buf.getvalue()], max_tokens=max_tokens):
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
            final = chunk
        _say("")
    assert final is not None
    _say(format_timing(final))


def run(args: argparse.Namespace) -> int:
    from common.models.tiny import ensure_tiny_model

    if args.model_path is None:
        _say(f"preparing the demo checkpoint ({args.arch}) ...")
        args.model_path = ensure_tiny_model(args.arch, "demo")
    _say(f"model: {args.model_path}")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="epd-run-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    _say(f"logs:  {log_dir}")
    gateway = f"127.0.0.1:{args.gateway_port}"
    procs: list[ServiceProcess] = []
    try:
        procs = start_stack(args.model_path, args, log_dir)
        wait_registered(gateway, args.encoders, args.languages, args.startup_timeout)
        run_demo(gateway, args.max_tokens)
        if args.once:
            return 0
        _say(
            f"\nserving on {gateway} (Ctrl-C to stop); try: epd generate --gateway {gateway} "
            "--prompt 'Hello'"
        )
        while all(p.alive() for p in procs):
            time.sleep(1.0)
        dead = [p for p in procs if not p.alive()]
        _say(f"{dead[0].name} exited:\n{dead[0].tail()}")
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for proc in reversed(procs):
            proc.stop()
