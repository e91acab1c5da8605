"""Many-row CPU linears for bf16 activations on hf_aoq's panel GEMM (csrc/amx_gemm.h): each block of 32
output columns is dequantized into a small bf16 panel and multiplied from it, so the weight is read
once in its own bytes and no whole bf16 copy is made. Two engines run the multiply: AMX tiles
(rows `cpu_<format>_amx`, where AMX-BF16 is granted) and AVX512-BF16's dot products (rows
`cpu_<format>_avx512bf16`, where AVX512-BF16 runs without AMX: AMD EPYC Zen 4 and Zen 5). Int4,
Int4DQ, Int8 and Float8 weights, and Intx / IntxDQ bit streams (csrc/intx.cpp's panel). Int8
weights with dynamic int8 activations multiply in integers instead (cpu_int8dyn.py).

The weight's bf16 values are the reference's `dequantize(bfloat16)`, bit for bit (a float32 value
below 2^-126 becomes zero, which both multiplies read as zero anyway); the products are summed in
float32 in the engine's order and each output rounded once to bf16, so the outputs agree with the
reference kernel (the same weight through aten's GEMM) within float32 accumulation
(tests/kernels/test_cpu_amx.py, on each engine the machine allows). Above cpu_gemm.py's rows
(dequantize the whole weight into bf16, then aten's GEMM), which remain for the shapes the panels
do not take.

Measured on a 2-vCPU Xeon with AMX (5632x2048 / 2048x5632, 2 threads, medians of 11 interleaved
rounds on a noisy host, as a multiple of dense bf16 F.linear's time; docs/performance.md): at 256
rows int4 g128 0.85 / 1.00, Int4DQ g32 0.79 / 1.02, int8 0.89 / 1.22, float8 0.89 / 1.22, against
1.5-1.85 for dequantize + aten's GEMM (cpu_gemm.py). The tile loop alone took 0.54-0.67 of dense
bf16's time at 256 rows (oneDNN's bf16 GEMM runs ~0.8-0.9 TFLOP/s per core there, the tiles
~1.2); the rest is writing the panels. On a 2-core AMD EPYC Zen 4 (no AMX), the dot products at
256 rows: int4 1.00 / 1.02, Int4DQ 0.99 / 1.00, int8 1.01 / 1.02, float8 1.02 / 1.01, against
1.09-1.22 for dequantize + aten's GEMM (MIN_ROWS_AVX512_BF16's comment).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from . import cpu_ext, cpu_intx, cpu_isa
from .common import rows as _rows
from .cpu import _FP8_SHIFT, CPU_EXT, _float8_cpu_applies, _in_features, _per_row
from .registry import capability, opaque_op, register_kernel


def _amx_kernels(device) -> bool:
    # The CPU and the OS allow AMX (cpu_isa), and the extension was built with the AMX kernels
    # (the avx512 build) and got the tile state from Linux.
    if not cpu_isa.amx_bf16_allowed() or not cpu_ext.available():
        return False
    return bool(cpu_ext.load().amx_available())


AMX = capability("cpu:amx_kernels", "cpu", _amx_kernels)
AMX_INT8 = capability("cpu:amx_int8_kernels", "cpu", lambda device: cpu_isa.amx_int8_allowed() and _amx_kernels(device))


def _avx512_bf16_kernels(device) -> bool:
    # AVX512-BF16 without AMX (where AMX is, its tiles take these rows), and the extension's
    # avx512 build, which has the dot-product engine.
    return cpu_isa.bf16_gemm_isa() == "avx512_bf16" and cpu_ext.available() and cpu_ext.chosen_isa() == "avx512"


AVX512_BF16 = capability("cpu:avx512_bf16_panel_kernels", "cpu", _avx512_bf16_kernels)

# Fewest bf16 activation rows at which the tile GEMM beats the weight-streaming kernels of cpu.py
# (same run as above, tile / streaming kernel, both shapes): int4 g128 0.67/0.76 against 0.54/0.61
# at 12 rows, 0.63/0.62 against 0.80/0.77 at 16; Int4DQ g32 0.70/0.77 against 0.55/0.59 at 8,
# 0.82/0.73 against 0.84/0.92 at 12; int8 0.87/0.77 against 0.85/0.91 at 8, 0.90/0.81 against
# 1.06/1.19 at 12; float8 0.95/0.74 against 1.00/1.03 at 8. Int8 and float8 again after the
# panel writer's prefetch of the next block's rows (RowScalePanel), same machine, 2048x5632 /
# 5632x2048, ms: int8 tiles 0.92/0.87 against the GEMV's 0.85/0.79 at 6 rows, 0.94/0.88 against
# 1.44/1.15 at 7 (past one register tile of activation rows, simd.h kTileRows = 6, the GEMV
# widens each chunk into a buffer and slows by half); float8 tiles 3.59/3.53 at 6 and 7 rows
# against the GEMV's 3.16/3.15 at 6 and 3.82/3.65 at 7 (random codes, many of them subnormal, so
# slow in absolute terms). Both from 7 rows.
# Intx (3-bit asymmetric codes in groups of 32) and IntxDQ (3-bit, groups of 32) against
# cpu_intx.py's GEMV, 5632x2048, 2 threads, best of 15, ms (tiles / GEMV): Intx 1.53 / 1.29 at 8
# rows, 1.50 / 2.26 at 12; IntxDQ 1.82 / 1.56 at 12, 1.79 / 2.61 at 16; at 128 rows IntxDQ 2.87
# against 4.24 for dequantize + aten's AMX GEMM (cpu_intx.py's bf16 GEMM row), dense bf16 1.63.
# Again after the Intx panel writer decoded 16 codes a vector with each row's group parameters
# made first (2026-12-05, weights from DRAM, 24 copies cycled, 2 threads, 3-bit codes in groups of
# 32, us, 2048x5632 / 5632x2048, tiles / GEMV): IntxDQ 1121 / 811 and 1093 / 1132 at 6 rows,
# 1139 / 1214 and 1061 / 1169 at 8, tiles 1145 / 1247 at 16 (the GEMV 2795 / 2329; the tiles took
# 2640-2824 before); Intx (int3, asymmetric) 1009 / 1010 and 980 / 917 at 6 rows, 1007 / 1392 and
# 1018 / 1227 at 8. Both from 7 rows.
MIN_ROWS = {"int4": 16, "int4dq": 12, "int8": 7, "fp8": 7, "intx": 7, "intxdq": 7}
# The same rows on AVX512-BF16's dot products, where AMX is not (2-core AMD EPYC Zen 4, 2 threads,
# 12 weights cycled from DRAM, medians of 7 alternated rounds, the dot-product row's time over the
# streaming kernel's, 5632x2048 / 2048x5632; a noisy host): int4 g128 1.25 / 1.43 at 24 rows, 0.93 /
# 1.18 at 32, 0.86 / 0.98 at 48; Int4DQ g32 0.88 / 1.19 at 16, 0.92 / 0.98 at 24, 0.68 / 0.67 at 32;
# int8 0.95 / 1.38 at 16, 0.87 / 0.96 at 24, 0.77 / 0.67 at 32; float8 0.69 / 1.22 at 8, 0.47 / 0.78
# at 16; Intx (int3 g32 asymmetric) 0.83 / 1.12 at 8, 0.40 / 0.58 at 16; IntxDQ (int3 g32) 0.80 /
# 0.95 at 8, 0.44 / 0.47 at 16. Where the weight is A (int8, float8, Intx, IntxDQ) a block
# multiplies 16 activation rows at 9-16 rows and 32 at 17-32 (8 at 1-8, below); where x is A (int4,
# Int4DQ) only the rows there are, rounded up to 4 (amx_gemm.h dot_block; 1.3-1.5x faster than
# whole blocks at 8 and 20 rows, the same at 16 and 32), and measured again after that change the
# same way (five rounds): Int4DQ 1.01 / 1.05 at 12, 0.83 / 0.95 at 16, 0.78 / 0.86 at 20, so from 16
# rows now (24 before); int4 g128 1.12 / 1.19 at 24, 1.08 / 1.16 at 32, 1.02 / 0.90 at 40, still 40.
# Where the weight is A, a block of at most 8 rows now multiplies 8 (256-bit dot products, the
# same bits; float8's panel 1.27-1.31x as fast at 2-8 rows), and measured again: float8 0.72 / 0.84
# at 7 rows, 0.71 / 0.74 at 8, 1.19 / 1.27 at 6, so from 7 (12 before); Intx 0.81 / 1.15 at 5,
# 0.74 / 0.84 at 6, 0.76 / 0.70 at 8, so from 6 (12 before); IntxDQ 0.61 / 1.03 at 8, 0.95 / 1.03 at
# 6, still 8.
# After the Intx GEMV's block step was inlined (1.3-1.6x as fast at 1-16 rows for 3-bit codes;
# docs/performance.md, "The Intx GEMV's block step inlined"), again (7 rounds, GEMV / panel time):
# IntxDQ 3-bit 0.73 at 6 rows, 0.91-0.92 at 8, 0.95-1.00 at 10, 1.31 at 12; 2-bit 0.84-0.99 at 6,
# 1.17-1.34 at 8; Intx 3-bit 0.86-0.89 at 6, 0.95-1.14 at 8; 2-bit 0.82-1.05 at 6. One threshold per
# format serves both widths, so Intx stays at 6 and IntxDQ at 8.
# After the Intx panel's writer took each group's values from a table (1.15-1.4x as fast at 8-16
# rows; docs/performance.md, "The Intx panel's writer"), GEMV / panel time: IntxDQ 3-bit 0.94 at
# 7 rows, 1.25 at 8 (0.89 / 0.98 at 7 / 8 on 2048x5632); 2-bit 0.96 at 5, 1.05 at 6; Intx 3-bit
# 0.90 at 7, 0.99 at 8; 2-bit 0.90 at 5, 1.09 at 6. Unchanged.
# Above these rows they also beat dequantize + aten's bf16 GEMM (cpu_gemm.py; below them in the
# table): at 48 rows int8 0.61 / 0.73 and float8 0.52 / 0.62 of its time; at 256 rows, as a
# multiple of dense bf16 F.linear's time, int4 1.00 / 1.02 against 1.22 / 1.17, Int4DQ 0.99 / 1.00
# against 1.22 / 1.21, int8 1.01 / 1.02 against 1.14 / 1.09, float8 1.02 / 1.01 against 1.14 / 1.14.
MIN_ROWS_AVX512_BF16 = {"int4": 40, "int4dq": 16, "int8": 24, "fp8": 7, "intx": 6, "intxdq": 8}


def _out(x, qdata, *rest):
    """The fake of every `*_amx_linear` op: [M, N] bf16."""
    return x.new_empty((x.shape[0], qdata.shape[0]))


@opaque_op("int4_amx_linear_cpu", _out)
def int4_amx_linear(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int,
                    bias: Optional[torch.Tensor], tiles: bool) -> torch.Tensor:
    return cpu_ext.load().int4pack_amx_linear(x, packed, scale_zero, group_size, bias, tiles)


@opaque_op("int4dq_amx_linear_cpu", _out)
def int4dq_amx_linear(x: torch.Tensor, packed: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor,
                      tparams: torch.Tensor, group_size: int, bias: Optional[torch.Tensor], tiles: bool) -> torch.Tensor:
    return cpu_ext.load().int4dq_amx_linear(x, packed, gparams, rparams, tparams, group_size, bias, tiles)


@opaque_op("int8_amx_linear_cpu", _out)
def int8_amx_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor,
                    bias: Optional[torch.Tensor], tiles: bool) -> torch.Tensor:
    return cpu_ext.load().int8_amx_linear(x, qdata, scale, bias, tiles)


@opaque_op("fp8_amx_linear_cpu", _out)
def fp8_amx_linear(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, shift: int,
                   bias: Optional[torch.Tensor], tiles: bool) -> torch.Tensor:
    return cpu_ext.load().fp8_amx_linear(x, codes, scale, shift, bias, tiles)


@opaque_op("intx_amx_linear_cpu", _out)
def intx_amx_linear(x: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: Optional[torch.Tensor],
                    bits: int, group_size: int, bias: Optional[torch.Tensor], tiles: bool) -> torch.Tensor:
    return cpu_ext.load().intx_amx_linear(x, qdata, scale, zero, bits, group_size, bias, tiles)


@opaque_op("intxdq_amx_linear_cpu", _out)
def intxdq_amx_linear(x: torch.Tensor, qdata: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor,
                      tparams: torch.Tensor, bits: int, group_size: int, bias: Optional[torch.Tensor],
                      tiles: bool) -> torch.Tensor:
    return cpu_ext.load().intxdq_amx_linear(x, qdata, gparams, rparams, tparams, bits, group_size, bias, tiles)


def _many_bf16_rows(fmt, min_rows):
    def when(x, w) -> bool:
        # N and K multiples of 32 (the tiles); read off the fields, not w.shape (slow per call).
        n, k = w.qdata.shape[0], _in_features(w)
        return x.dtype == torch.bfloat16 and _rows(x) >= min_rows[fmt] and n % 32 == 0 and k % 32 == 0
    return when


def _apply(x, k, kernel, *args):
    y = kernel(x.reshape(-1, k), *args)
    return y.reshape(*x.shape[:-1], y.shape[-1])


# The bf16 rows, each format's function taking `tiles`: AMX tiles (True) or AVX512-BF16's dot
# products (False); registered below once per engine.
def _int4(x, w, bias, tiles=True):
    x = w.simulate_input_quantization(x)
    return _apply(x, _in_features(w), int4_amx_linear, w.qdata, w.scale, w.block_size[-1], bias, tiles)


def _int4dq(x, w, bias, tiles=True):
    return _apply(x, _in_features(w), int4dq_amx_linear, w.qdata, w.gparams, w.rparams, w.tparams, w.block_size[-1],
                  bias, tiles)


def _int8(x, w, bias, tiles=True):
    x = w.simulate_input_quantization(x)
    return _apply(x, _in_features(w), int8_amx_linear, w.qdata, w.scale, bias, tiles)


def fp8_operands(w):
    """A Float8Tensor's codes as bytes, its scale as float32 [N] (one per row, a per-tensor scale
    repeated) and the codes' bit-trick shift: what the float8 C++ entry points take."""
    codes = w.qdata
    scale = w.scale.reshape(-1).float().expand(codes.shape[0]).contiguous()
    return codes.view(torch.uint8), scale, _FP8_SHIFT[codes.dtype]


