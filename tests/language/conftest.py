"""Builders for the language tests: cases with transformers' expected tokens, engines, runs.

Prompts come from ``bench/local_encode.local_encode`` (the encoder's part played
in-process with transformers' own vision tower), so engine tests need no encoder process.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from PIL import Image

from bench.local_encode import local_encode
from common.models.hf_reference import HFReference, ReferenceInputs
from services.language.config import LanguageConfig
from services.language.engine.engine import LanguageEngine
from services.language.engine.request import RequestOutput
from services.language.engine.sampling import SamplingParams
from services.language.inputs import PromptInputs


def make_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@dataclass
class Case:
    """One request: its reference inputs, engine inputs and the expected greedy tokens."""

    ref_inputs: ReferenceInputs
    inputs: PromptInputs
    expected: list[int]


class Harness:
    """An HF reference and a helper to build cases and engines for one checkpoint."""

    def __init__(self, model_path) -> None:
        self.model_path = str(model_path)
        self.ref = HFReference(model_path)

    def case(self, prompt: str, images: list[Image.Image], max_new_tokens: int = 8) -> Case:
        ref_inputs = self.ref.build_inputs(prompt, images)
        expected = self.ref.generate(ref_inputs, max_new_tokens)
        return Case(ref_inputs, local_encode(self.ref, ref_inputs), expected)

    def engine(self, **overrides) -> LanguageEngine:
        kwargs = dict(
            model_path=self.model_path, num_kv_slots=8192, chunk_size=512, dtype="float32"
        )
        kwargs.update(overrides)
        return LanguageEngine(LanguageConfig(**kwargs))


def run_to_completion(engine: LanguageEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; returns request id -> list of its outputs, in order."""
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(max_steps):
        if not engine.has_work():
            return outputs
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    raise AssertionError("engine did not drain")


def generate(engine: LanguageEngine, inputs: PromptInputs, max_new_tokens: int = 8, **kw):
    """Run one request alone; returns (token ids, final output)."""
    rid = f"r{id(inputs)}-{len(engine.requests)}-{engine.cache_manager.num_used}"
    engine.add_request(rid, SamplingParams(max_new_tokens=max_new_tokens, **kw), inputs)
    outs = run_to_completion(engine)[rid]
    return [t for o in outs for t in o.token_ids], outs[-1]


def failing_on_call(fn, call: int, error: Exception):
    """``fn``, except that its ``call``-th call (counting from 1) raises ``error``."""
    calls = 0

    def wrapped(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == call:
            raise error
        return fn(*args, **kwargs)

    return wrapped


def tokens_of(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


@pytest.fixture(scope="session")
def harness(tiny_model_dir):
    """``harness(arch)`` -> a Harness, built once per arch per session."""
    built: dict[str, Harness] = {}

    def get(arch: str) -> Harness:
        if arch not in built:
            built[arch] = Harness(tiny_model_dir(arch))
        return built[arch]

    return get
