"""Every compute stage against the machine's own limit, measured in one run.

The machine's reference figures: the FLOP/s of a large square ``torch.mm``, the bytes/s of a
large tensor copy (read + written) in the model's dtype, and of a sum over as many bytes (read
only: the most a decode step's weight reads can reach), on each device, measured before and
after the stages (the better of the two counts: on a shared host, the least disturbed). Then:

* the encoder's ViT (``VisionTower``) on one 448x448 and one 1344x1344 image (896x896 with
  ``--quick``): analytic FLOPs (``bench.flops``) / seconds, as a fraction of the mm figure;
* the language engine's prefill of a 2048-token prompt, the same way;
* the engine's decode at batch 1 and at batch 16: the bytes of every weight once in the model's
  dtype + the KV cache / step time, as a fraction of the copy bandwidth (and, printed beside
  it, of the read-only sum's). Where the greedy LM head screens an int8 copy of its weight
  first (``services/language/model/lm_head.py``), a step reads fewer bytes than that (at 3B
  widths and 16 rows ~0.44 GB of the head's 0.62): the figure is then the rate at which the
  step gets through the model, not the memory's.

Goal for every ratio: >= 0.6. ``python -m bench.limits [--size demo|bench] [--quick]
[--device auto|cpu|cuda] [--dtype auto|fp32|bf16]`` (auto: what the services pick);
``--size bench`` (Qwen2.5-VL-3B widths, 4+4 layers) is the meaningful one: the demo model's
layers are too narrow to load any machine.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from bench.flops import VitShape, decode_bytes, kv_bytes, prefill_flops, vit_flops
from common.compute import resolve_compute
from common.linear_kernels import PackedLinear
from common.models.tiny import ensure_tiny_model

GOAL = 0.6
IMAGE_SIZES = (448, 1344)
QUICK_IMAGE_SIZES = (448, 896)  # 1344x1344 is 2 TFLOP on the bench ViT: a minute on 2 cores
PROMPT_LEN = 2048
DECODE_BATCH = 16  # requests decoding together in the batched decode stage
DECODE_PROMPT_LEN = 128
DECODE_STEPS = 24
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Reference:
    device: str
    dtype: str
    mm_flops_per_s: float  # best of a few n^3 torch.mm
    mm_size: int
    copy_bytes_per_s: float  # bytes read + written per second by a large copy_
    copy_mb: int
    read_bytes_per_s: float  # bytes read per second by a sum over the same size (no writes)


@dataclass(frozen=True)
class Stage:
    name: str
    work: float  # FLOPs, or bytes for the decode row
    seconds: float
    rate: float  # work / seconds
    limit: float  # the reference rate it is held against
    unit: str  # "FLOP/s" or "B/s"

    @property
    def ratio(self) -> float:
        return self.rate / self.limit


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn, device: torch.device, repeats: int, warm_up: bool = True) -> float:
    """Best wall time of ``fn`` over ``repeats`` runs, after one warm-up run if asked."""
    if warm_up:
        fn()
        _sync(device)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best


def _mm_rate(device: torch.device, dtype: torch.dtype, n: int, repeats: int) -> float:
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _best(lambda: torch.mm(a, b, out=out), device, repeats)


def copy_rate(device: torch.device, dtype: torch.dtype, nbytes: int, repeats: int) -> float:
    src = torch.randn(nbytes // dtype.itemsize, device=device, dtype=dtype)
    dst = torch.empty_like(src)
    return 2 * nbytes / _best(lambda: dst.copy_(src), device, repeats)


def read_rate(device: torch.device, nbytes: int, repeats: int) -> float:
    """Bytes/s of a pass that only reads (an fp32 sum): what a decode step's weight reads can
    reach at best, without the copy's writes."""
    src = torch.ones(nbytes // 4, device=device, dtype=torch.float32)
    return nbytes / _best(lambda: src.sum(), device, repeats)


def measure_reference(device: torch.device, dtype: torch.dtype, quick: bool) -> Reference:
    n = 2048 if device.type == "cpu" else 8192
    copy_mb = 256 if quick and device.type == "cpu" else 512
    return Reference(
        str(device),
        str(dtype).removeprefix("torch."),
        _mm_rate(device, dtype, n, 2 if quick else 4),
        n,
        copy_rate(device, dtype, copy_mb << 20, 3 if quick else 5),
        copy_mb,
        read_rate(device, copy_mb << 20, 3 if quick else 5),
    )


def best_of(a: Reference, b: Reference) -> Reference:
    """The higher of each figure: the machine's limit is what it reached when least disturbed
    (measured before and after the stages, as other work on a shared host comes and goes)."""
    return replace(
        a,
        mm_flops_per_s=max(a.mm_flops_per_s, b.mm_flops_per_s),
        copy_bytes_per_s=max(a.copy_bytes_per_s, b.copy_bytes_per_s),
        read_bytes_per_s=max(a.read_bytes_per_s, b.read_bytes_per_s),
    )


def _limit(ref: Reference, unit: str) -> float:
    return ref.mm_flops_per_s if unit == "FLOP/s" else ref.copy_bytes_per_s


def measure_vit(path: Path, device: torch.device, dtype: torch.dtype, ref: Reference, quick: bool):
    from services.encoder.checkpoint import load_checkpoint
    from services.encoder.vision import VisionTower

    checkpoint = load_checkpoint(path)
    vc = checkpoint.config.vision_config
    tower = VisionTower(checkpoint, str(device), str(dtype).removeprefix("torch."))
    shape = VitShape.from_config(vc)
    patch_in = shape.patch_in
    rows = []
    for size in QUICK_IMAGE_SIZES if quick else IMAGE_SIZES:
        side = size // vc.patch_size
        grids = [(1, side, side)]
        pixels = torch.randn(side * side, patch_in)
        big = size > 800  # warm already (the small image ran first), and seconds per run
        repeats = 1 if big and (quick or device.type == "cpu") else 3
        seconds = _best(functools.partial(tower.forward, pixels, grids), device, repeats, not big)
        flops = vit_flops(shape, grids).total
        rows.append(
            Stage(
                f"ViT {size}x{size}", flops, seconds, flops / seconds, ref.mm_flops_per_s, "FLOP/s"
            )
        )
    return rows


def _lang_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure_language(
    path: Path, device: torch.device, dtype: torch.dtype, ref: Reference, quick: bool
) -> list[Stage]:
    from services.language.config import LanguageConfig
    from services.language.engine.engine import LanguageEngine
    from services.language.engine.sampling import SamplingParams
    from services.language.inputs import PromptInputs

    prompt_len = PROMPT_LEN // 2 if quick else PROMPT_LEN
    num_decode = 8 if quick else 24
    config = LanguageConfig(
        model_path=str(path),
        device=str(device),
        dtype=_lang_dtype(dtype),
        chunk_size=prompt_len,
        num_kv_slots=4 * (prompt_len + num_decode + 8),
    )
    engine = LanguageEngine(config)
    mc = engine.model_config
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, mc.vocab_size, (prompt_len,), generator=gen)
    counter = iter(range(1, 10**9))

    def submit(max_new_tokens: int, num_tokens: int = prompt_len) -> str:
        fill = ids[:num_tokens].clone()
        fill[0] = 10 + next(counter)  # a distinct first token: the radix cache cannot help
        request_id = f"limits-{fill[0]}"
        inputs = PromptInputs.from_text_ids(fill.tolist(), mc.hidden_size)
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        engine.add_request(request_id, params, inputs)
        return request_id

    def prefill(num_tokens: int = prompt_len) -> None:
        submit(1, num_tokens)
        while engine.has_work():
            engine.step()

    prefill(128)  # warm-up, short: a full-length one would double this stage's time
    _sync(device)
    seconds = _best(prefill, device, 1 if quick else 2, warm_up=False)
    flops = prefill_flops(mc, prompt_len).total
    rows = [
        Stage(
            f"prefill {prompt_len} tokens",
            flops,
            seconds,
            flops / seconds,
            ref.mm_flops_per_s,
            "FLOP/s",
        )
    ]
    submit(num_decode + 1)
    engine.step()  # the prefill step, which also yields the first token
    step_s, num_steps = median_step_s(engine, device)
    context = prompt_len + num_steps // 2  # the median step's KV length (about)
    nbytes = decode_bytes(decode_weight_bytes(engine.model), mc, context, dtype.itemsize)
    rows.append(
        Stage(
            f"decode batch 1, {context} ctx",
            nbytes,
            step_s,
            nbytes / step_s,
            ref.copy_bytes_per_s,
            "B/s",
        )
    )
    rows.append(measure_batched_decode(engine, submit, device, ref))
    return rows


