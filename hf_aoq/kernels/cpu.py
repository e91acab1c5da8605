"""CPU kernels and the int4 CPU packings: aten's int4 (tinygemm's CPU twin) and int8-weight
kernels on aten's packing, and hf_aoq's own (csrc/, built on first use) for int4 (on hf_aoq's
"pairs" packing), int8 and float8 weights, which compute in float32 (int4 with bf16/fp16
activations: through int16 activation codes) and win where they apply (measured by
scripts/bench_kernels.py).

Row-count crossovers (`*_GEMV_MAX_ROWS`) are defined here only and passed to the C++ kernels,
which choose their path with them. Eager and compiled calls run the same C++ entry points (the
`*_linear_io` functions of csrc/linear_io.cpp), through `OpaqueOp`."""
from __future__ import annotations

import functools
from typing import Optional

import torch

from ..core.primitives import pack_int4, unpack_int4
from . import cpu_ext
from .common import (FLOATS, INT4_GROUP_SIZES, aligned_contiguous, int4_padded_k, pad_input, pad_int4_codes,
                     scale_and_zero)
from .nibbles import unpack_nibbles
from .registry import Packing, capability, opaque_op, register_kernel, register_packing

aten = torch.ops.aten

HAS_INT4_CPU = hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(aten, "_convert_weight_to_int4pack_for_cpu")
HAS_INT8_WEIGHT_MM = hasattr(aten, "_weight_int8pack_mm")

# What the CPU allows, probed once (see registry.capable).
CPU_EXT = capability("cpu:hf_aoq_ext", "cpu", lambda device: cpu_ext.available())
ATEN_INT4_CPU = capability("cpu:aten_int4pack_mm", "cpu", lambda device: HAS_INT4_CPU)
ATEN_INT8_MM = capability("cpu:aten_int8pack_mm", "cpu", lambda device: HAS_INT8_WEIGHT_MM)


