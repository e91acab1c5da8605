"""Float8Tensor: e4m3fn or e5m2 weights scaled per tensor or per row, weight-only or with
dynamic float8 activations.

Canonical layout (what is saved; 3-D fused experts [E, N, K] put E in front of every field,
a per-tensor scale is per expert, [E, 1, 1]):
    qdata      float8 [N, K]
    scale      float32 [1, 1] (per tensor) or [N, 1] (per row);  w = q * scale
    act_quant  None (weight-only), "per_tensor" or "per_row" (activations quantized at run time,
               in `act_dtype`, which defaults to qdata's dtype), or "static" (activations
               quantized per tensor with the fixed, calibrated `act_scale`)
    act_scale  float32 [1, 1], only with act_quant "static": x is quantized as x / act_scale
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError
from ..core.granularity import PerRow, PerTensor
from ..core.primitives import (FLOAT8_DTYPES, by_row_chunks, check_float8_codes_finite, choose_scale_float8,
                               dequantize_float8, quantize_float8)
from ..core.registry import register_tensor_type
from .common import BlockGridTensor, check_built, check_grid_fields, check_layout, check_weight
from .experts import quantize_experts

ACT_QUANTS = (None, "per_tensor", "per_row", "static")


def quantize_input_float8(x2: torch.Tensor, act_quant: str, f8: torch.dtype, act_scale: torch.Tensor | None = None):
    """Float8 codes and float32 scales for a 2-D activation: one scale per row ("per_row"), per
    tensor ("per_tensor"), or the given static `act_scale` ("static"). Shared by every type with
    float8 activations (Float8Tensor, Int4Tensor)."""
    if act_quant == "static":
        return quantize_float8(x2, tuple(x2.shape), act_scale, f8), act_scale.float()
    block = (1, x2.shape[1]) if act_quant == "per_row" else tuple(x2.shape)
    amax = x2.float().abs().amax(dim=1 if act_quant == "per_row" else (0, 1), keepdim=True)
    scale = (amax / torch.finfo(f8).max).clamp(min=1e-12)
    return quantize_float8(x2, block, scale, f8), scale


def static_act_scale(scale, name: str) -> float:
    """A static activation scale (a positive finite number or one-element tensor) as a float."""
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise AOQError(f"{name}: a static activation scale is one number (per tensor), got shape {tuple(scale.shape)}")
        scale = float(scale.detach().float().reshape(()))
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < float("inf")):
        raise AOQError(f"{name}: a static activation scale must be a positive finite number, got {scale!r}")
    return float(scale)


@register_tensor_type
class Float8Tensor(BlockGridTensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("block_size", "shape", "dtype")
    optional_tensor_data_names = ("act_scale",)
    optional_tensor_attribute_names = ("act_quant", "act_dtype")
    schema_version = 1
    transposable = True

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        float8_dtype: torch.dtype = torch.float8_e4m3fn,
        granularity: PerRow | PerTensor = PerRow(),
        act_quant: str | None = None,
        act_dtype: torch.dtype | None = None,
        *,
        act_scale=None,
        name: str = "weight",
    ):
        """`act_scale` (a positive number or one-element tensor) goes with act_quant "static" only."""
        if getattr(weight, "ndim", 0) == 3:  # fused experts [E, N, K]: expert by expert (per tensor = per expert)
            return quantize_experts(cls.from_float, weight, name, float8_dtype=float8_dtype, granularity=granularity,
                                    act_quant=act_quant, act_dtype=act_dtype, act_scale=act_scale)
        check_weight(weight, name)
        if act_quant not in ACT_QUANTS:
            raise AOQError(f"{name}: Float8Tensor act_quant must be one of {ACT_QUANTS}, got {act_quant!r}")
        for dt in (float8_dtype, act_dtype):
            if dt is not None and dt not in FLOAT8_DTYPES:
                raise AOQError(f"{name}: unsupported float8 dtype {dt}; expected one of {FLOAT8_DTYPES}")
        if (act_quant == "static") != (act_scale is not None):
            raise AOQError(f"{name}: Float8Tensor act_quant 'static' needs an act_scale, and only it takes one "
                           f"(act_quant {act_quant!r}, act_scale {act_scale!r})")
        if act_scale is not None:
            act_scale = torch.tensor([[static_act_scale(act_scale, name)]], dtype=torch.float32, device=weight.device)
        if not isinstance(granularity, (PerRow, PerTensor)):
            raise AOQError(f"{name}: Float8Tensor granularity must be PerRow() or PerTensor(), got {granularity!r}")
        block = granularity.block_size(tuple(weight.shape))

        def rows(w):
            scale = choose_scale_float8(w, block, float8_dtype, name=name)
            return quantize_float8(w, block, scale, float8_dtype), scale

        # A per-tensor scale needs every row at once.
        qdata, scale = by_row_chunks(weight, rows) if block[0] == 1 else rows(weight)
        out = cls(qdata, scale, block, weight.shape, weight.dtype, act_scale=act_scale, act_quant=act_quant,
                  act_dtype=act_dtype)
        return check_built(out, weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        check_grid_fields(fields, FLOAT8_DTYPES)
        check_float8_codes_finite(fields["qdata"])  # quantize_float8 saturates: never inf or NaN
        # Per row or per tensor; or the transpose of per row (a weight.t() that was saved).
        check_layout(fields, cls.__name__, "(1, K) (per row), (N, K) (per tensor) or (N, 1)",
                     lambda b, shape: b in ((1, shape[1]), tuple(shape), (shape[0], 1)))
        if fields.get("act_dtype") is not None and fields["act_dtype"] not in FLOAT8_DTYPES:
            raise AOQError(f"attribute 'act_dtype': {fields['act_dtype']} is not one of {FLOAT8_DTYPES}")
        act_scale, static = fields.get("act_scale"), fields.get("act_quant") == "static"
        if static and act_scale is None:
            raise AOQError("field 'act_scale': act_quant 'static' needs the static activation scale, and it is missing")
        if act_scale is not None:
            if not static:
                raise AOQError(f"field 'act_scale': only act_quant 'static' takes it, not {fields.get('act_quant')!r}")
            if act_scale.dtype != torch.float32 or tuple(act_scale.shape) != (1, 1):
                raise AOQError(f"field 'act_scale': float32 [1, 1] expected, got {act_scale.dtype} {tuple(act_scale.shape)}")
            if act_scale.device.type != "meta" and not bool((act_scale > 0).all() & torch.isfinite(act_scale).all()):
                raise AOQError("field 'act_scale': the static activation scale must be positive and finite")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_float8(self.qdata, self.block_size, self.scale, dtype or self.dtype)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float8 codes and float32 scales for a 2-D activation, by `act_quant`."""
        return quantize_input_float8(x2, self.act_quant, self.act_dtype or self.qdata.dtype, self.act_scale)
