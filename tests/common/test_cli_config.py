"""Config dataclasses: flags win over the environment, which wins over defaults."""

from __future__ import annotations

import argparse
from dataclasses import FrozenInstanceError, dataclass

import pytest

from common.cli_config import add_cli_args, field, from_cli_args


@dataclass(frozen=True)
class DemoConfig:
    port: int = field(1, help="a port")
    name: str = field("x", help="a name")
    verbose: bool = field(False, help="talk more")
    peers: tuple[str, ...] = field((), help="peer addresses")
    ratio: float = field(0.5, help="a ratio")

    def __post_init__(self) -> None:
        if self.port < 0:
            raise ValueError("port must be >= 0")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser, DemoConfig, "EPD_DEMO_")
    return parser.parse_args(argv)


def test_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_DEMO_PORT", "7")
    monkeypatch.setenv("EPD_DEMO_NAME", "env")
    monkeypatch.setenv("EPD_DEMO_VERBOSE", "true")
    monkeypatch.setenv("EPD_DEMO_PEERS", "a:1,b:2")
    cfg = from_cli_args(DemoConfig, parse(["--name", "flag", "--ratio", "0.25"]), "EPD_DEMO_")
    assert cfg == DemoConfig(port=7, name="flag", verbose=True, peers=("a:1", "b:2"), ratio=0.25)
    cfg = from_cli_args(DemoConfig, parse(["--no-verbose", "--peers", "c:3"]), "EPD_DEMO_")
    assert cfg.verbose is False and cfg.peers == ("c:3",)
    with pytest.raises(FrozenInstanceError):
        cfg.port = 3  # type: ignore[misc]


def test_bad_values_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPD_DEMO_VERBOSE", "maybe")
    with pytest.raises(ValueError, match="EPD_DEMO_VERBOSE"):
        from_cli_args(DemoConfig, parse([]), "EPD_DEMO_")
    monkeypatch.delenv("EPD_DEMO_VERBOSE")
    with pytest.raises(ValueError, match="port must be"):
        from_cli_args(DemoConfig, parse(["--port", "-1"]), "EPD_DEMO_")


def test_flag_prefix_namespaces_nested_configs(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser()
    add_cli_args(parser, DemoConfig, "EPD_DEMO_")
    add_cli_args(parser, DemoConfig, "EPD_INNER_", flag_prefix="inner")
    monkeypatch.setenv("EPD_INNER_NAME", "from-env")
    args = parser.parse_args(["--port", "3", "--inner-port", "4"])
    outer = from_cli_args(DemoConfig, args, "EPD_DEMO_")
    inner = from_cli_args(DemoConfig, args, "EPD_INNER_", flag_prefix="inner")
    assert (outer.port, outer.name) == (3, "x")
    assert (inner.port, inner.name) == (4, "from-env")


@pytest.mark.parametrize("role", ["encoder", "language", "gateway"])
def test_every_roles_help_renders(role: str) -> None:
    """``epd serve ROLE --help``: argparse formats help texts with ``%``, and a literal one in a
    field's help ("0 = 90% of ...") must not break it."""
    import importlib

    from services.serve import ROLE_MODULES

    parser = argparse.ArgumentParser(prog=f"epd serve {role}")
    importlib.import_module(ROLE_MODULES[role]).add_arguments(parser)
    text = parser.format_help()
    assert "[env EPD_" in text
    if role == "encoder":
        assert "90% of the request" in text
