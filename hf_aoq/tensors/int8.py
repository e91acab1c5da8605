"""Int8Tensor: symmetric 8-bit weights per row or per group, weight-only or with dynamic
per-token int8 activations.

Canonical layout (what is saved; 3-D fused experts [E, N, K] put E in front of every field):
    qdata      int8 [N, K]        codes in [-127, 127]
    scale      float32 [N, K/g]   g = K for per row;  w = q * scale
    act_quant  None (weight-only) or "per_token" (activations quantized at run time)

The CPU packing ("cpu_int8_aligned", made by `place()`) keeps this layout with the codes
contiguous and 64-byte aligned, which aten's CPU int8 kernel needs.
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError
from ..core.primitives import by_row_chunks, choose_qparams_affine, dequantize_affine, quantize_affine
from ..core.registry import register_tensor_type
from ..kernels.common import quantize_int8_per_token
from .common import BlockGridTensor, DevicePacked, check_built, check_grid_fields, check_layout, check_weight
from .experts import quantize_experts

QMIN, QMAX = -127, 127
ACT_QUANTS = (None, "per_token")


def _fp16_scale(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales rounded to the nearest fp16 value, kept within fp16's normal range (a
    rounding down clips the block's largest value by under half an fp16 step)."""
    tiny = torch.finfo(torch.float16).tiny
    return torch.where(scale > 0, scale.clamp(tiny, torch.finfo(torch.float16).max), scale).to(torch.float16).float()


@register_tensor_type
class Int8Tensor(DevicePacked, BlockGridTensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("block_size", "shape", "dtype")
    optional_tensor_attribute_names = ("act_quant", "packing")
    schema_version = 1
    transposable = True

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        group_size: int | None = None,
        act_quant: str | None = None,
        *,
        scale_dtype: torch.dtype | None = None,
        name: str = "weight",
        qparams: str = "minmax",
    ):
        """Quantize a float [N, K] weight per row (or in groups of `group_size` along K).
        `scale_dtype` torch.float16 chooses scales that fp16 holds exactly (each rounded to fp16
        before the codes are chosen; still stored as float32), as GGUF's Q8_0 keeps them. A 3-D
        [E, N, K] weight (fused experts) is quantized expert by expert."""
        if getattr(weight, "ndim", 0) == 3:  # fused experts [E, N, K]: expert by expert
            return quantize_experts(cls.from_float, weight, name, group_size=group_size, act_quant=act_quant,
                                    scale_dtype=scale_dtype, qparams=qparams)
        check_weight(weight, name)
        if scale_dtype not in (None, torch.float32, torch.float16):
            raise AOQError(f"{name}: Int8Tensor scale_dtype must be None, torch.float32 or torch.float16, got {scale_dtype!r}")
        if act_quant not in ACT_QUANTS:
            raise AOQError(f"{name}: Int8Tensor act_quant must be one of {ACT_QUANTS}, got {act_quant!r}")
        n, k = weight.shape
        if group_size is not None and (not isinstance(group_size, int) or group_size <= 0 or k % group_size):
            raise AOQError(f"{name}: group_size {group_size} does not divide the input dimension {k} (shape {n}x{k})")
        if act_quant is not None and group_size not in (None, k):
            raise AOQError(f"{name}: dynamic int8 activations need a per-row weight scale, not group_size {group_size}")
        block = (1, group_size or k)

        def rows(w):
            scale, _ = choose_qparams_affine(w, block, QMIN, QMAX, symmetric=True, param_dtype=torch.float32, name=name,
                                            method=qparams)
            if scale_dtype is torch.float16:
                scale = _fp16_scale(scale)
            return quantize_affine(w, block, scale, None, QMIN, QMAX, torch.int8), scale

        codes, scale = by_row_chunks(weight, rows)
        return check_built(cls(codes, scale, block, weight.shape, weight.dtype, act_quant=act_quant), weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        check_grid_fields(fields, (torch.int8,))
        # Rows, or groups within rows; or their transpose (a weight.t() that was saved).
        if fields.get("act_quant") == "per_token":
            blocks = "(1, K) or (N, 1): dynamic activations need one scale per row"
            ok = lambda b, shape: b in ((1, shape[1]), (shape[0], 1))  # noqa: E731
        else:
            blocks, ok = "(1, g) or (g, 1)", lambda b, shape: len(b) == 2 and 1 in b  # noqa: E731
        check_layout(fields, cls.__name__, blocks, ok)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_affine(self.qdata, self.block_size, self.scale, None, QMIN, QMAX, dtype or self.dtype)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric int8 codes and float32 scales, one per token (row) of a 2-D activation."""
        return quantize_int8_per_token(x2)
