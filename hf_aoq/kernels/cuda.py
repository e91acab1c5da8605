"""CUDA kernels: tinygemm int4, `_int_mm` int8, `_scaled_mm` float8, and the tinygemm packing.

Written against aten's documented contracts and kept honest on CPU-only machines by the shared
reference kernels: every test that runs these compares them with `reference.py` on a GPU.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.primitives import pack_int4, unpack_int4
from .common import INT4_GROUP_SIZES, int4_padded_k, pad_input, pad_int4_codes, quantize_int8_per_token, scale_and_zero
from .nibbles import unpack_nibbles
from .registry import Packing, capability, register_kernel, register_packing

aten = torch.ops.aten


def _sm_at_least(version: tuple[int, int]):
    return lambda device: torch.cuda.get_device_capability(device) >= version


# Compute capabilities, probed once per GPU (see registry.capable).
SM80 = capability("cuda:sm80", "cuda", _sm_at_least((8, 0)))  # tinygemm
SM89 = capability("cuda:sm89", "cuda", _sm_at_least((8, 9)))  # float8 _scaled_mm


def _pad_rows(x2: torch.Tensor, multiple: int, minimum: int = 0) -> tuple[torch.Tensor, int]:
    m = x2.shape[0]
    target = max(-(-m // multiple) * multiple, minimum)
    return (F.pad(x2, (0, 0, 0, target - m)) if target != m else x2), m


# ---------------------------------------------------------------------- int4 (tinygemm)
def _inner_k_tiles(k: int) -> int:
    for tiles in (8, 4, 2):
        if k % (tiles * 16) == 0:
            return tiles
    return 0


def _tinygemm_pack_fn(k: int):
    tiles = _inner_k_tiles(k)

    def pack(codes: torch.Tensor) -> torch.Tensor:
        # tinygemm reads each byte high nibble first.
        codes = codes.to(torch.uint8)
        return aten._convert_weight_to_int4pack((codes[:, 0::2] << 4) | codes[:, 1::2], tiles)

    return pack


def _tinygemm_available(w) -> bool:
    n, k = w.shape
    return w.block_size[-1] in INT4_GROUP_SIZES and n % 8 == 0 and _inner_k_tiles(int4_padded_k(w)) > 0


def pack_int4_for_tinygemm(w):
    kp = int4_padded_k(w)
    packed = _tinygemm_pack_fn(kp)(pad_int4_codes(unpack_int4(w.qdata), kp))
    # scale_and_zero keeps the canonical scale dtype so that unpacking is exact; the kernel
    # casts to bf16, which tinygemm requires.
    return w.replace(qdata=packed, scale=scale_and_zero(w), packing="cuda_tinygemm")


def unpack_int4_from_tinygemm(w):
    n, k = w.shape
    kp = int4_padded_k(w)
    codes = unpack_nibbles(w.qdata, n, kp, _tinygemm_pack_fn(kp))[:, :k]
    return w.replace(qdata=pack_int4(codes), scale=w.scale[..., 0].t().contiguous(), packing=None)


register_packing(
    Packing("cuda_tinygemm", "Int4Tensor", "cuda", 10, _tinygemm_available, pack_int4_for_tinygemm,
            unpack_int4_from_tinygemm, needs=(SM80,))
)


def _bf16_input(x, w) -> bool:
    return x.dtype == torch.bfloat16


@register_kernel("linear", "Int4Tensor", "cuda_tinygemm", backend="cuda", priority=10, reads=("cuda_tinygemm",),
                 device="cuda", needs=(SM80,), when=_bf16_input)
def int4_tinygemm_linear(x, w, bias):
    k = w.shape[1]
    sz = w.scale if w.scale.dtype == torch.bfloat16 else w.scale.to(torch.bfloat16)
    x2 = pad_input(x.reshape(-1, k), int4_padded_k(w)).contiguous()
    y = aten._weight_int4pack_mm(x2, w.qdata, w.block_size[-1], sz)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


# ---------------------------------------------------------------------- int8 dynamic (_int_mm)
def _int_mm_applies(x, w) -> bool:
    n, k = w.shape
    return w.act_quant == "per_token" and tuple(w.block_size) == (1, k) and k % 8 == 0 and n % 8 == 0


@register_kernel("linear", "Int8Tensor", "cuda_int_mm", backend="cuda", priority=10, device="cuda", when=_int_mm_applies)
def int8_dynamic_cuda_linear(x, w, bias):
    k = w.shape[1]
    xq, x_scale = quantize_int8_per_token(x.reshape(-1, k))
    # _int_mm needs more than 16 rows; padding rows cost nothing next to the weight read.
    xq, m = _pad_rows(xq, 8, minimum=32)
    acc = torch._int_mm(xq, w.qdata.t())[:m]
    y = acc.float() * x_scale * w.scale.reshape(1, -1).float()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


# ---------------------------------------------------------------------- float8 dynamic (_scaled_mm)
def _scaled_mm_applies(x, w) -> bool:
    n, k = w.shape
    if not (w.act_quant is not None and k % 16 == 0 and n % 16 == 0):
        return False
    if w.act_quant == "per_row":
        return tuple(w.block_size) == (1, k) and x.dtype == torch.bfloat16
    return tuple(w.block_size) == (n, k)


@register_kernel("linear", "Float8Tensor", "cuda_scaled_mm", backend="cuda", priority=10, device="cuda",
                 needs=(SM89,), when=_scaled_mm_applies)
def float8_dynamic_cuda_linear(x, w, bias):
    n, k = w.shape
    x2 = x.reshape(-1, k)
    xq, x_scale = w.quantize_input(x2)
    xq, m = _pad_rows(xq, 16)
    if x_scale.numel() > 1:
        x_scale, _ = _pad_rows(x_scale, 16)
        x_scale = x_scale.clamp(min=1e-12)
    w_scale = w.scale.float().reshape(1, -1) if w.act_quant == "per_row" else w.scale.float().reshape(())
    x_scale = x_scale.float() if x_scale.numel() > 1 else x_scale.float().reshape(())
    out_dtype = x.dtype if x.dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16
    y = torch._scaled_mm(xq, w.qdata.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=out_dtype)[:m]
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], n)
