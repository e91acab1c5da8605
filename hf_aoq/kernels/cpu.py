"""CPU kernels: aten's int4 (tinygemm's CPU twin) and int8-weight kernels, and the int4 CPU packing."""
from __future__ import annotations

import torch

from ..core.primitives import pack_int4, unpack_int4
from . import Packing, cpu_ext, register_kernel, register_packing
from .common import scale_and_zero
from .nibbles import unpack_nibbles

aten = torch.ops.aten
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INT4_GROUP_SIZES = (32, 64, 128, 256)

HAS_INT4_CPU = hasattr(aten, "_weight_int4pack_mm_for_cpu") and hasattr(aten, "_convert_weight_to_int4pack_for_cpu")
HAS_INT8_WEIGHT_MM = hasattr(aten, "_weight_int8pack_mm")


# ---------------------------------------------------------------------- int4
def _int4pack_codes(codes: torch.Tensor) -> torch.Tensor:
    return aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1)


def _int4_cpu_available(w) -> bool:
    n, k = w.shape
    return HAS_INT4_CPU and w.block_size[-1] in INT4_GROUP_SIZES and n % 16 == 0


def pack_int4_for_cpu(w):
    """Canonical Int4Tensor -> qdata in aten's CPU int4 layout, scale as [K/g, N, 2] (scale, zero)."""
    return w.replace(qdata=_int4pack_codes(unpack_int4(w.qdata)), scale=scale_and_zero(w), packing="cpu_int4pack")


def unpack_int4_from_cpu(w):
    n, k = w.shape
    codes = unpack_nibbles(w.qdata, n, k, _int4pack_codes)
    scale = w.scale[..., 0].t().contiguous()
    return w.replace(qdata=pack_int4(codes), scale=scale, packing=None)


register_packing(
    Packing("cpu_int4pack", "Int4Tensor", "cpu", 10, _int4_cpu_available, pack_int4_for_cpu, unpack_int4_from_cpu)
)


def _int4_cpu_applies(x, w) -> bool:
    return w.packing == "cpu_int4pack" and x.device.type == "cpu" and x.dtype in FLOATS


@register_kernel("linear", "Int4Tensor", "cpu_int4pack_mm", backend="cpu", priority=10, applies=_int4_cpu_applies)
def int4_cpu_linear(x, w, bias):
    k = w.shape[1]
    x2 = x.reshape(-1, k).contiguous()
    sz = w.scale if w.scale.dtype == x.dtype else w.scale.to(x.dtype)
    y = aten._weight_int4pack_mm_for_cpu(x2, w.qdata, w.block_size[-1], sz)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


# ---------------------------------------------------------------------- int8
def _per_row(w) -> bool:
    return tuple(w.block_size) == (1, w.shape[1])


def _int8_cpu_applies(x, w) -> bool:
    return HAS_INT8_WEIGHT_MM and x.device.type == "cpu" and _per_row(w) and x.dtype in FLOATS


def _int8pack_mm(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    if x2.data_ptr() % 64:
        # aten's kernel crashes (torch 2.13) on an input that is not 4-byte aligned, such as a
        # view into a tensor read from a file; a fresh allocation is always aligned.
        x2 = x2.clone()
    return aten._weight_int8pack_mm(x2, qdata, scale)


@torch.library.custom_op("hf_aoq::int8pack_mm", mutates_args=())
def _int8pack_mm_opaque(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return _int8pack_mm(x2, qdata, scale)


@_int8pack_mm_opaque.register_fake
def _(x2, qdata, scale):
    return x2.new_empty(x2.shape[0], qdata.shape[0])


@register_kernel("linear", "Int8Tensor", "cpu_int8pack_mm", backend="cpu", priority=10, applies=_int8_cpu_applies)
def int8_cpu_linear(x, w, bias):
    """Weight-only and dynamic int8 alike. aten's `_int_mm` on CPU is several times slower than
    this even counting the activation round trip (measured: 5.7 ms against 0.8 ms for a
    2048x5632 weight at batch 1), so dynamic activations are quantized per token in float and
    fed to the int8-weight kernel: the same numbers the reference computes."""
    k = w.shape[1]
    x = w.simulate_input_quantization(x)
    scale = w.scale.reshape(-1).to(x.dtype)
    # Inductor's own lowering of this op fails on unrealized inputs (torch 2.13); an opaque
    # custom op makes it pass realized buffers. Eager calls aten directly, without the wrapper.
    mm = _int8pack_mm_opaque if torch.compiler.is_compiling() else _int8pack_mm
    y = mm(x.reshape(-1, k).contiguous(), w.qdata, scale)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


# ---------------------------------------------------------------------- float8
# float32 value of a float8 code placed by the bit trick in csrc/fp8_cpu.cpp, relative to its
# true value: 2^-(127 - exponent bias).
_FP8_SHIFT_AND_FACTOR = {torch.float8_e4m3fn: (20, 2.0**120), torch.float8_e5m2: (21, 2.0**112)}
FP8_GEMV_MAX_ROWS = 16  # above this, one upcast of the weight and a float32 GEMM win


@torch.library.custom_op("hf_aoq::fp8_linear_cpu", mutates_args=())
def fp8_linear_cpu(x2: torch.Tensor, codes: torch.Tensor, row_scale: torch.Tensor, shift: int) -> torch.Tensor:
    return cpu_ext.load().fp8_linear(x2, codes, row_scale, shift)


@fp8_linear_cpu.register_fake
def _(x2, codes, row_scale, shift):
    return x2.new_empty(x2.shape[0], codes.shape[0])


def _float8_cpu_applies(x, w) -> bool:
    n, k = w.shape
    return (
        x.device.type == "cpu"
        and x.dtype in FLOATS
        and tuple(w.block_size) in ((1, k), (n, k))
        and w.qdata.is_contiguous()
        and cpu_ext.available()
    )


@register_kernel("linear", "Float8Tensor", "cpu_fp8_gemv", backend="cpu", priority=10, applies=_float8_cpu_applies)
def float8_cpu_linear(x, w, bias):
    """Float8 weights (weight-only, or dynamic with the input fake-quantized first) in float32.
    Few rows: hf_aoq's fused kernel reads the float8 weight directly. Many rows: upcast once
    and use float32 GEMM, several times faster than bf16 GEMM on AVX2 CPUs."""
    n, k = w.shape
    x = w.simulate_input_quantization(x)
    x2 = x.reshape(-1, k).float().contiguous()
    if x2.shape[0] <= FP8_GEMV_MAX_ROWS:
        shift, factor = _FP8_SHIFT_AND_FACTOR[w.qdata.dtype]
        row_scale = (w.scale.float().reshape(-1) * factor).expand(n).contiguous()
        y = fp8_linear_cpu(x2, w.qdata.view(torch.uint8), row_scale, shift)
    else:
        y = x2 @ w.dequantize(torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], n)
