"""``auto`` picks bf16 where the hardware computes it natively, fp32 elsewhere, and says why."""

from __future__ import annotations

import pytest
import torch

from common.compute import cpu_flags, cpu_native_bf16, resolve_compute, set_compute_threads
from common.worker import WorkerConfig

ZEN5 = frozenset({"avx512f", "avx512bw", "avx512_bf16", "avx512_vnni"})
SAPPHIRE_RAPIDS = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
OLD_XEON = frozenset({"avx2", "avx512f", "avx512bw", "avx512vl"})  # bf16 only emulated


def test_auto_is_bf16_on_a_cpu_with_native_bf16():
    onednn_bf16 = torch.backends.mkldnn.is_available() and (
        torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )
    for flags in (ZEN5, SAPPHIRE_RAPIDS):
        compute = resolve_compute("cpu", "auto", flags)
        assert compute.dtype == (torch.bfloat16 if onednn_bf16 else torch.float32)
        assert compute.reason.startswith("auto: ")
        assert ("bf16" in compute.reason) or ("avx512_bf16" in compute.reason)


def test_auto_is_fp32_on_a_cpu_without_native_bf16():
    compute = resolve_compute("cpu", "auto", OLD_XEON)
    assert compute.dtype == torch.float32
    assert compute.reason == "auto: float32, the CPU has none of amx_bf16, avx512_bf16"
    assert resolve_compute("cpu", "auto", frozenset()).dtype == torch.float32


def test_an_explicit_dtype_wins_over_the_hardware():
    assert resolve_compute("cpu", "float32", ZEN5).dtype == torch.float32
    assert resolve_compute("cpu", "bfloat16", OLD_XEON).dtype == torch.bfloat16
    assert resolve_compute("cpu", "float32", ZEN5).reason == "float32 as configured"
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_compute("cpu", "int8")


def test_this_machines_flags_are_read(tmp_path):
    native, why = cpu_native_bf16()
    assert native == (resolve_compute("cpu", "auto").dtype == torch.bfloat16)
    assert why.startswith("the CPU has")
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512_bf16 sse\n\nflags\t: other\n")
    assert cpu_flags(info) == frozenset({"fpu", "avx512_bf16", "sse"})
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_compute_threads_are_set_per_process():
    before = torch.get_num_threads()
    try:
        assert set_compute_threads(0) == before  # 0 leaves torch's default
        assert set_compute_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="compute_threads must be >= 0"):
        set_compute_threads(-1)
    with pytest.raises(ValueError, match="compute_threads must be >= 0"):
        WorkerConfig(compute_threads=-2)


def test_the_language_worker_alone_takes_the_native_linear_kernel():
    from services.encoder.config import EncoderConfig
    from services.language.config import LanguageConfig

    assert LanguageConfig(linear_kernel="native").linear_kernel == "native"
    with pytest.raises(ValueError, match="linear_kernel must be one of .*'onednn'\\)"):
        EncoderConfig(linear_kernel="native")
    with pytest.raises(ValueError, match="linear_kernel must be one of .*'native'\\)"):
        LanguageConfig(linear_kernel="fast")
