"""Frozen-dataclass configs <-> command-line flags and environment variables.

Every service keeps its settings in one frozen dataclass whose fields carry a ``help`` entry in
their metadata. This module is the only place that reads the environment: a field ``max_images``
of a config with ``env_prefix="EPD_ENCODER_"`` is settable as ``--max-images`` or
``EPD_ENCODER_MAX_IMAGES`` (the flag wins). Kubernetes feeds the environment; people use flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def field(default: Any = dataclasses.MISSING, *, help: str, **kwargs: Any) -> Any:
    """A dataclass field with a help text (shown by ``--help`` and in the docs)."""
    metadata = {"help": help}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata, **kwargs)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> tuple[type, bool]:
    """(scalar type, is_tuple) for the annotations configs use."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    if origin in (tuple, list):
        return typing.get_args(tp)[0], True
    return tp, False


def _parse_scalar(tp: type, raw: str) -> Any:
    if tp is bool:
        low = raw.strip().lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"not a boolean: {raw!r}")
    return tp(raw)


def add_cli_args(
    parser: argparse.ArgumentParser, cls: type, env_prefix: str, flag_prefix: str = ""
) -> None:
    """Add one flag per field of the frozen dataclass ``cls``.

    ``flag_prefix`` namespaces a nested config's flags: with ``"transfer"`` the field ``host``
    becomes ``--transfer-host`` (its environment variable is still ``env_prefix + "HOST"``).
    """
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        tp, is_tuple = _base_type(hints[f.name])
        env = env_prefix + f.name.upper()
        # argparse formats help texts with %: a literal one ("90% of ...") is written %%
        help_text = f"{f.metadata.get('help', '')} [env {env}]".replace("%", "%%")
        if dataclasses.is_dataclass(tp):
            continue  # nested configs are added by their owner with their own prefix
        dest = f"{flag_prefix}_{f.name}" if flag_prefix else f.name
        kwargs: dict[str, Any] = {"dest": dest, "default": None, "help": help_text}
        if tp is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif is_tuple:
            kwargs["nargs"] = "*"
            kwargs["type"] = tp
        else:
            kwargs["type"] = tp
        group.add_argument(_flag(dest), **kwargs)


def from_cli_args(
    cls: type[T],
    args: argparse.Namespace,
    env_prefix: str,
    flag_prefix: str = "",
    **overrides: Any,
) -> T:
    """Build ``cls`` from parsed flags, then the environment, then the field defaults."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in overrides:
            continue
        tp, is_tuple = _base_type(hints[f.name])
        if dataclasses.is_dataclass(tp):
            continue
        value = getattr(args, f"{flag_prefix}_{f.name}" if flag_prefix else f.name, None)
        if value is None:
            raw = os.environ.get(env_prefix + f.name.upper())
            if raw is not None:
                try:
                    if is_tuple:
                        value = tuple(_parse_scalar(tp, x) for x in raw.split(",") if x.strip())
                    else:
                        value = _parse_scalar(tp, raw)
                except ValueError as exc:
                    raise ValueError(f"{env_prefix + f.name.upper()}: {exc}") from None
        elif is_tuple:
            value = tuple(value)
        if value is not None:
            values[f.name] = value
    values.update(overrides)
    return cls(**values)
