"""``bench.limits``' reference and table: the least disturbed figures count, decode rows are
also held against the read-only pass."""

from dataclasses import asdict

from bench.limits import Reference, Stage, _stage_dict, best_of, format_table


def _ref(mm: float, copy: float, read: float) -> Reference:
    return Reference("cpu", "bfloat16", mm, 2048, copy, 256, read)


def test_best_of_takes_each_figure_at_its_best():
    best = best_of(_ref(1e12, 20e9, 15e9), _ref(2e12, 18e9, 17e9))
    assert (best.mm_flops_per_s, best.copy_bytes_per_s, best.read_bytes_per_s) == (
        2e12,
        20e9,
        17e9,
    )


def test_table_holds_decode_rows_against_the_read_too():
    ref = _ref(1e12, 20e9, 16e9)
    stages = [
        Stage("prefill 1024 tokens", 6e11, 1.0, 6e11, ref.mm_flops_per_s, "FLOP/s"),
        Stage("decode batch 16, 140 ctx", 1.2e9, 0.1, 12e9, ref.copy_bytes_per_s, "B/s"),
    ]
    result = {
        "model": "m",
        "goal": 0.6,
        "runs": [{"reference": asdict(ref), "stages": [_stage_dict(s) for s in stages]}],
    }
    table = format_table(result).splitlines()
    assert "a sum over it 16.0 GB/s (read)" in table[1]
    prefill = next(line for line in table if "prefill" in line)
    decode = next(line for line in table if "decode" in line)
    assert "0.60x  yes" in prefill and "of the read" not in prefill
    assert "0.60x  yes" in decode and "(0.75x of the read)" in decode