def _fp8(x, w, bias, tiles=True):
    x = w.simulate_input_quantization(x)
    return _apply(x, _in_features(w), fp8_amx_linear, *fp8_operands(w), bias, tiles)


# IntxTensor and IntxDQTensor: their bit streams decoded 32 rows at a time into bf16 panels
# (csrc/intx.cpp IntxRowsPanel; groups of a multiple of 16 columns).
def _intx_groups_fit(w) -> bool:
    return w.block_size[-1] % 16 == 0


def _intx(x, w, bias, tiles=True):
    x = w.simulate_input_quantization(x)
    return _apply(x, _in_features(w), intx_amx_linear, w.qdata, w.scale, w.zero, w.bits, w.block_size[-1], bias,
                  tiles)


def _intxdq(x, w, bias, tiles=True):
    return _apply(x, _in_features(w), intxdq_amx_linear, w.qdata, w.gparams, w.rparams, w.tparams, w.bits,
                  w.block_size[-1], bias, tiles)


FUNCTIONS = {"int4": _int4, "int4dq": _int4dq, "int8": _int8, "fp8": _fp8, "intx": _intx, "intxdq": _intxdq}


def _register_engine(suffix: str, capability_: object, min_rows: dict, tiles: bool, offset: int) -> None:
    """The six bf16 rows on one engine: kernels named cpu_<format>_<suffix>, taken from min_rows[format]
    rows, where capability_ holds. offset lowers the priority (an engine below another that may
    hold on the same machine)."""
    rows = {f: _many_bf16_rows(f, min_rows) for f in FUNCTIONS}
    conditions = {
        "int4": ("Int4Tensor", 35, ("cpu_int4_pairs",),
                 lambda x, w: rows["int4"](x, w) and w.qdata.is_contiguous() and w.scale.is_contiguous()),
        "int4dq": ("Int4DQTensor", 35, ("cpu_int4dq",),
                   lambda x, w: rows["int4dq"](x, w) and w.qdata.is_contiguous() and w.gparams.is_contiguous()),
        "int8": ("Int8Tensor", 35, None, lambda x, w: rows["int8"](x, w) and _per_row(w) and w.qdata.is_contiguous()),
        "fp8": ("Float8Tensor", 25, None, lambda x, w: rows["fp8"](x, w) and _float8_cpu_applies(x, w)),
        "intx": ("IntxTensor", 35, None,
                 lambda x, w: rows["intx"](x, w) and cpu_intx._fields_fit(w) and _intx_groups_fit(w)),
        "intxdq": ("IntxDQTensor", 35, cpu_intx.DQ_READS,
                   lambda x, w: rows["intxdq"](x, w) and cpu_intx._dq_fields_fit(w) and _intx_groups_fit(w)),
    }
    for fmt, (type_name, priority, reads, when) in conditions.items():
        extra = {"reads": reads} if reads else {}
        fn = functools.partial(FUNCTIONS[fmt], tiles=tiles)
        register_kernel("linear", type_name, f"cpu_{fmt}_{suffix}", backend="cpu", priority=priority - offset,
                        device="cpu", needs=(CPU_EXT, capability_), when=when, **extra)(fn)


_register_engine("amx", AMX, MIN_ROWS, tiles=True, offset=0)
_register_engine("avx512bf16", AVX512_BF16, MIN_ROWS_AVX512_BF16, tiles=False, offset=1)
