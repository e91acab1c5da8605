"""Many-row CPU linears for bf16 activations where aten's bf16 GEMM runs on AMX: hf_aoq's C++ code
dequantizes the weight into bf16, then aten's GEMM (oneDNN, on AMX) multiplies.

The numbers are the reference kernel's, bit for bit: the reference dequantizes in float32, rounds
once to the activation dtype and calls F.linear; the C++ `*_dequantize` functions produce the same
weight bits (tests/kernels/test_cpu_isa.py checks equality), and the same F.linear call follows. The whole
weight is dequantized (not chunk by chunk into per-thread GEMMs): the same single GEMM call as the
reference is what makes the outputs equal.

Measured on a 2-vCPU Xeon with AMX (scripts/bench_kernels.py, 2048x5632, bf16, 256 rows, a quiet
moment): dense bf16 3.5 ms, hf_aoq's int16-code int4 kernel 27 ms, float32 dequantize + GEMM
17-19 ms for int8 and float8; with these rows 0.3-0.4x those times (README's CPU kernel section).
Below `MIN_ROWS` rows the weight-streaming kernels of cpu.py win (decode is bandwidth: writing and
reading a whole bf16 copy of the weight costs more than the int kernels' one pass over the codes)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import rows as _rows
from . import cpu_ext, cpu_isa
from .cpu import _FP8_SHIFT, CPU_EXT, _float8_cpu_applies, _in_features, _per_row
from .registry import capability, opaque_op, register_kernel

# bfloat16 only: float16 GEMMs have no AMX here (AMX-FP16 is a later CPU), and measured slower than
# float32 ones (2048x5632, 256 rows: dense fp16 0.90x dense fp32 time, 4.0x dense bf16).
HALF = (torch.bfloat16,)

# Only where aten's bf16 GEMM runs on AMX: with oneDNN held to AVX512-BF16 on the same machine
# (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16), dequantize + GEMM lost at every row count measured
# (2048x5632, 16-128 rows: int4 1.6-5.5x the int16-code kernel's time, int8 and float8 1.2-1.5x
# their float32 paths), so no AVX512-BF16 rows.
BF16_GEMM_AMX = capability("cpu:bf16_gemm_amx", "cpu", lambda device: cpu_isa.bf16_gemm_isa() == "amx")

# Fewest activation rows at which dequantize + GEMM beats the weight-streaming kernels, per format;
# measured (ratios of medians within interleaved rounds, 2048x5632 and 5632x2048, bf16) on a busy
# 2-vCPU Xeon with AMX. int4 against the int16-code kernel (AVX-512 VNNI build): new/old 1.1-1.7
# at 32-48 rows, 0.8-1.1 at 64, 0.5 at 128, 0.4 at 256. int8 and float8 against their GEMVs (up to
# 8 and 16 rows) and float32 dequantize + GEMM above: 1.5-2.8 at 8 rows, 0.6-0.95 at 16, 0.3 at 256.
# Against the tiled int8/float8 GEMVs (4 x 6 register tiles, kernels/cpu.py): 2.9-3.7 at 8 rows,
# 2.5 at 16, 1.1-1.15 at 32, 0.88-0.9 at 48, so they start at 40 (the GEMVs' limit there).
MIN_ROWS = {"int4": 96, "int8": 40, "fp8": 40}


def _many_bf16_rows(fmt):
    def when(x, w) -> bool:
        return x.dtype in HALF and _rows(x) >= MIN_ROWS[fmt]
    return when


def _weight_fake(*args):
    # Every *_dequantize op's fake: [N, k] in the requested dtype (the last two arguments).
    packed, k, dtype = args[0], args[-2], args[-1]
    return packed.new_empty((packed.shape[0], k), dtype=dtype)


@opaque_op("int4_dequantize_cpu", _weight_fake)
def int4_dequantize(packed: torch.Tensor, scale_zero: torch.Tensor, group_size: int, k: int,
                    dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().int4pack_dequantize(packed, scale_zero, group_size, k, dtype)


@opaque_op("int4dq_dequantize_cpu", _weight_fake)
def int4dq_dequantize(packed: torch.Tensor, gparams_t: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor,
                      group_size: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().int4dq_dequantize(packed, gparams_t, rparams, tparams, group_size, k, dtype)


@opaque_op("int8_dequantize_cpu", _weight_fake)
def int8_dequantize(q: torch.Tensor, scale: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().int8_dequantize(q, scale, dtype)


@opaque_op("fp8_dequantize_cpu", _weight_fake)
def fp8_dequantize(codes: torch.Tensor, scale: torch.Tensor, shift: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    return cpu_ext.load().fp8_dequantize(codes, scale, shift, dtype)


def _linear(x, weight, bias):
    # The reference's call: F.linear in x's dtype, the bias cast to it.
    return F.linear(x, weight, None if bias is None else bias.to(x.dtype))


def _int4(x, w, bias):
    x = w.simulate_input_quantization(x)
    return _linear(x, int4_dequantize(w.qdata, w.scale, w.block_size[-1], _in_features(w), x.dtype), bias)


def _int4dq(x, w, bias):
    weight = int4dq_dequantize(w.qdata, w.gparams, w.rparams, w.tparams, w.block_size[-1], _in_features(w), x.dtype)
    return _linear(x, weight, bias)


def _int8(x, w, bias):
    x = w.simulate_input_quantization(x)
    return _linear(x, int8_dequantize(w.qdata, w.scale, w.qdata.shape[1], x.dtype), bias)


def _fp8(x, w, bias):
    x = w.simulate_input_quantization(x)
    codes = w.qdata
    scale = w.scale.reshape(-1).float().expand(codes.shape[0]).contiguous()
    return _linear(x, fp8_dequantize(codes.view(torch.uint8), scale, _FP8_SHIFT[codes.dtype], codes.shape[1], x.dtype),
                   bias)


def _contiguous(*tensors) -> bool:
    return all(t.is_contiguous() for t in tensors)


_NEEDS = (CPU_EXT, BF16_GEMM_AMX)
_int4_rows, _int8_rows, _fp8_rows = (_many_bf16_rows(f) for f in ("int4", "int8", "fp8"))
register_kernel("linear", "Int4Tensor", "cpu_int4_amx_gemm", backend="cpu", priority=30, reads=("cpu_int4_pairs",),
                device="cpu", needs=_NEEDS, when=lambda x, w: _int4_rows(x, w) and _contiguous(w.qdata, w.scale))(_int4)
register_kernel("linear", "Int4DQTensor", "cpu_int4dq_amx_gemm", backend="cpu", priority=30, reads=("cpu_int4dq",),
                device="cpu", needs=_NEEDS, when=lambda x, w: _int4_rows(x, w) and _contiguous(w.qdata, w.gparams))(_int4dq)
register_kernel("linear", "Int8Tensor", "cpu_int8_amx_gemm", backend="cpu", priority=30, device="cpu", needs=_NEEDS,
                when=lambda x, w: _int8_rows(x, w) and _per_row(w) and w.qdata.is_contiguous())(_int8)
register_kernel("linear", "Float8Tensor", "cpu_fp8_amx_gemm", backend="cpu", priority=20, device="cpu", needs=_NEEDS,
                when=lambda x, w: _fp8_rows(x, w) and _float8_cpu_applies(x, w))(_fp8)
