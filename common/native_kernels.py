"""CPU kernels in C (``native_kernels.c``, ``native_prefill_attention.c``, ``native_lm_head.c``,
``native_decoder.c``), compiled at first use,
with torch's ops as the fallback: RMSNorm, the vision tower's rotary embedding, the language
model's rotary embedding with its KV write, patch cutting, decode attention over the KV pool,
and (bf16, AVX-512 BF16) causal prefill attention.

On a CPU, a small model's forward is as much element-wise work as matrix products: a bf16
RMSNorm is eight passes over memory in torch (a float32 copy, square, mean, add, rsqrt,
multiply, a bf16 copy, the weight), the vision tower's rotary embedding five. The C kernels
make each one pass with the same arithmetic (float32 inside, the same roundings to the tensor's
dtype; see the C file's header), rows shared among torch's threads. Measured on 2 cores (bf16):
RMSNorm of 16k x 128 rows 2.6 -> 1.5 ms, of 16k x 1,280 37 -> 8 ms; the demo tower's rotary
embedding of 16k patches 8.6 -> 2.0 ms. The language model's rotary embedding and KV write
(``rope_store``: eight operators and two index copies per layer in torch, bit for bit the same
values) made the demo model's 8,659-token prefill 1.16x faster and the bench model's 2,048-token
one 1.12x (engine alone, alternated; decode steps unchanged). Decode attention reads each
request's keys in the KV pool in place (``decode_attention``; where it wins,
``decode_attention_fits``) instead of the gather into a padded batch SDPA needs. Prefill
attention (``prefill_attention``) is a flash kernel of its own on AVX-512 BF16: 290-340
GFLOP/s where torch's CPU flash kernel runs 95-150 and vLLM's CPU kernel ~160 (2 cores, Zen 4:
a 1,170-token prompt's layer 6.3 -> 2.4 ms, an 8,659-token one's 287 -> 131 ms), as accurate as
SDPA in bf16; it is not built for fp32, where SDPA stays. The LM head's greedy choice is screened
on an int8 copy of its weight first where the CPU has AVX-512 VNNI too (``lm_head_screened``:
the full pass's answer bit for bit from half the bytes; ``services/language/model/lm_head.py``
says when it pays). Tried and
left out: a fused SiLU-and-multiply in place of torch's ops (its division and exp made it no
faster than torch's vectorized ops in bf16; it runs inside the native decoder's one call,
``native_decoder.c``, where it saves the calls, not arithmetic), a greedy row max (slower
than ``sampling.row_max``'s blocked ``amax``), and a small-batch bf16 matrix product on AMX
tiles for decode-sized linears (bit-equal to oneDNN's prepacked one, 0.7-1.1x of it: both read
the weights at what the memory gives).

The library is built once per source, compiler and CPU with the system's C compiler (``cc``,
``-O3 -march=native -fopenmp``, under a second) into ``$EPD_CACHE_DIR/native`` (default
``~/.cache/epd/native``), written to a temporary name and renamed, so concurrent processes never
load half a file. ``load_native_kernels`` returns it, or None and the reason (no compiler, a
failed build, not Linux on x86-64 or arm64): callers then keep torch's ops and log why.
``resolve_cpu_kernels`` turns a service's ``cpu_kernels`` setting into the kernels to use
(``auto``: native on a CPU where they build, else torch).

Assumes: tensors on the CPU in bfloat16 or float32 whose last dimension is contiguous (the
wrappers copy other layouts once); anything else goes to torch's ops (``supports``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import types
from collections.abc import Sequence
from pathlib import Path

import torch

from common.models.tiny import cache_root

logger = logging.getLogger(__name__)

# built into one library: the element-wise kernels and decode attention, prefill attention, the
# LM head and the decoder's linears, a step's decoder layers in one call
SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in (
        "native_kernels.c",
        "native_prefill_attention.c",
        "native_lm_head.c",
        "native_decoder.c",
    )
)
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared")
CPU_KERNELS = ("auto", "torch", "native")
DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
BUILD_TIMEOUT_S = 120
# below this many values a kernel runs on the calling thread: waking the pool costs more
PARALLEL_MIN_VALUES = 1 << 15

_i64, _f32, _int, _ptr = ctypes.c_int64, ctypes.c_float, ctypes.c_int, ctypes.c_void_p
SIGNATURES = {  # C function (without the dtype suffix) -> argument types
    "rms_norm": (_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _int),
    "rotate_qk": (_ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _int),
    "rope_store": (_ptr, _i64, _ptr, _i64, _ptr, _i64, *(_ptr,) * 6, *(_i64,) * 4, _int),
    "decode_attention": (_ptr, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, *(_i64,) * 5, _f32, _int),
    "cut_patches": (_ptr, *(_i64,) * 7, _ptr, _ptr, _int),
    # (logits, its row stride), rows, vocab, temperature, top_k, top_p, min_p, u, tokens (out),
    # threads
    "sample_rows": (_ptr, _i64, _i64, _i64, *(_ptr,) * 6, _int),
}
# kernels in bf16 only (the function's name ends in _bf16 alone)
BF16_SIGNATURES = {
    # (q, its row stride), (k, ...), (v, ...), (out, ...), 5 sizes, scale, threads
    "prefill_attention": (*(_ptr, _i64) * 4, *(_i64,) * 5, _f32, _int),
    # (q, its row stride), (k, ...), (v, ...), (out, ...), cu_seqlens, 4 sizes, scale, causal,
    # threads
    "self_attention": (*(_ptr, _i64) * 4, _ptr, *(_i64,) * 4, _f32, _int, _int),
    # weight, vocab, dim, packed
    "lm_head_pack": (_ptr, _i64, _i64, _ptr),
    # (x, its row stride), rows, packed, vocab, dim, (logits, its row stride), best value,
    # best index, threads
    "lm_head": (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int),
    # weight, vocab, dim, screen weight, screen bound terms, largest column norm (out)
    "lm_head_screen_pack": (_ptr, _i64, _i64, _ptr, _ptr, _ptr),
    # (x, its row stride), rows, packed, screen weight, screen bound terms, largest column norm,
    # vocab, dim, best value, best index, threads, blocks rechecked (out)
    "lm_head_screened": (_ptr, _i64, _i64, *(_ptr,) * 3, _f32, _i64, _i64, _ptr, _ptr, _int, _ptr),
    # (x, its row stride), rows, packed, n, dim, bias, (out, its row stride), threads
    "linear": (_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int),
    # h, layers (DecoderLayerArgs[num_layers]), num_layers, step (DecoderStepArgs)
    "decoder_layers": (_ptr, _ptr, _i64, _ptr),
}
RETURNS = {
    "decode_attention": ctypes.c_int,
    "sample_rows": ctypes.c_int,
    "prefill_attention": ctypes.c_int,
    "self_attention": ctypes.c_int,
    "lm_head_pack": ctypes.c_int,
    "lm_head": ctypes.c_int,
    "lm_head_screen_pack": ctypes.c_int,
    "lm_head_screened": ctypes.c_int,
    "linear": ctypes.c_int,
    "decoder_layers": ctypes.c_int,
}
LM_HEAD_COLS = 16  # vocabulary columns per block of the packed LM head
SCREEN_GROUP_DIMS = 128  # the head screen's quantization groups: a scale each per column and row
# the bf16 attention kernels' limits (head_dim a multiple of 16 up to 256, at most 32 query heads
# per KV head); they run where the CPU has AVX-512 BF16 (``attention_fits``)
ATTENTION_DIM_STEP, ATTENTION_MAX_DIM, ATTENTION_MAX_GROUP = 16, 256, 32
# decode attention: the C kernel's limits, and the largest GQA group (query heads per KV head)
# where it beats gathering the keys for SDPA. Measured on 2 cores, 16 requests, float32 dot
# products: group 2 (head_dim 64 or 128) 1.5-3x faster from 45 to 1,100 keys and 2-3x for one
# 8,700-key request; group 7-8 (head_dim 128) 0.8-1.1x, its per-key dot products then cost more
# than the gather. In bf16 on AVX-512 BF16 the scores run on VDPBF16PS, 16 keys summed across at
# once (1.7-3x the float32 dot products' speed): Qwen2.5-VL-3B's group of 8 then takes a decode
# step of 16 rows at 300 keys in 61-65 ms against 64-68 through the gather, 74 against 74-76 at
# 1,200 keys (Zen 4, bf16). The weighted values too, two keys a VDPBF16PS: the whole kernel
# 1.4-2.1x faster again (16 rows of 300-1,100 keys; groups 2-8, head_dim 64-128).
DECODE_MAX_GROUP, DECODE_MAX_DIM, DECODE_FAST_GROUP, DECODE_FAST_GROUP_BF16 = 16, 256, 4, 8


class DecoderLayerArgs(ctypes.Structure):
    """``DecoderLayer`` of ``native_decoder.c``: one layer's weights (linears packed by
    ``pack_lm_head``; no q/k/v bias: None) and its KV pool pages."""

    _fields_ = [
        (name, _ptr)
        for name in (
            "input_norm",
            "qkv",
            "qkv_bias",
            "o",
            "post_norm",
            "gate_up",
            "down",
            "k_cache",
            "v_cache",
        )  # fmt: skip
    ]


class DecoderStepArgs(ctypes.Structure):
    """``DecoderStep`` of ``native_decoder.c``: the model's widths and one step's rows."""

    _fields_ = [
        *((name, _i64) for name in ("hidden", "heads", "kv_heads", "head_dim", "intermediate")),
        ("eps", _f32),
        ("scale", _f32),
        ("tokens", _i64),
        *((name, _ptr) for name in ("cos", "sin", "out_slots")),
        ("num_decode", _i64),
        ("decode_max_len", _i64),
        ("decode_slots", _ptr),
        ("decode_offsets", _ptr),
        ("num_extends", _i64),
        *(
            (name, _ptr)
            for name in ("extend_q_start", "extend_q_len", "extend_kv_offsets", "extend_kv_slots")
        ),
        ("threads", _int),
    ]


def cache_dir() -> Path:
    return cache_root() / "native"


def _cpu_identity() -> str:
    """What the instructions ``-march=native`` picks depend on: the CPU's feature flags."""
    # NOTE: imported here: common.compute imports this module for CPU_KERNELS
    from common.compute import cpu_flags

    return " ".join(sorted(cpu_flags())) or platform.processor()


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run(
            [cc, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unknown ({exc})"


def build(cc: str | None = None, out_dir: Path | None = None) -> Path:
    """The built library's path (built now unless the cache has it); raises ``RuntimeError``
    saying why it cannot be built."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64"):
        raise RuntimeError(
            f"native kernels are built on Linux x86-64 / arm64, not {platform.platform()}"
        )
    cc = cc or os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise RuntimeError(f"no C compiler ({cc!r} not found; `make setup` installs gcc)")
    sources = [path.read_bytes() for path in SOURCES]
    parts = [" ".join(FLAGS), _compiler_version(cc), _cpu_identity()]
    key = hashlib.sha256(b"\0".join([*sources, *(p.encode() for p in parts)])).hexdigest()[:20]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"native_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        built = Path(tmp) / target.name
        cmd = [cc, *FLAGS, "-o", str(built), *(str(path) for path in SOURCES), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RuntimeError(f"building the native kernels failed: {exc}") from None
        if done.returncode != 0:
            error = done.stderr.strip()[-800:]
            raise RuntimeError(f"building the native kernels failed ({' '.join(cmd)}): {error}")
        os.replace(built, target)  # atomic: another process sees the whole file or none
    logger.info("native kernels built: %s", target)
    return target


@dataclasses.dataclass(frozen=True)
class HeadScreen:
    """The LM head's int8 copy for screening greedy choices (``pack_lm_head_screen``): the
    weight ``[blocks][dim / 4][16][4]``, each block's bound terms, the largest column's norm."""

    weight: torch.Tensor
    params: torch.Tensor
    widest: float

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.params.nbytes


class NativeKernels:
    """The loaded library's kernels as functions of tensors (see ``supports``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lib = ctypes.CDLL(str(path))  # a CDLL call releases the GIL while it runs
        for name, argtypes in SIGNATURES.items():
            for suffix in DTYPE_SUFFIX.values():
                fn = getattr(self._lib, f"{name}_{suffix}")
                fn.argtypes, fn.restype = argtypes, RETURNS.get(name)
        for name, argtypes in BF16_SIGNATURES.items():
            fn = getattr(self._lib, f"{name}_bf16")
            fn.argtypes, fn.restype = argtypes, RETURNS.get(name)
        # whether this build has the AVX-512 BF16 kernels: the bf16 attention kernels and LM
        # head (else they answer -1), decode attention's bf16 scores (else in float32)
        self.has_avx512_bf16 = bool(self._lib.avx512_bf16_available())
        # whether it screens the head's greedy choice in int8 (AVX-512 VNNI too)
        self.has_head_screen = bool(self._lib.lm_head_screen_available())

    def _fn(self, name: str, dtype: torch.dtype):
        return getattr(self._lib, f"{name}_{DTYPE_SUFFIX[dtype]}")

    @staticmethod
    def supports(*tensors: torch.Tensor) -> bool:
        """True when the kernels take ``tensors``: on the CPU, all of one dtype they have."""
        first = tensors[0]
        return first.dtype in DTYPE_SUFFIX and all(
            t.device.type == "cpu" and t.dtype == first.dtype for t in tensors
        )

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * (x * rsqrt(mean(x²) + eps)).to(x.dtype)`` over the last dimension,
        float32 inside (transformers' Qwen RMSNorm)."""
        dim = x.shape[-1]
        rows = _rows(x)
        weight = weight.contiguous()
        out = torch.empty(x.shape, dtype=x.dtype)
        self._fn("rms_norm", x.dtype)(
            rows.data_ptr(), rows.stride(0), weight.data_ptr(), out.data_ptr(),
            rows.shape[0], dim, eps, _threads(rows.numel()),
        )  # fmt: skip
        return out

    def rotate_qk(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys of ``qkv`` ``[S, 3, heads, head_dim]`` rotated by ``cos`` / ``sin``
        ``[S, head_dim]`` in float32, each ``[S, heads, head_dim]`` in ``qkv``'s dtype
        (``services/encoder/vision_attention.rotate_qk``'s contract, bit for bit)."""
        seq, _, heads, dim = qkv.shape
        qkv = qkv.contiguous()
        cos = cos.to(torch.float32).contiguous()
        sin = sin.to(torch.float32).contiguous()
        q = torch.empty(seq, heads, dim, dtype=qkv.dtype)
        k = torch.empty_like(q)
        self._fn("rotate_qk", qkv.dtype)(
            qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(), k.data_ptr(),
            seq, heads, dim, _threads(qkv.numel()),
        )  # fmt: skip
        return q, k

    def rope_store(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """The language model's rotary embedding and KV write in one pass: returns ``q``
        ``[T, heads, dim]`` rotated; ``k`` rotated and ``v`` ``[T, kv_heads, dim]`` written into
        the caches ``[num_slots, kv_heads, dim]`` at ``slots`` (long ``[T]``, in range). Bit for
        bit ``services/language/model/rope.apply_rotary`` and two ``index_copy_``, with ``cos``
        / ``sin`` ``[T, 1, dim]`` in the tensors' dtype."""
        tokens, heads, dim = q.shape
        q, k, v = _heads(q), _heads(k), _heads(v)
        cos, sin = cos.contiguous(), sin.contiguous()
        slots = slots.contiguous()
        q_out = torch.empty(tokens, heads, dim, dtype=q.dtype)
        self._fn("rope_store", q.dtype)(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), q_out.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), tokens, heads, k.shape[1], dim,
            _threads(q.numel()),
        )  # fmt: skip
        return q_out

    def cut_patches(
        self, frames: torch.Tensor, table: torch.Tensor, patch: int, merge: int, repeat: int = 1
    ) -> torch.Tensor:
        """``frames`` ``[T, H, W, C]`` uint8 cut into the ViT's flat patches ``[grid_h * grid_w,
        C * T' * patch * patch]``, each value ``table[c * 256 + byte]`` (``table``: the flat
        per-channel lookup table, in the patches' dtype); ``repeat`` > 1 takes one frame
        (``T`` = 1) that many times, as an image is (``T'`` = ``repeat``). The patch order is
        ``services/encoder/patches.PatchCutter``'s, value for value."""
        num, height, width, channels = frames.shape
        if repeat > 1 and num != 1:
            raise ValueError(f"repeat {repeat} takes one frame, got {num}")
        if height % (patch * merge) or width % (patch * merge):
            raise ValueError(f"{width}x{height} is not a whole number of {patch * merge} blocks")
        frames = frames.contiguous()
        stride = 0 if repeat > 1 else height * width * channels
        count = repeat if repeat > 1 else num
        grid = (height // patch) * (width // patch)
        out = torch.empty(grid, channels * count * patch * patch, dtype=table.dtype)
        self._fn("cut_patches", table.dtype)(
            frames.data_ptr(), stride, count, height, width, channels, patch, merge,
            table.contiguous().data_ptr(), out.data_ptr(), _threads(out.numel()),
        )  # fmt: skip
        return out

    def decode_attention_fits(
        self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
    ) -> bool:
        """True where ``decode_attention`` runs for this model (in ``dtype``) and is the faster
        path: GQA groups up to ``DECODE_FAST_GROUP``, ``DECODE_FAST_GROUP_BF16`` in bf16 where
        its scores run on AVX-512 BF16."""
        group = heads // kv_heads if kv_heads else 0
        bf16_scores = dtype == torch.bfloat16 and self.has_avx512_bf16
        fast = DECODE_FAST_GROUP_BF16 if bf16_scores else DECODE_FAST_GROUP
        return (
            group * kv_heads == heads
            and 0 < group <= min(fast, DECODE_MAX_GROUP)
            and head_dim <= DECODE_MAX_DIM
        )

    def decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        offsets: torch.Tensor,
        max_len: int,
        scale: float,
    ) -> torch.Tensor:
        """Each of ``q``'s ``n`` rows (``[n, heads, head_dim]``, one query token per request)
        attending to its keys in place: ``slots[offsets[i]:offsets[i + 1]]`` of ``k_cache`` /
        ``v_cache`` (``[slots, kv_heads, head_dim]``); ``slots`` and ``offsets`` long,
        ``max_len`` the longest run. Returns ``[n, heads, head_dim]`` in ``q``'s dtype."""
        n, heads, dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != dim:
            q = q.contiguous()
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("decode_attention reads a contiguous KV pool")
        out = torch.empty(n, heads, dim, dtype=q.dtype)
        code = self._fn("decode_attention", q.dtype)(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            slots.data_ptr(), offsets.data_ptr(), out.data_ptr(),
            n, heads, k_cache.shape[1], dim, max_len, scale, torch.get_num_threads(),
        )  # fmt: skip
        if code == -1:
            raise ValueError(
                f"decode_attention: {heads} heads over {k_cache.shape[1]} KV heads "
                f"of {dim} does not fit the kernel"
            )
        if code:
            raise MemoryError("decode_attention: no memory for its score buffers")
        return out

    def sample_rows(
        self,
        logits: torch.Tensor,
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        min_p: Sequence[float],
        uniform: torch.Tensor,
    ) -> list[int]:
        """One token per row of ``logits`` [rows, vocab] (bf16 or float32): temperature (> 0),
        min-p, top-k, top-p as ``SamplingParams`` has them (0, 0, 1, 0: off), then the inverse
        of the kept probabilities' running sum at ``uniform[r]`` (float64 in [0, 1)); -1 for a
        row with a NaN or +inf logit or only -inf ones. Rows run in parallel; see
        ``sample_rows`` in the C source."""
        rows, vocab = logits.shape
        if logits.stride(1) != 1:
            logits = logits.contiguous()
        temperature_ = torch.tensor(temperature, dtype=torch.float32)
        top_k_ = torch.tensor(top_k, dtype=torch.int64)
        top_p_ = torch.tensor(top_p, dtype=torch.float32)
        min_p_ = torch.tensor(min_p, dtype=torch.float32)
        uniform = uniform.to(torch.float64).contiguous()
        tokens = torch.empty(rows, dtype=torch.int64)
        code = self._fn("sample_rows", logits.dtype)(
            logits.data_ptr(), logits.stride(0), rows, vocab, temperature_.data_ptr(),
            top_k_.data_ptr(), top_p_.data_ptr(), min_p_.data_ptr(), uniform.data_ptr(),
            tokens.data_ptr(), max(1, min(rows, torch.get_num_threads())),
        )  # fmt: skip
        if code:
            raise MemoryError("sample_rows: no memory for its buffers")
        return tokens.tolist()

    def attention_fits(self, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
        """True where ``prefill_attention`` and ``self_attention`` run for a model: bf16 on a
        CPU with AVX-512 BF16, a head_dim and GQA group within the kernels' limits."""
        group = heads // kv_heads if kv_heads else 0
        return (
            self.has_avx512_bf16
            and dtype == torch.bfloat16
            and group * kv_heads == heads
            and 0 < group <= ATTENTION_MAX_GROUP
            and head_dim % ATTENTION_DIM_STEP == 0
            and 0 < head_dim <= ATTENTION_MAX_DIM
        )

    def prefill_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Causal attention of a prefill chunk written into ``out``: ``q`` and ``out`` ``[q_len,
        heads, head_dim]`` (bf16; rows may be strided), ``k`` / ``v`` ``[kv_len, kv_heads,
        head_dim]``, the chunk's own keys last: query ``i`` sees keys ``0 .. kv_len - q_len +
        i``. Returns ``out``. Only where ``attention_fits``."""
        q, k, v = _heads(q), _heads(k), _heads(v)
        _check_out_rows(out, "prefill_attention")
        (q_len, heads, dim), (kv_len, kv_heads) = q.shape, k.shape[:2]
        code = self._lib.prefill_attention_bf16(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            out.data_ptr(), out.stride(0), q_len, kv_len, heads, kv_heads, dim, scale,
            torch.get_num_threads(),
        )  # fmt: skip
        shape = f"{q_len} queries of {heads} heads over {kv_len} keys of {kv_heads} KV heads"
        _check_attention_code(code, "prefill_attention", f"{shape} of {dim}")
        return out

    def self_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        cu_seqlens: torch.Tensor,
        scale: float,
        causal: bool = False,
    ) -> torch.Tensor:
        """Attention within each piece that ``cu_seqlens`` (long ``[num_pieces + 1]`` offsets)
        cuts from ``q`` / ``out`` ``[S, heads, head_dim]`` and ``k`` / ``v`` ``[S, kv_heads,
        head_dim]`` (bf16; rows may be strided): every token of a piece sees all of its piece
        (``causal``: the ones before it and itself). Written into ``out``, returned. Only where
        ``attention_fits``."""
        q, k, v = _heads(q), _heads(k), _heads(v)
        _check_out_rows(out, "self_attention")
        cu = cu_seqlens.to(torch.int64).contiguous()
        if int(cu[0]) != 0 or int(cu[-1]) != q.shape[0] or bool((cu[1:] < cu[:-1]).any()):
            raise ValueError(f"self_attention: cu_seqlens must rise from 0 to {q.shape[0]}")
        heads, dim = q.shape[1:]
        code = self._lib.self_attention_bf16(
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            out.data_ptr(), out.stride(0), cu.data_ptr(), cu.shape[0] - 1, heads, k.shape[1],
            dim, scale, int(causal), torch.get_num_threads(),
        )  # fmt: skip
        _check_attention_code(
            code, "self_attention", f"{heads} heads over {k.shape[1]} KV heads of {dim}"
        )
        return out

    def lm_head_fits(self, dtype: torch.dtype, dim: int) -> bool:
        """True where ``lm_head_logits`` / ``lm_head_maxima`` run for a model: bf16 on a CPU with
        AVX-512 BF16, an even hidden size."""
        return self.has_avx512_bf16 and dtype == torch.bfloat16 and dim > 0 and dim % 2 == 0

    def pack_lm_head(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[vocab, dim]`` (bf16) in the head kernel's layout: blocks of 16
        vocabulary columns, each ``[dim / 2][16][2]`` (see ``common/native_lm_head.c``)."""
        vocab, dim = weight.shape
        if weight.dtype != torch.bfloat16 or dim % 2:
            raise ValueError(f"pack_lm_head takes bf16 [vocab, even dim], got {weight.dtype} {dim}")
        weight = weight.contiguous()
        packed = torch.empty(_packed_values(vocab, dim), dtype=torch.bfloat16)
        if self._lib.lm_head_pack_bf16(weight.data_ptr(), vocab, dim, packed.data_ptr()):
            raise ValueError(f"pack_lm_head: a dim of {dim} does not fit the kernel")
        return packed

    def lm_head_logits(self, x: torch.Tensor, packed: torch.Tensor, vocab: int) -> torch.Tensor:
        """Logits ``[n, vocab]`` (bf16) of ``x`` ``[n, dim]`` (bf16) against ``pack_lm_head``'s
        ``packed`` weight: float32 sums rounded to bf16. Only where ``lm_head_fits``."""
        out = torch.empty(x.shape[0], vocab, dtype=torch.bfloat16)
        self._lm_head(x, packed, vocab, out, None, None)
        return out

    def lm_head_maxima(
        self, x: torch.Tensor, packed: torch.Tensor, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's largest logit (float32 ``[n]``, of the bf16-rounded logits) and the first
        column holding it (long ``[n]``), the logits themselves never written: what ``row_max``
        of ``lm_head_logits`` gives, except that a row with a NaN or +inf logit has NaN as its
        maximum. Only where ``lm_head_fits``."""
        values = torch.empty(x.shape[0], dtype=torch.float32)
        indices = torch.empty(x.shape[0], dtype=torch.long)
        self._lm_head(x, packed, vocab, None, values, indices)
        return values, indices

    def pack_lm_head_screen(self, weight: torch.Tensor) -> HeadScreen | None:
        """The int8 screen of ``weight`` ``[vocab, dim]`` (bf16) that ``lm_head_screened``
        reads; None where it cannot be made (no AVX-512 VNNI, a dim not a multiple of 4, a
        non-finite weight). See ``common/native_lm_head.c``."""
        vocab, dim = weight.shape
        if not self.has_head_screen or weight.dtype != torch.bfloat16 or dim % 4:
            return None
        weight = weight.contiguous()
        blocks = -(-vocab // LM_HEAD_COLS)
        q = torch.empty(blocks * LM_HEAD_COLS * dim, dtype=torch.uint8)
        groups = -(-dim // SCREEN_GROUP_DIMS)  # per block: [groups][16] scales, two [16] bounds
        params = torch.empty(blocks * (groups + 2) * LM_HEAD_COLS, dtype=torch.float32)
        widest = ctypes.c_float()
        code = self._lib.lm_head_screen_pack_bf16(
            weight.data_ptr(), vocab, dim, q.data_ptr(), params.data_ptr(), ctypes.byref(widest)
        )
        return None if code else HeadScreen(q, params, widest.value)

    def lm_head_screened(
        self, x: torch.Tensor, packed: torch.Tensor, screen: HeadScreen, vocab: int
    ) -> tuple[torch.Tensor, torch.Tensor, int | None]:
        """``lm_head_maxima``'s answer, bit for bit, found by reading ``screen`` (the int8 copy)
        and then only the blocks of 16 columns it cannot rule out; the last value is how many
        such blocks the rows ran through the full pass's routine together, None where the call
        ran the full pass instead (a row the screen cannot bound, or too many columns kept)."""
        rows = _rows(x)
        dim = rows.shape[1]
        if rows.dtype != torch.bfloat16 or packed.numel() != _packed_values(vocab, dim):
            raise ValueError(f"lm_head: bf16 rows of {dim} do not match the packed head")
        if screen.weight.numel() != -(-vocab // LM_HEAD_COLS) * LM_HEAD_COLS * dim:
            raise ValueError(f"lm_head: rows of {dim} do not match the head's screen")
        values = torch.empty(rows.shape[0], dtype=torch.float32)
        indices = torch.empty(rows.shape[0], dtype=torch.long)
        rechecked = ctypes.c_int64()
        code = self._lib.lm_head_screened_bf16(
            rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(),
            screen.weight.data_ptr(), screen.params.data_ptr(), screen.widest, vocab, dim,
            values.data_ptr(), indices.data_ptr(), torch.get_num_threads(),
            ctypes.byref(rechecked),
        )  # fmt: skip
        if code == -1:
            raise ValueError(f"lm_head: rows of {dim} do not fit the kernel (or it is not built)")
        if code == -2:
            raise MemoryError("lm_head: no memory for its packed rows")
        return values, indices, rechecked.value if code == 0 else None

    def _lm_head(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        vocab: int,
        logits: torch.Tensor | None,
        values: torch.Tensor | None,
        indices: torch.Tensor | None,
    ) -> None:
        rows = _rows(x)
        dim = rows.shape[1]
        if rows.dtype != torch.bfloat16 or packed.numel() != _packed_values(vocab, dim):
            raise ValueError(f"lm_head: bf16 rows of {dim} do not match the packed head")
        code = self._lib.lm_head_bf16(
            rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), vocab, dim,
            None if logits is None else logits.data_ptr(), vocab,
            None if values is None else values.data_ptr(),
            None if indices is None else indices.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if code == -1:
            raise ValueError(f"lm_head: rows of {dim} do not fit the kernel (or it is not built)")
        if code:
            raise MemoryError("lm_head: no memory for its packed rows")

    def linear(
        self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` ``[..., n]`` (bf16) of ``x`` ``[..., dim]`` (bf16) against
        ``pack_lm_head``'s ``packed`` ``W`` ``[n, dim]``: float32 sums, the bias added, rounded
        to bf16 (a bf16 linear's roundings). Only where ``lm_head_fits``."""
        rows = _rows(x)
        dim = rows.shape[1]
        if rows.dtype != torch.bfloat16 or packed.numel() != _packed_values(n, dim):
            raise ValueError(f"linear: bf16 rows of {dim} do not match the packed weight")
        out = torch.empty(rows.shape[0], n, dtype=torch.bfloat16)
        code = self._lib.linear_bf16(
            rows.data_ptr(), rows.stride(0), rows.shape[0], packed.data_ptr(), n, dim,
            None if bias is None else bias.data_ptr(), out.data_ptr(), n,
            torch.get_num_threads(),
        )  # fmt: skip
        if code == -1:
            raise ValueError(f"linear: rows of {dim} do not fit the kernel (or it is not built)")
        if code:
            raise MemoryError("linear: no memory for its packed rows")
        return out.view(*x.shape[:-1], n)

    def decoder_layers(
        self, h: torch.Tensor, layers: ctypes.Array, step: DecoderStepArgs
    ) -> torch.Tensor:
        """Run ``layers`` (``DecoderLayerArgs``) over ``h`` ``[tokens, hidden]`` (bf16,
        contiguous; updated in place and returned) for the step ``step`` describes (see
        ``native_decoder.c``)."""
        code = self._lib.decoder_layers_bf16(
            h.data_ptr(), ctypes.addressof(layers), len(layers), ctypes.addressof(step)
        )
        if code == -1:
            raise ValueError("decoder_layers: a shape does not fit the kernels (or not built)")
        if code:
            raise MemoryError("decoder_layers: no memory for its scratch")
        return h


def _check_out_rows(out: torch.Tensor, what: str) -> None:
    """The attention kernels write ``out`` ``[rows, heads, dim]`` rows of contiguous heads."""
    if out.stride(2) != 1 or out.stride(1) != out.shape[2]:
        raise ValueError(f"{what} writes rows of contiguous heads")


def _check_attention_code(code: int, what: str, shape: str) -> None:
    """An attention kernel's return code as the error it stands for (0: none)."""
    if code == -1:
        raise ValueError(f"{what}: {shape} do not fit the kernel (or it is not built here)")
    if code:
        raise MemoryError(f"{what}: no memory for its packed keys")


def _packed_values(n: int, dim: int) -> int:
    """Values of a ``[n, dim]`` weight packed by ``pack_lm_head``: whole blocks of 16 columns."""
    return -(-n // LM_HEAD_COLS) * LM_HEAD_COLS * dim


def _threads(num_values: int) -> int:
    return 1 if num_values < PARALLEL_MIN_VALUES else torch.get_num_threads()


def _heads(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, dim]`` with each token's heads contiguous (a view when they are)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as 2-D rows ``[n, dim]`` with a unit last stride (a view when it can be)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if rows.stride(-1) != 1 or (rows.shape[0] > 1 and rows.stride(0) < rows.shape[1]):
        rows = rows.contiguous()
    return rows


@functools.cache
def load_native_kernels() -> tuple[NativeKernels | None, str]:
    """This process's kernels (built or taken from the cache once), or None and why not."""
    try:
        return NativeKernels(build()), ""
    except (RuntimeError, OSError, AttributeError) as exc:
        return None, str(exc)


def resolve_cpu_kernels(
    choice: str, device: torch.device, dtype: torch.dtype, what: str
) -> NativeKernels | None:
    """The native kernels for ``what`` (a service's model) under its ``cpu_kernels``
    setting, or None for torch's ops (the reference: ``torch``); logs the choice and why.
    ``auto`` takes them on a CPU in a dtype they have where they build, else torch's ops;
    ``native`` the same, except that where they cannot run it raises ``RuntimeError`` naming
    why not."""
    if choice not in CPU_KERNELS:
        raise ValueError(f"cpu_kernels {choice!r}: expected one of {CPU_KERNELS}")
    why = ""
    if choice == "torch":
        why = "as configured"
    elif device.type != "cpu":
        why = f"on {device}"
    elif dtype not in DTYPE_SUFFIX:
        why = f"no native kernels for {dtype}"
    if why:
        if choice == "native":
            raise RuntimeError(f"cpu_kernels native: {why}")
        logger.info("%s: CPU kernels: torch (%s)", what, why)
        return None
    kernels, why = load_native_kernels()
    if kernels is None:
        if choice == "native":
            raise RuntimeError(f"cpu_kernels native: {why}")
        logger.warning("%s: CPU kernels: torch (native kernels unavailable: %s)", what, why)
        return None
    logger.info("%s: CPU kernels: native (%s)", what, kernels.path.name)
    return kernels


def native_rms_norm_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A transformers Qwen RMSNorm module's ``forward`` on ``self._native`` kernels (set by
    ``use_native_rms_norms``), torch's own where they do not take the input."""
    if not NativeKernels.supports(hidden_states, self.weight):
        return type(self).forward(self, hidden_states)
    return self._native.rms_norm(hidden_states, self.weight, self.variance_epsilon)


def use_native_rms_norms(module: torch.nn.Module, kernels: NativeKernels) -> int:
    """Give every transformers RMSNorm inside ``module`` (``weight`` and ``variance_epsilon``,
    float32 inside, the weight applied in the input's dtype: Qwen's) the native kernel, per
    instance; returns how many."""
    norms = [
        m
        for m in module.modules()
        if type(m).__name__.endswith("RMSNorm")
        and hasattr(m, "variance_epsilon")
        and isinstance(getattr(m, "weight", None), torch.Tensor)
    ]
    for norm in norms:
        norm._native = kernels
        norm.forward = types.MethodType(native_rms_norm_forward, norm)
    return len(norms)