# ---------------------------------------------------------------------- int4
def _int4pack_codes(codes: torch.Tensor) -> torch.Tensor:
    n, k = codes.shape
    if codes.device.type == "cpu" and n % 16 == 0 and _int4_layout_matches():
        # The same bytes as aten's converter (checked once by a probe), ~9x faster: aten's
        # takes int32 codes, four bytes each, and packs element by element.
        return avx2_int4pack_bytes(codes).view(n, k // 2)
    return _aten_int4pack(codes)


def _aten_int4pack(codes: torch.Tensor) -> torch.Tensor:
    return aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def _int4_cpu_available(w) -> bool:
    return w.block_size[-1] in INT4_GROUP_SIZES and w.shape[0] % 16 == 0


def pack_int4_for_cpu(w):
    """Canonical Int4Tensor -> qdata in aten's CPU int4 layout (padded to whole groups), scale
    as [groups, N, 2] (scale, zero)."""
    qdata = _int4pack_codes(pad_int4_codes(unpack_int4(w.qdata), int4_padded_k(w)))
    return w.replace(qdata=qdata, scale=scale_and_zero(w), packing="cpu_int4pack")


def unpack_int4_from_cpu(w):
    n, k = w.shape
    if _int4_layout_matches():  # the layout is known: undo it directly (80x faster than probing)
        codes = avx2_int4unpack_codes(w.qdata, n, int4_padded_k(w))[:, :k]
    else:
        codes = unpack_nibbles(w.qdata, n, int4_padded_k(w), _int4pack_codes)[:, :k]
    scale = w.scale[..., 0].t().contiguous()
    return w.replace(qdata=pack_int4(codes), scale=scale, packing=None)


register_packing(
    Packing("cpu_int4pack", "Int4Tensor", "cpu", 10, _int4_cpu_available, pack_int4_for_cpu, unpack_int4_from_cpu,
            needs=(ATEN_INT4_CPU,))
)


def _float_input(x, w) -> bool:
    return x.dtype in FLOATS


@register_kernel("linear", "Int4Tensor", "cpu_int4pack_mm", backend="cpu", priority=10, reads=("cpu_int4pack",),
                 device="cpu", needs=(ATEN_INT4_CPU,), when=_float_input)
def int4_cpu_linear(x, w, bias):
    k = w.shape[1]
    x = w.simulate_input_quantization(x)  # activation-quantized Int4Tensors: as the reference
    x2 = pad_input(x.reshape(-1, k), int4_padded_k(w)).contiguous()
    sz = w.scale if w.scale.dtype == x.dtype else w.scale.to(x.dtype)
    y = aten._weight_int4pack_mm_for_cpu(x2, w.qdata, w.block_size[-1], sz)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def avx2_int4pack_bytes(codes: torch.Tensor) -> torch.Tensor:
    """aten's AVX2 CPU int4 layout of [N, K] codes (N a multiple of 16), as flat uint8: per 32
    rows and per k, 16 bytes with row d in the low and row 16 + d in the high nibble; a last
    block of 16 rows has, per k, 8 bytes holding rows 2d (low) and 2d + 1 (high)."""
    n, k = codes.shape
    c = codes.to(torch.uint8)
    full = n // 32 * 32
    blocks = c[:full].reshape(-1, 2, 16, k)
    parts = [(blocks[:, 0] | (blocks[:, 1] << 4)).transpose(1, 2).reshape(-1)]
    if full < n:
        tail = c[full:].reshape(-1, 2, k)
        parts.append((tail[:, 0] | (tail[:, 1] << 4)).t().reshape(-1))
    return torch.cat(parts)


def avx2_int4unpack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Inverse of `avx2_int4pack_bytes`: uint8 codes [n, k] from packed bytes (any shape)."""
    flat = packed.contiguous().view(torch.uint8).reshape(-1)
    full = n // 32 * 32
    head = flat[: full * k // 2].view(-1, k, 16)
    parts = [torch.stack([head & 15, head >> 4], dim=1).transpose(2, 3).reshape(full, k)]
    if full < n:
        tail = flat[full * k // 2:].view(k, (n - full) // 2)
        parts.append(torch.stack([tail & 15, tail >> 4], dim=-1).reshape(k, n - full).t())
    return torch.cat(parts) if len(parts) > 1 else parts[0]


@functools.lru_cache(maxsize=None)
def _int4_layout_matches() -> bool:
    if not HAS_INT4_CPU:
        return False
    codes = torch.randint(0, 16, (48, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        packed = _aten_int4pack(codes)
    except RuntimeError:
        return False
    return packed.dtype == torch.uint8 and torch.equal(packed.contiguous().reshape(-1), avx2_int4pack_bytes(codes))


# hf_aoq's own int4 kernel (csrc/int4.cpp, on the templates of csrc/int4_pairs.h) reads its own
# "pairs" layout: per block of 32 rows (a last one may have 16) and per column pair, the two
# columns' codes of a row share one 32-bit lane, which is what an integer multiply-add over
# column pairs needs. Half-precision activations meet the codes as int16 codes at any number of
# rows (see int4_pairs.h; 2048x5632, bf16: 0.29 ms at batch 1 against 0.86 for aten's bf16
# kernel, 25.6 ms at 256 rows against 37.6 for hf_aoq's dequantize + float32 GEMM).
# Float32 activations: a float32 GEMV at few rows, chunked dequantize + float32 GEMM above.
INT4_GEMV_MAX_ROWS = 12  # float32 activations: measured crossover, 2048x5632 and 5632x2048, 1 and 2 threads


def _pairs_blocks(n: int) -> list[tuple[int, int]]:
    """(first row, rows) of each block of the pairs layout: 32 rows, a last one of 16."""
    return [(n0, min(32, n - n0)) for n0 in range(0, n, 32)]


def pairs_int4pack_bytes(codes: torch.Tensor) -> torch.Tensor:
    """The pairs layout of [N, K] codes (N a multiple of 16, K even), as flat uint8: per block of
    R rows (32, a last one of 16) and per column pair j, R bytes; as 16-bit words, word 2i + p
    (i < R/4) holds column 2j + p, with the code of row R/4 * t + i in nibble t. The torch model of
    csrc's int4_repack_pairs, and the inverse of `pairs_int4unpack_codes`."""
    n, k = codes.shape
    c = codes.to(torch.uint8)
    parts = []
    for n0, rows in _pairs_blocks(n):
        lanes = rows // 4
        b = c[n0:n0 + rows].reshape(2, 2, lanes, k // 2, 2)  # [h, nibble, i, j, p]
        b = b[:, 0] | (b[:, 1] << 4)  # [h, i, j, p]
        parts.append(b.permute(2, 1, 3, 0).reshape(-1))  # [j, i, p, h]
    return torch.cat(parts)


def pairs_int4unpack_codes(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """uint8 codes [n, k] from bytes in the pairs layout (any shape): undoes `pairs_int4pack_bytes`."""
    flat = packed.contiguous().view(torch.uint8).reshape(-1)
    parts = []
    for n0, rows in _pairs_blocks(n):
        lanes = rows // 4
        b = flat[n0 * k // 2:(n0 + rows) * k // 2].view(k // 2, lanes, 2, 2)  # [j, i, p, h]
        b = torch.stack([b & 15, b >> 4], dim=-1)  # [j, i, p, h, nibble]
        parts.append(b.permute(3, 4, 1, 0, 2).reshape(rows, k))  # [h, nibble, i, j, p]
    return torch.cat(parts)


def _int4_pairs_available(w) -> bool:
    return w.block_size[-1] in INT4_GROUP_SIZES and w.shape[0] % 16 == 0


def pack_int4_pairs(w):
    """Canonical Int4Tensor -> qdata in the pairs layout (padded to whole groups with code 8),
    scale as [groups, N, 2] (scale, zero)."""
    qdata = cpu_ext.load().int4_repack_pairs(w.qdata.contiguous(), int4_padded_k(w))
    return w.replace(qdata=qdata, scale=scale_and_zero(w), packing="cpu_int4_pairs")


def unpack_int4_pairs(w):
    n, k = w.shape
    codes = pairs_int4unpack_codes(w.qdata, n, int4_padded_k(w))[:, :k]
    return w.replace(qdata=pack_int4(codes), scale=w.scale[..., 0].t().contiguous(), packing=None)


register_packing(
    Packing("cpu_int4_pairs", "Int4Tensor", "cpu", 20, _int4_pairs_available, pack_int4_pairs, unpack_int4_pairs,
            needs=(CPU_EXT,))
)


def _in_features(w) -> int:
    with torch._C.DisableTorchFunctionSubclass():  # `w.shape` through __torch_function__ costs 10x
        return w.shape[-1]


def _linear_out(x, packed, *rest):
    """The fake of every `*_linear_io` op: x [..., k] -> [..., N] in x's dtype, N = packed rows."""
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


# One C++ call does the input conversion to float32, padding, the kernel, bias and output cast.
@opaque_op("int4_linear_io_cpu", _linear_out)
def int4_linear_io(
    x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int, k: int,
    bias: Optional[torch.Tensor], gemv_max_rows: int,
) -> torch.Tensor:
    return cpu_ext.load().int4pack_linear_io(x, packed, scale_zero, group_size, k, bias, gemv_max_rows)


def _contiguous_float_input(x, w) -> bool:
    return x.dtype in FLOATS and w.qdata.is_contiguous() and w.scale.is_contiguous()


@register_kernel("linear", "Int4Tensor", "cpu_int4_ext", backend="cpu", priority=20, reads=("cpu_int4_pairs",),
                 device="cpu", needs=(CPU_EXT,), when=_contiguous_float_input)
def int4_ext_linear(x, w, bias):
    """Float32 activations: float32 compute on the exactly dequantized weight. Half-precision
    activations meet the codes as int16 codes (see int4_pairs.h), more precise than the
    reference, which rounds the weight to the activation dtype. Float8 (and, without the integer
    kernel below, int8/int4) activations are fake-quantized first, as the reference does."""
    x = w.simulate_input_quantization(x)
    return int4_linear_io(x, w.qdata, w.scale, w.block_size[-1], _in_features(w), bias, INT4_GEMV_MAX_ROWS)


# Int4Tensor with integer activations (act_dtype int8 or int4): the codes and per-token scales of
# `w.quantize_input` (the ones the reference fake-quantizes with) meet the int4 codes in exact
# integer multiply-adds (csrc/int8_int4.cpp, on the pairs layout's int16 path). Above every other
# Int4Tensor row: it is the kernel these weights are for, at any number of rows.
INT_ACT_DTYPES = (torch.int8, torch.int4)


def _int_activations(x, w) -> bool:
    return (x.dtype in FLOATS and w.act_dtype in INT_ACT_DTYPES and w.qdata.is_contiguous()
            and w.scale.is_contiguous())


def _int8_int4_out(codes, act_scale, packed, scale_zero, group_size, k, bias, dtype):
    return codes.new_empty((codes.shape[0], packed.shape[0]), dtype=dtype)


@opaque_op("int8_int4_linear_io_cpu", _int8_int4_out)
def int8_int4_linear_io(
    codes: torch.Tensor, act_scale: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
    k: int, bias: Optional[torch.Tensor], dtype: torch.dtype,
) -> torch.Tensor:
    return cpu_ext.load().int8_int4_linear_io(codes, act_scale, packed, scale_zero, group_size, k, bias, dtype)


@register_kernel("linear", "Int4Tensor", "cpu_int8_int4_ext", backend="cpu", priority=40, reads=("cpu_int4_pairs",),
                 device="cpu", needs=(CPU_EXT,), when=_int_activations)
def int8_int4_ext_linear(x, w, bias):
    k = _in_features(w)
    codes, scale = w.quantize_input(x.reshape(-1, k))
    y = int8_int4_linear_io(codes.contiguous(), scale, w.qdata, w.scale, w.block_size[-1], k, bias, x.dtype)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# ---------------------------------------------------------------------- int8
def _per_row(w) -> bool:
    # Block (1, K), read off the fields: `w.shape` through __torch_function__ is slow per call.
    return w.block_size[0] == 1 and w.scale.ndim == 2 and w.scale.shape[1] == 1


def _per_row_float_input(x, w) -> bool:
    return x.dtype in FLOATS and _per_row(w) and w.qdata.is_contiguous()


# The int8 CPU packing keeps the canonical layout and only guarantees what aten's kernel
# assumes: codes contiguous and 64-byte aligned, copied once here if they are not (a tensor
# read from a file views it at its offset in the file).
def pack_int8_aligned(w):
    return w.replace(qdata=aligned_contiguous(w.qdata), packing="cpu_int8_aligned")


def unpack_int8_aligned(w):
    return w.replace(packing=None)


register_packing(
    Packing("cpu_int8_aligned", "Int8Tensor", "cpu", 10, _per_row, pack_int8_aligned, unpack_int8_aligned,
            keeps_layout=True)
)


def _int8pack_mm_applies(x, w) -> bool:
    # With bfloat16 activations aten's kernel also needs every activation row 32-byte aligned
    # (it crashes for K % 16 != 0 at more than one row, torch 2.13); the other dtypes do not.
    return _per_row_float_input(x, w) and (x.dtype != torch.bfloat16 or w.qdata.shape[-1] % 16 == 0)


# Inductor's own lowering of this op fails on unrealized inputs (torch 2.13): under torch.compile
# it is an opaque op, which gets realized buffers.
@opaque_op("int8pack_mm_cpu", lambda x2, qdata, scale: x2.new_empty(x2.shape[0], qdata.shape[0]))
def _int8pack_mm(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # aten's kernel crashes (torch 2.13) on operands that are not aligned (the weight's codes
    # are, by their packing); an input view may not be, a fresh allocation is.
    return aten._weight_int8pack_mm(aligned_contiguous(x2), qdata, scale)


@register_kernel("linear", "Int8Tensor", "cpu_int8pack_mm", backend="cpu", priority=10, reads=("cpu_int8_aligned",),
                 device="cpu", needs=(ATEN_INT8_MM,), when=_int8pack_mm_applies)
def int8_cpu_linear(x, w, bias):
    """Weight-only and dynamic int8 alike. aten's `_int_mm` on CPU is several times slower than
    this even counting the activation round trip (measured: 5.7 ms against 0.8 ms for a
    2048x5632 weight at batch 1), so dynamic activations are quantized per token in float and
    fed to the int8-weight kernel: the same numbers the reference computes."""
    k = w.shape[1]
    x = w.simulate_input_quantization(x)
    scale = w.scale.reshape(-1).to(x.dtype)
    y = _int8pack_mm(x.reshape(-1, k).contiguous(), w.qdata, scale)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


# hf_aoq's own int8 kernel (csrc/int8.cpp). Half-precision activations (K a multiple of 32): int16
# activation codes in integer multiply-adds at every row count (INT8_GEMV_MAX_ROWS does not apply;
# at 41-512 rows 0.92-1.5x the time of dequantize + float32 GEMM in the AVX2 build on a Zen 4,
# 1.6-2.2x as fast in the AVX-512 one). Float32 activations: a float32 GEMV up to
# INT8_GEMV_MAX_ROWS (at batch 1 about as fast as aten's bf16 kernel and 10-30x its float32
# kernel), a chunked dequantize (q * scale, as the reference) + float32 GEMM above.
# The float32 GEMV's tiles (csrc/simd.h) are 4 weight rows x 6 activation rows on AVX-512 builds,
# x 1 on AVX2 (same outputs). AVX-512 (2-vCPU Xeon, 2048x5632, float32 and bf16 activations,
# medians of interleaved rounds): the tiled GEMV beat float32 dequantize + GEMM at every row count
# measured up to 48 (48 rows: 11.9 against 15.2 ms) and the AMX bf16 rows (cpu_gemm.MIN_ROWS) up
# to 32 (7.3 against 8.3 ms; 48: 11.9 against 10.5). One limit for every build, so that the AVX2
# and AVX-512 builds compute the same numbers (tests/kernels/test_cpu_isa.py); AVX2 not re-measured.
_TILED_GEMV_MAX_ROWS = 40
INT8_GEMV_MAX_ROWS = _TILED_GEMV_MAX_ROWS


@opaque_op("int8_linear_io_cpu", _linear_out)
def int8_linear_io(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                   gemv_max_rows: int) -> torch.Tensor:
    return cpu_ext.load().int8_linear_io(x, qdata, scale, bias, gemv_max_rows)


@opaque_op("int8dyn_linear_io_cpu", _linear_out)
def int8dyn_linear_io(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                      bias: Optional[torch.Tensor], gemv_max_rows: int) -> torch.Tensor:
    return cpu_ext.load().int8dyn_linear_io(x, qdata, scale, bias, gemv_max_rows)


# hf_aoq's kernel reads codes at any alignment: canonical weights (and so the aligned packing).
@register_kernel("linear", "Int8Tensor", "cpu_int8_ext", backend="cpu", priority=20, device="cpu", needs=(CPU_EXT,),
                 when=_per_row_float_input)
def int8_ext_linear(x, w, bias):
    """Weight-only and dynamic int8 alike (dynamic activations are quantized per token and
    dequantized in x's dtype first, as the reference does, inside the same C++ call), computed
    in float32; weight-only half-precision activations meet the codes as int16 codes at any
    number of rows (csrc/int8.cpp's int8_code_gemv: within half a code step of each group's
    largest |x| / 32767, more precise than the reference, which rounds the weight to x's dtype)."""
    if w.act_quant == "per_token":
        return int8dyn_linear_io(x, w.qdata, w.scale, bias, INT8_GEMV_MAX_ROWS)
    return int8_linear_io(x, w.qdata, w.scale, bias, INT8_GEMV_MAX_ROWS)


# ---------------------------------------------------------------------- float8
# The bit-trick shift of each float8 format in csrc/fp8_cpu.cpp (the kernels undo its scaling).
_FP8_SHIFT = {torch.float8_e4m3fn: 20, torch.float8_e5m2: 21}
FP8_GEMV_MAX_ROWS = _TILED_GEMV_MAX_ROWS  # above this, one upcast of the weight and a float32 GEMM win


@opaque_op("fp8_linear_io_cpu", _linear_out)
def fp8_linear_io(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, shift: int, bias: Optional[torch.Tensor],
    gemv_max_rows: int,
) -> torch.Tensor:
    return cpu_ext.load().fp8_linear_io(x, codes, scale, shift, bias, gemv_max_rows)


def _float8_cpu_applies(x, w) -> bool:
    if not w.qdata.is_contiguous():
        return False
    n, k = w.qdata.shape  # == w.shape for a contiguous (untransposed) weight; w.shape is slow
    return x.dtype in FLOATS and tuple(w.block_size) in ((1, k), (n, k))


@register_kernel("linear", "Float8Tensor", "cpu_fp8_gemv", backend="cpu", priority=10, device="cpu",
                 needs=(CPU_EXT,), when=_float8_cpu_applies)
def float8_cpu_linear(x, w, bias):
    """Float8 weights (weight-only, or dynamic with the input fake-quantized first) in float32.
    Few rows: hf_aoq's fused kernel reads the float8 weight directly. Many rows: chunks of the
    weight dequantized exactly as the reference does (about 3x faster than torch's own float8
    upcast) and float32 GEMM, several times faster than bf16 GEMM on AVX2 CPUs."""
    return fp8_linear_io(w.simulate_input_quantization(x), w.qdata, w.scale, _FP8_SHIFT[w.qdata.dtype], bias,
                         FP8_GEMV_MAX_ROWS)


# ---------------------------------------------------------------------- Int4DQTensor
# The int4 kernels of csrc/int4_pairs.h (instantiated in csrc/int4dq.cpp) with each group's
# scale and centre decoded from the 4-bit indices (gparams) and the row grid (rparams, tparams)
# as the format defines them. The codes are packed as Int4Tensor's; gparams become one flat run of
# bytes in chunks of 64 rows, each chunk's [G, rows] contiguous (int4dq_cpu_gparams), so that the
# GEMV's 64-row step reads its groups' bytes as one stream. Its paths and crossover are Int4's
# (INT4_GEMV_MAX_ROWS).


def _int4dq_packable(w) -> bool:
    return w.shape[0] % 16 == 0


def int4dq_cpu_gparams(gparams: torch.Tensor) -> torch.Tensor:
    """Canonical gparams [N, G] -> the CPU kernels' layout (csrc/int4dq.cpp, DQParams): flat
    uint8 [N * G], chunks of 64 rows in row order, each chunk [G, rows] (the last chunk holds
    the N % 64 rows left, if any)."""
    n, g = gparams.shape
    n64 = n // 64 * 64
    full = gparams[:n64].reshape(n // 64, 64, g).transpose(1, 2).reshape(-1)
    return torch.cat([full, gparams[n64:].t().reshape(-1)]).contiguous()


def int4dq_canonical_gparams(flat: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of int4dq_cpu_gparams for a weight of n rows."""
    g = flat.numel() // n
    n64 = n // 64 * 64
    full = flat[: n64 * g].reshape(n // 64, g, 64).transpose(1, 2).reshape(n64, g)
    return torch.cat([full, flat[n64 * g:].reshape(g, n - n64).t()]).contiguous()


def pack_int4dq_for_cpu(w):
    """The pairs layout, the chunked gparams, and tparams followed by the decoded row table the
    kernels read (float32 [2 + 8N]: T_d, T_c, then int4dq_cpu_rows; 32 bytes a row, 1.6% of a
    TinyLlama Int4DQ model): made once here, so that no call decodes it, eager or compiled (a
    compiled graph reads the weight's fields as they are; decoding per call, 1.0-1.5 ns a row in
    the AVX-512 build and 2.7 in the AVX2 build, made the Zen 4's compiled 22-layer TinyLlama
    decode step 3.4% (AVX2) and 8.9% (AVX-512) slower: docs/performance.md)."""
    ext = cpu_ext.load()
    qdata = ext.int4_repack_pairs(w.qdata.contiguous(), int4_padded_k(w))
    tparams = w.tparams.contiguous()
    tparams = torch.cat([tparams, ext.int4dq_cpu_rows(w.rparams.contiguous(), tparams).reshape(-1)])
    return w.replace(qdata=qdata, gparams=int4dq_cpu_gparams(w.gparams), tparams=tparams, packing="cpu_int4dq")


def unpack_int4dq_from_cpu(w):
    n, k = w.shape
    codes = pairs_int4unpack_codes(w.qdata, n, int4_padded_k(w))[:, :k]
    return w.replace(qdata=pack_int4(codes), gparams=int4dq_canonical_gparams(w.gparams, n),
                     tparams=w.tparams[:2].clone(), packing=None)


register_packing(
    Packing("cpu_int4dq", "Int4DQTensor", "cpu", 10, _int4dq_packable, pack_int4dq_for_cpu, unpack_int4dq_from_cpu,
            needs=(CPU_EXT,))
)


@opaque_op("int4dq_linear_io_cpu", _linear_out)
def int4dq_linear_io(
    x: torch.Tensor, packed: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor,
    group_size: int, k: int, bias: Optional[torch.Tensor], gemv_max_rows: int,
) -> torch.Tensor:
    return cpu_ext.load().int4dq_linear_io(x, packed, gparams, rparams, tparams, group_size, k, bias, gemv_max_rows)


@register_kernel("linear", "Int4DQTensor", "cpu_int4dq_ext", backend="cpu", priority=20, reads=("cpu_int4dq",),
                 device="cpu", needs=(CPU_EXT,), when=_float_input)
def int4dq_ext_linear(x, w, bias):
    """As the int4 kernel: float32 compute for float32 activations, int16 activation codes for
    half-precision ones. The row table comes with tparams (pack_int4dq_for_cpu)."""
    return int4dq_linear_io(x, w.qdata, w.gparams, w.rparams, w.tparams, w.block_size[-1], _in_features(w), bias,
                            INT4_GEMV_MAX_ROWS)


# Many rows with half-precision activations on CPUs with a fast bf16 GEMM (AMX, AVX512-BF16).
from . import cpu_gemm  # noqa: E402,F401
# Many rows with bf16 activations on AMX tiles, the weight dequantized panel by panel (csrc/amx_gemm.h).
from . import cpu_amx  # noqa: E402,F401
# Float8 weights at few bf16 rows on AVX512-BF16's dot products, the codes exact in bf16 (csrc/fp8.cpp).
from . import cpu_fp8_dot  # noqa: E402,F401
# Int8 weights with dynamic int8 activations in exact integer sums: AMX tiles, AVX-512 VNNI (csrc/int8dyn.cpp).
from . import cpu_int8dyn  # noqa: E402,F401
# MXFP4 weight-only at few rows (csrc/mx.cpp).
from . import cpu_mx  # noqa: E402,F401
# NVFP4 weight-only at few rows (csrc/nvfp4.cpp).
from . import cpu_nvfp4  # noqa: E402,F401
# IntxTensor (1-8 bit codes) at any rows (csrc/intx.cpp).
from . import cpu_intx  # noqa: E402,F401
# FPxTensor (sub-byte floats) at any rows (csrc/fpx.cpp).
from . import cpu_fpx  # noqa: E402,F401
# Float8SemiSparseTensor (2:4 sparse e4m3) at any rows (csrc/fp8_sparse.cpp).
from . import cpu_sparse  # noqa: E402,F401
