"""Bytes on the wire per image, bf16 vs fp32 rows, for the real models' row widths.

Part of ``bench.transfer``; alone: ``python -m bench.wire_bytes``.

For each model (the demo checkpoint and the real Qwen2-VL-2B, Qwen2.5-VL-3B and Qwen3-VL-2B
shapes) and image size, the image's token count comes from that checkpoint's own smart_resize
bounds (the demo one caps images at 1.6 MP), and one room of that many image tokens goes
through the full protocol (Mooncake tcp, receiver default 1024 tokens) in each wire dtype
(``EPD_TRANSFER_DTYPE``). ``bytes`` is what the sender wrote: the image rows
(``hidden * (1 + deepstack)`` per token) plus per-token fill ids, positions and aux records.
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.transfer_protocol import BenchParams, is_clean, measure
from common.models.hub_config import HUB_SPECS, preprocessor_config
from common.models.tiny import image_processor_config
from services.encoder.resize import smart_resize

IMAGE_SIDES = (448, 1344)
DTYPES = ("bf16", "fp32")
REPEATS = 3


@dataclass(frozen=True)
class RowModel:
    name: str
    hidden: int
    deepstack: int
    preprocessor: dict  # the checkpoint's preprocessor_config.json


MODELS = (
    RowModel("demo (Qwen2.5-VL, hidden 256)", 256, 0, image_processor_config("qwen2_5_vl")),
    *(
        RowModel(spec.name, spec.hidden_size, spec.num_deepstack, preprocessor_config(spec.arch))
        for spec in HUB_SPECS.values()
    ),
)


def image_tokens(pre: dict, side: int) -> int:
    """Tokens of a ``side`` x ``side`` image after smart_resize and the 2x2 merge."""
    size = pre.get("size", {})
    min_pixels = pre.get("min_pixels", size.get("shortest_edge"))
    max_pixels = pre.get("max_pixels", size.get("longest_edge"))
    factor = pre["patch_size"] * pre["merge_size"]
    height, width = smart_resize(side, side, factor, min_pixels, max_pixels)
    return (height // pre["patch_size"]) * (width // pre["patch_size"]) // pre["merge_size"] ** 2


def rows() -> list[dict]:
    out = []
    for model in MODELS:
        for side in IMAGE_SIDES:
            tokens = image_tokens(model.preprocessor, side)
            row = {"model": model.name, "image": f"{side}x{side}", "tokens": tokens}
            for dtype in DTYPES:
                record = measure(
                    BenchParams(tokens=tokens, hidden=model.hidden, deepstack=model.deepstack,
                                dtype=dtype, repeats=REPEATS)
                )  # fmt: skip
                row[dtype] = record
            out.append(row)
    return out


def format_table(table: list[dict]) -> str:
    head = (
        f"{'model':<32}{'image':>10}{'tokens':>7}{'bf16 MB':>9}{'fp32 MB':>9}{'fp32/bf16':>10}"
        f"{'bf16 ms':>9}{'fp32 ms':>9}"
    )
    lines = [head]
    for row in table:
        bf16, fp32 = row["bf16"], row["fp32"]
        lines.append(
            f"{row['model']:<32}{row['image']:>10}{row['tokens']:>7}{bf16['bytes'] / 1e6:>9.2f}"
            f"{fp32['bytes'] / 1e6:>9.2f}{fp32['bytes'] / bf16['bytes']:>10.2f}"
            f"{bf16['protocol_ms']:>9.2f}{fp32['protocol_ms']:>9.2f}"
        )
    return "\n".join(lines)


def all_clean(table: list[dict]) -> bool:
    return all(is_clean(row[dtype]) for row in table for dtype in DTYPES)


def main() -> int:
    table = rows()
    print(format_table(table))
    return 0 if all_clean(table) else 1


if __name__ == "__main__":
    raise SystemExit(main())