def median_step_s(engine, device: torch.device) -> tuple[float, int]:
    """Step ``engine`` until idle: (median step seconds, number of steps)."""
    steps = []
    while engine.has_work():
        start = time.perf_counter()
        engine.step()
        _sync(device)
        steps.append(time.perf_counter() - start)
    return statistics.median(steps), len(steps)


def measure_batched_decode(engine, submit, device: torch.device, ref: Reference) -> Stage:
    """``DECODE_BATCH`` requests of ``DECODE_PROMPT_LEN`` tokens decoding together: bytes one
    step reads (the weights once, every request's KV) / median step time."""
    for _ in range(DECODE_BATCH):
        submit(DECODE_STEPS + 1, DECODE_PROMPT_LEN)
    while any(not r.output_ids for r in engine.requests.values()):
        engine.step()  # the prefills (and the first tokens)
    step_s, _ = median_step_s(engine, device)
    context = DECODE_PROMPT_LEN + DECODE_STEPS // 2
    mc, itemsize = engine.model_config, engine.dtype.itemsize
    nbytes = decode_weight_bytes(engine.model) + DECODE_BATCH * kv_bytes(mc, context, itemsize)
    name = f"decode batch {DECODE_BATCH}, {context} ctx"
    return Stage(name, nbytes, step_s, nbytes / step_s, ref.copy_bytes_per_s, "B/s")


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Weights one decode step reads: all of them once, except an untied embedding table, of
    which it reads one row (a tied table is read whole, as the LM head). Prepacked linears
    (``PackedLinear``), the native decoder's linears and the native LM head hold their weights
    as buffers: counted by their shapes."""
    from services.language.model.lm_head import NativeLMHead
    from services.language.model.native_decoder import NativeLinear

    total = sum(p.numel() * p.element_size() for p in model.parameters())  # a tied one once
    itemsize = model.embed_tokens.weight.element_size()
    for module in model.modules():
        if isinstance(module, (PackedLinear, NativeLinear, NativeLMHead)):
            total += module.in_features * module.out_features * itemsize
    if getattr(model, "lm_head", None) is not None:
        table = model.embed_tokens.weight
        total -= table.numel() * table.element_size()
    return total


def bench(args: argparse.Namespace) -> dict:
    path = Path(args.model_path) if args.model_path else ensure_tiny_model("qwen2_5_vl", args.size)
    devices = {"cpu": ["cpu"], "cuda": ["cuda"]}.get(args.device)
    if devices is None:  # auto: the CPU, and CUDA as well when there is one
        devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    runs = []
    for device in map(torch.device, devices):
        if args.dtype == "auto":  # what the services pick (common/compute.py)
            dtype = resolve_compute(str(device), "auto").dtype
        else:
            dtype = DTYPES[args.dtype]
        first = measure_reference(device, dtype, args.quick)
        stages = measure_vit(path, device, dtype, first, args.quick)
        stages += measure_language(path, device, dtype, first, args.quick)
        ref = best_of(first, measure_reference(device, dtype, args.quick))
        stages = [replace(s, limit=_limit(ref, s.unit)) for s in stages]
        runs.append({"reference": asdict(ref), "stages": [_stage_dict(s) for s in stages]})
    return {"model": path.name, "goal": GOAL, "runs": runs}


def _stage_dict(stage: Stage) -> dict:
    return {**asdict(stage), "ratio": stage.ratio}


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if value >= scale:
            return f"{value / scale:.1f} {prefix}{unit}"
    return f"{value:.0f} {unit}"


def format_table(result: dict) -> str:
    lines = [f"stages vs the machine's limits - {result['model']} (goal >= {result['goal']}x)"]
    for run in result["runs"]:
        ref = run["reference"]
        lines.append(
            f"{ref['device']} {ref['dtype']}: torch.mm {ref['mm_size']}^3 "
            f"{_si(ref['mm_flops_per_s'], 'FLOP/s')}, copy_ of {ref['copy_mb']} MB "
            f"{_si(ref['copy_bytes_per_s'], 'B/s')} (read + written), a sum over it "
            f"{_si(ref['read_bytes_per_s'], 'B/s')} (read)"
        )
        lines.append(f"  {'stage':<28}{'work':>12}{'ms':>10}{'achieved':>16}{'ratio':>8}  met")
        for s in run["stages"]:
            unit = s["unit"].removesuffix("/s")
            met = "yes" if s["ratio"] >= result["goal"] else "no"
            if unit == "B":  # a decode row: also against the read-only pass
                met = f"{met:<3}  ({s['rate'] / ref['read_bytes_per_s']:.2f}x of the read)"
            lines.append(
                f"  {s['name']:<28}{_si(s['work'], unit):>12}{s['seconds'] * 1e3:>10.1f}"
                f"{_si(s['rate'], s['unit']):>16}{s['ratio']:>7.2f}x  {met}"
            )
    lines.append(
        "  work: ViT and prefill = FLOPs of their matmuls (bench.flops); "
        "decode = bytes per step (weights once + KV)"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=("demo", "bench"), default="bench")
    parser.add_argument("--model-path", type=Path, help="checkpoint (default: generated, --size)")
    parser.add_argument(
        "--quick", action="store_true", help="half the prompt, a 896 px image, fewer repeats"
    )
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument(
        "--dtype",
        choices=("auto", *DTYPES),
        default="auto",
        help="auto: what the services pick (bf16 on CUDA and on a CPU with native bf16)",
    )


def run(args: argparse.Namespace) -> int:
    print(format_table(bench(args)), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.limits", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
