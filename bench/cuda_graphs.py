"""Decode steps on a GPU with and without CUDA graphs, side by side on one engine.

The language engine alone (no services), bf16 on CUDA, the bench checkpoint by default
(Qwen2.5-VL-3B widths, 4 + 4 layers): for each batch size, that many requests of
``PROMPT_LEN`` tokens are prefilled, then ``STEPS`` decode steps are timed (``step()`` to its
sampled tokens on the CPU, median), once eagerly and once through the captured graphs, in
alternating rounds. Also printed: the bytes a step must read (the weights once, every request's
KV) per second, against the GPU's copy bandwidth (read + written), the issue's goal being 0.7x.

``python -m bench.cuda_graphs [--size demo|bench] [--batches 1,16,64] [--rounds 2]``; needs a
CUDA device (exits 2 without one).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.flops import kv_bytes
from bench.limits import copy_rate, decode_weight_bytes, median_step_s
from common.models.tiny import ensure_tiny_model

PROMPT_LEN = 128
STEPS = 32


def measure(engine, batch: int, graphs, counter) -> float:
    """Median seconds of a decode step of ``batch`` requests, with ``graphs`` (or eagerly)."""
    from services.language.engine.sampling import SamplingParams
    from services.language.inputs import PromptInputs

    mc = engine.model_config
    engine.runner.decode_graphs = graphs
    for _ in range(batch):
        ids = [10 + next(counter)] + [11 + i % 1000 for i in range(PROMPT_LEN - 1)]
        inputs = PromptInputs.from_text_ids(ids, mc.hidden_size)
        params = SamplingParams(max_new_tokens=STEPS + 1, ignore_eos=True)
        engine.add_request(f"g{ids[0]}", params, inputs)
    while any(not r.output_ids for r in engine.requests.values()):
        engine.step()  # the prefills and first tokens
    return median_step_s(engine, engine.device)[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.cuda_graphs")
    parser.add_argument("--size", choices=("demo", "bench"), default="bench")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench.cuda_graphs: no CUDA device", file=sys.stderr)
        return 2
    from services.language.config import LanguageConfig
    from services.language.engine.engine import LanguageEngine

    batches = [int(b) for b in args.batches.split(",")]
    path = ensure_tiny_model("qwen2_5_vl", args.size)
    slots = max(batches) * (PROMPT_LEN + STEPS + 8)
    config = LanguageConfig(
        model_path=str(path), device="cuda", dtype="bfloat16", num_kv_slots=slots
    )
    engine = LanguageEngine(config)
    graphs = engine.runner.decode_graphs
    assert graphs is not None, "the engine made no CUDA graphs"
    counter = iter(range(1, 10**9))
    copy = copy_rate(engine.device, engine.dtype, 512 << 20, 5)
    measure(engine, 1, None, counter)  # warm-up of the eager path
    times: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for batch in batches:
            for name, use in (("eager", None), ("graphs", graphs)):
                times.setdefault((batch, name), []).append(measure(engine, batch, use, counter))
    mc, itemsize = engine.model_config, engine.dtype.itemsize
    weights = decode_weight_bytes(engine.model)
    print(
        f"{torch.cuda.get_device_name()}, {engine.dtype}, {args.size} checkpoint, "
        f"copy {copy / 1e12:.2f} TB/s, {graphs.num_steps} graph steps, "
        f"{graphs.num_graphs} graphs"
    )
    print("| batch | eager step ms | graph step ms | eager / graph | bytes/s vs copy, graphs |")
    print("|---|---|---|---|---|")
    for batch in batches:
        eager = statistics.median(times[(batch, "eager")])
        fast = statistics.median(times[(batch, "graphs")])
        nbytes = weights + batch * kv_bytes(mc, PROMPT_LEN + STEPS // 2, itemsize)
        print(
            f"| {batch} | {1e3 * eager:.2f} | {1e3 * fast:.2f} | {eager / fast:.2f}x "
            f"| {nbytes / fast / copy:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
