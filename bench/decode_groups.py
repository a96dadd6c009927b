"""One decode step beside a long context: requests grouped by KV length vs one padded group.

A step of 16 decoding requests, one over ``--long`` keys (a 60 s clip) and 15 over ``--short``
keys, on the language engine's own model, KV pool, dtype and kernels. "grouped" is what the
runner builds (``services/language/engine/decode_groups.py``); "one group" pads every request to
the longest, as every step did before. Both are timed alternately, the batch's padding included
(``pad_decode_group``) and the forward with its LM head; medians. ``python -m bench.decode_groups
[--size demo|bench] [--repeats N] [--threads N]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from common.models.tiny import ensure_tiny_model
from services.language.config import LanguageConfig
from services.language.engine.decode_groups import group_by_kv_len, pad_decode_group
from services.language.engine.engine import LanguageEngine
from services.language.model.batch import ForwardBatch


def make_step(engine: LanguageEngine, kv_lens: list[int], grouped: bool) -> ForwardBatch:
    """The decode batch of requests whose KV slots are consecutive ranges of the pool."""
    runner = engine.runner
    starts = torch.tensor([0, *kv_lens]).cumsum(0).tolist()
    slots = [torch.arange(starts[i], starts[i] + n) for i, n in enumerate(kv_lens)]
    groups = group_by_kv_len(kv_lens) if grouped else [list(range(len(kv_lens)))]
    built, order = [], []
    for group in groups:
        built.append(
            pad_decode_group(len(order), [slots[i] for i in group], runner.dtype, runner.device)
        )
        order += group
    num = len(kv_lens)
    return ForwardBatch(
        fill_ids=torch.randint(0, 1000, (num,), device=runner.device),
        positions=torch.tensor([kv_lens[i] - 1 for i in order]).expand(3, -1).to(runner.device),
        image_rows=None,
        out_slots=torch.cat([g.kv_slots[:, -1] for g in built]),
        extends=[],
        decode_groups=built,
        logit_rows=torch.arange(num, device=runner.device),
    )


@torch.inference_mode()
def bench(size: str, long_len: int, short_len: int, num_short: int, repeats: int) -> dict:
    path = ensure_tiny_model("qwen2_5_vl", size)
    kv_lens = [long_len] + [short_len] * num_short
    engine = LanguageEngine(LanguageConfig(model_path=str(path), num_kv_slots=sum(kv_lens) + 64))
    runner = engine.runner
    for layer in range(engine.model_config.num_layers):  # every slot the steps read is written
        for cache in runner.kv_pool.layer(layer):
            cache.normal_()
    times: dict[str, list[float]] = {"grouped": [], "one group": []}
    keys: dict[str, int] = {}
    for rep in range(repeats + 1):  # the first round warms up
        for name in times:
            start = time.perf_counter()
            batch = make_step(engine, kv_lens, grouped=name == "grouped")
            runner.model(batch, runner.kv_pool)
            if rep:
                times[name].append(time.perf_counter() - start)
            keys[name] = batch.num_keys
    return {
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_lens": kv_lens,
        "keys": keys,
        "ms": {name: 1e3 * statistics.median(t) for name, t in times.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.decode_groups", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--size", choices=("demo", "bench"), default="demo")
    parser.add_argument("--long", type=int, default=8192, help="keys of the long request")
    parser.add_argument("--short", type=int, default=128, help="keys of each short request")
    parser.add_argument("--num-short", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads (0: torch's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    got = bench(args.size, args.long, args.short, args.num_short, args.repeats)
    print(
        f"{args.size} checkpoint, {got['dtype']}, {torch.get_num_threads()} threads: "
        f"1 x {args.long} + {args.num_short} x {args.short} keys, median of {args.repeats}"
    )
    print("| decode step | keys read | ms |\n|---|---|---|")
    for name, ms in got["ms"].items():
        print(f"| {name} | {got['keys'][name]} | {ms:.2f} |")
    ratio = got["ms"]["one group"] / got["ms"]["grouped"]
    print(f"one group / grouped: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
