"""Language engine vs transformers on the same checkpoint, same machine, same run.

Measures prefill tokens/s, generation tokens/s at batch 1 and 8 and with 32 concurrent streams
(HF ``generate`` with a padded batch vs the engine's continuous batch), and the engine's TTFT for
a repeated image+prefix request (radix hit) vs the first. ``python -m bench.language [--quick]
[--size demo|bench]`` (bench: the arch's real layer widths with 4+4 layers, so per-layer costs
weigh as in the real model instead of the 151k-row embedding dominating; it measures shorter
prompts and generations than demo, by the same method, so that it finishes in minutes on CPU).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from bench.local_encode import local_encode
from common.models.hf_reference import HFReference
from common.models.tiny import ensure_tiny_model
from services.language.config import LanguageConfig
from services.language.engine.engine import LanguageEngine
from services.language.engine.sampling import SamplingParams
from services.language.inputs import PromptInputs


@dataclass(frozen=True)
class Plan:
    """How much one run measures."""

    prefill_len: int  # prompt tokens of the prefill row
    prompt_len: int  # prompt tokens of each generated sequence
    new_tokens: int  # tokens generated per sequence
    repeats: int  # timed runs after one warm-up; the best counts
    image_size: int  # side of the TTFT image, pixels


PLANS = {  # (size, quick) -> plan
    ("demo", False): Plan(2048, 128, 64, 3, 1100),
    ("demo", True): Plan(2048, 128, 16, 1, 1100),
    ("bench", False): Plan(128, 16, 16, 1, 448),
    ("bench", True): Plan(64, 8, 8, 1, 224),
}
BATCHES = (1, 8, 32)


def _drain(engine: LanguageEngine) -> dict[str, list]:
    outputs: dict[str, list] = {}
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return outputs


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bench_prefill(ref: HFReference, engine: LanguageEngine, prompt_len: int, repeats: int):
    vocab = engine.model_config.vocab_size
    ids = torch.randint(10, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(0))

    @torch.inference_mode()
    def hf():
        # logits of the last token only, as generate computes them
        ref.model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)

    counter = iter(range(10**9))

    def ours():
        # A distinct first token each time so the radix cache cannot help.
        fill = ids[0].clone()
        fill[0] = 10 + next(counter) % (vocab - 10)
        inputs = PromptInputs.from_text_ids(fill.tolist(), engine.model_config.hidden_size)
        engine.add_request(f"p{fill[0]}-{time.perf_counter_ns()}", SamplingParams(1), inputs)
        _drain(engine)

    return prompt_len / _timed(hf, repeats), prompt_len / _timed(ours, repeats)


def bench_generate(ref, engine, batch: int, prompt_len: int, new_tokens: int, repeats: int):
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(10, vocab, (batch, prompt_len), generator=gen)

    @torch.inference_mode()
    def hf():
        ref.model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
        )

    def ours():
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        tag = time.perf_counter_ns()
        for b in range(batch):
            inputs = PromptInputs.from_text_ids(ids[b].tolist(), engine.model_config.hidden_size)
            engine.add_request(f"g{tag}-{b}", params, inputs)
        _drain(engine)

    num = batch * new_tokens
    return num / _timed(hf, repeats), num / _timed(ours, repeats)


def bench_ttft(ref: HFReference, engine: LanguageEngine, image_size: int) -> tuple[float, float]:
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (image_size, image_size, 3), dtype=np.uint8))
    inputs = local_encode(ref, ref.build_inputs("describe the image", [image]))
    ttfts = []
    for i in range(2):
        engine.add_request(f"ttft{i}", SamplingParams(max_new_tokens=1), inputs)
        ttfts.append(_drain(engine)[f"ttft{i}"][-1].ttft_s)
    return ttfts[0], ttfts[1], len(inputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.language")
    parser.add_argument("--arch", default="qwen2_5_vl")
    parser.add_argument("--size", choices=("demo", "bench"), default="demo")
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    path = ensure_tiny_model(args.arch, args.size)
    ref = HFReference(path)
    config = LanguageConfig(model_path=str(path), chunk_size=4096, num_kv_slots=32768)
    engine = LanguageEngine(config)
    plan = PLANS[args.size, args.quick]
    rows = []
    hf, ours = bench_prefill(ref, engine, plan.prefill_len, plan.repeats)
    rows.append((f"prefill tokens/s ({plan.prefill_len}-token prompt)", hf, ours))
    for batch in BATCHES:
        hf, ours = bench_generate(
            ref, engine, batch, plan.prompt_len, plan.new_tokens, plan.repeats
        )
        what = f"batch {batch}" if batch < BATCHES[-1] else f"{batch} streams"
        rows.append((f"generate tokens/s, {what} ({plan.new_tokens} new)", hf, ours))
    first, second, prompt_len = bench_ttft(ref, engine, plan.image_size)
    print(f"\nlanguage engine vs transformers - {path.name} on {engine.device}")
    print(f"{'metric':<44}{'transformers':>14}{'engine':>12}{'ratio':>8}")
    for name, hf_value, ours_value in rows:
        print(f"{name:<44}{hf_value:>14.1f}{ours_value:>12.1f}{ours_value / hf_value:>7.2f}x")
    print(
        f"{f'TTFT ms, image prompt {prompt_len} tokens':<44}{'first':>14}{'repeat':>12}"
        f"\n{'':<44}{first * 1e3:>14.1f}{second * 1e3:>12.1f}{first / second:>7.1f}x lower"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
