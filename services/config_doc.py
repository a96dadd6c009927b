"""Writes ``docs/configuration.md`` from the config dataclasses (``--check``: fail if stale).

The dataclasses are the single source of every setting; this keeps the reference in step.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def _sections():
    from common.internal import ENV_PREFIX as INTERNAL_ENV
    from common.internal import FLAG_PREFIX as INTERNAL_FLAGS
    from common.internal import InternalConfig
    from common.transfer.config import ENV_PREFIX as TRANSFER_ENV
    from common.transfer.config import TransferConfig
    from common.worker import WorkerConfig
    from services.encoder.config import ENV_PREFIX as ENCODER_ENV
    from services.encoder.config import EncoderConfig
    from services.gateway.config import ENV_PREFIX as GATEWAY_ENV
    from services.gateway.config import GatewayConfig
    from services.language.config import ENV_PREFIX as LANGUAGE_ENV
    from services.language.config import LanguageConfig

    return [
        ("Gateway (`epd serve gateway`)", GatewayConfig, GATEWAY_ENV, ""),
        ("Encoder (`epd serve encoder`)", EncoderConfig, ENCODER_ENV, ""),
        ("Language worker (`epd serve language`)", LanguageConfig, LANGUAGE_ENV, ""),
        (
            "Worker registration and metrics (encoder and language; their env prefix)",
            WorkerConfig,
            "EPD_<ROLE>_",
            "",
        ),
        ("Transfer plane (encoder and language)", TransferConfig, TRANSFER_ENV, "transfer"),
        (
            "Internal gRPC credentials (every role; see docs/security.md)",
            InternalConfig,
            INTERNAL_ENV,
            INTERNAL_FLAGS,
        ),
    ]


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Every setting is a flag and an environment variable (the flag wins). Generated from the",
        "config dataclasses by `python -m services.config_doc`; do not edit by hand.",
        "",
    ]
    for title, cls, env_prefix, flag_prefix in _sections():
        lines += [
            f"## {title}",
            "",
            "| flag | environment | default | meaning |",
            "|---|---|---|---|",
        ]
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(f.default):
                continue  # a nested config: it has its own section
            value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            default = repr(value)
            name = f"{flag_prefix}_{f.name}" if flag_prefix else f.name
            flag = "--" + name.replace("_", "-")
            env = env_prefix + f.name.upper()
            text = f.metadata.get("help", "").replace("|", "\\|")
            lines.append(f"| `{flag}` | `{env}` | `{default}` | {text} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale: run python -m services.config_doc")
            return 1
        return 0
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
