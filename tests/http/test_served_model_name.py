"""A worker's served model name (what the gateway's ``/v1/models`` lists): its
``--served-model-name``, by default the name of its checkpoint directory, whether the path
comes from the flag or the environment."""

from __future__ import annotations

import argparse

import pytest

from common.worker import add_worker_arguments, served_model_name, worker_configs

PREFIX = "EPD_LANGUAGE_"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")  # as the worker's own config adds it
    add_worker_arguments(parser, PREFIX)
    return parser.parse_args(argv)


def test_default_is_the_checkpoint_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PREFIX + "MODEL_PATH", raising=False)
    monkeypatch.delenv(PREFIX + "SERVED_MODEL_NAME", raising=False)
    worker = worker_configs(parse("--model-path", "/models/Qwen2.5-VL-7B-Instruct/"), PREFIX)
    assert worker["worker"].served_model_name == "Qwen2.5-VL-7B-Instruct"
    monkeypatch.setenv(PREFIX + "MODEL_PATH", "/models/from-env")
    assert worker_configs(parse(), PREFIX)["worker"].served_model_name == "from-env"
    named = parse("--model-path", "/m/x", "--served-model-name", "Qwen/Qwen2.5-VL-7B-Instruct")
    assert worker_configs(named, PREFIX)["worker"].served_model_name == (
        "Qwen/Qwen2.5-VL-7B-Instruct"
    )
    monkeypatch.setenv(PREFIX + "SERVED_MODEL_NAME", "env-name")
    assert worker_configs(parse("--model-path", "/m/x"), PREFIX)["worker"].served_model_name == (
        "env-name"
    )


def test_no_checkpoint_no_name() -> None:
    assert served_model_name("") == ""
    assert served_model_name("relative/dir") == "dir"
