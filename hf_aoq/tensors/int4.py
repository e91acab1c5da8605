"""Int4Tensor: 4-bit weights in groups along the input dimension, asymmetric or symmetric.

Canonical layout (what is saved; 3-D fused experts [E, N, K] put E in front of every field):
    qdata   uint8 [N, K/2]         two codes per byte, low nibble = even k
    scale   [N, ceil(K/g)]         in the weight's dtype
    zero    [N, ceil(K/g)] or None the value that code 8 stands for; None = symmetric (zero 0)
    w = (q - 8) * scale + zero
    act_quant  None (weight-only) or "per_token": activations quantized at run time, one scale per
               token (row), to `act_dtype`:
    act_dtype  torch.int8 (symmetric codes in [-127, 127]), torch.int4 (symmetric codes in
               [-7, 7], scale = max|x| / 7) or a float8 dtype (scale = max|x| / its max)
    input_scale float32 [K] or None: activation-aware scales that could not be folded into the
               previous layer (hf_aoq.awq). The codes then hold W * s, and the layer computes
               y = (x / s) @ Wq^T (x / s in float32, rounded to x's dtype, then the usual kernel);
               dequantize() returns Wq / s (see common.py, docs/format.md)

K need not be a multiple of g: the last group then covers the remaining K % g columns (SmolLM2's
hidden size 576 in groups of 128 is four whole groups and one of 64). The device packings pad
such a weight to whole groups with code 8 and pad the input with zeros, which adds nothing.

Device packings (`packing` attribute) rearrange qdata for a device's int4 kernels (on CPU,
hf_aoq's own "pairs" layout, or aten's where hf_aoq's extension is not built; on CUDA,
tinygemm's) and hold scale and zero together as [K/g, N, 2]; they are made by `place()` and
undone by `to_canonical()`.
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError
from ..core.primitives import (
    FLOAT8_DTYPES,
    by_row_chunks,
    choose_qparams_affine,
    dequantize_affine,
    pack_int4,
    quantize_affine,
    unpack_int4,
)
from ..core.registry import register_tensor_type
from ..kernels.common import INT4_GROUP_SIZES as GROUP_SIZES
from ..kernels.common import quantize_int_per_token
from .common import (BlockGridTensor, DevicePacked, check_built, check_grid_fields, check_input_scale, check_layout,
                     check_weight, unscale_input_columns)
from .experts import quantize_experts
from .float8 import quantize_input_float8

QMIN, QMAX = 0, 15
# How scales are chosen unless told otherwise, here and in Int4WeightOnlyConfig: "mse" is the
# more accurate (README "4-bit quality"); "minmax" is the plain range.
DEFAULT_QPARAMS = "mse"
ACT_QUANTS = (None, "per_token")
# Activation dtypes, and for the integer ones the largest code of the per-token symmetric range.
INT_ACT_QMAX = {torch.int8: 127, torch.int4: 7}
ACT_DTYPES = tuple(INT_ACT_QMAX) + FLOAT8_DTYPES


@register_tensor_type
class Int4Tensor(DevicePacked, BlockGridTensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("block_size", "shape", "dtype")
    optional_tensor_data_names = ("zero", "input_scale")
    optional_tensor_attribute_names = ("packing", "act_quant", "act_dtype")
    schema_version = 1
    codes_per_byte = 2

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        group_size: int = 128,
        symmetric: bool = False,
        *,
        qparams: str = DEFAULT_QPARAMS,
        act_quant: str | None = None,
        act_dtype: torch.dtype | None = None,
        name: str = "weight",
    ):
        """Quantize a float [N, K] weight in groups of `group_size` along K. `qparams` picks how
        each group's scale and zero are chosen: "mse" (default, as Int4WeightOnlyConfig's: the
        least squared reconstruction error; see core.primitives) or "minmax" (the group's range,
        nothing clips). `act_quant` "per_token" with `act_dtype` (ACT_DTYPES) quantizes the
        activations at run time too. A 3-D [E, N, K] weight (fused experts) is quantized expert by
        expert."""
        if getattr(weight, "ndim", 0) == 3:
            return quantize_experts(cls.from_float, weight, name, group_size=group_size, symmetric=symmetric,
                                    qparams=qparams, act_quant=act_quant, act_dtype=act_dtype)
        check_weight(weight, name)
        check_act_fields(act_quant, act_dtype, name)
        if group_size not in GROUP_SIZES:
            raise AOQError(f"{name}: int4 group_size must be one of {GROUP_SIZES}, got {group_size}")
        if weight.shape[1] % 2:
            raise AOQError(f"{name}: int4 needs an even input dimension, got shape {tuple(weight.shape)}")
        block = (1, group_size)

        def rows(w):
            scale, zero = choose_qparams_affine(
                w, block, QMIN, QMAX, symmetric=symmetric, param_dtype=weight.dtype, name=name, method=qparams
            )
            return pack_int4(quantize_affine(w, block, scale, zero, QMIN, QMAX, torch.uint8)), scale, zero

        qdata, scale, zero = by_row_chunks(weight, rows)
        out = cls(qdata, scale, block, weight.shape, weight.dtype, zero=zero, act_quant=act_quant, act_dtype=act_dtype)
        return check_built(out, weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        check_grid_fields(fields, (torch.uint8,), codes_per_byte=2, partial_last_block=True)
        check_layout(fields, cls.__name__, f"(1, g) with g in {GROUP_SIZES}",
                     lambda b, shape: len(b) == 2 and b[0] == 1 and b[1] in GROUP_SIZES)
        check_act_fields(fields.get("act_quant"), fields.get("act_dtype"), None)
        check_input_scale(fields)

    @property
    def group_size(self) -> int:
        return self.block_size[-1]

    def codes(self) -> torch.Tensor:
        """The uint8 codes in [0, 15], shape [N, K]."""
        return unpack_int4(self.to_canonical().qdata)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        c = self.to_canonical()
        if c.input_scale is None:
            return dequantize_affine(unpack_int4(c.qdata), c.block_size, c.scale, c.zero, QMIN, QMAX, dtype or self.dtype)
        w = dequantize_affine(unpack_int4(c.qdata), c.block_size, c.scale, c.zero, QMIN, QMAX, torch.float32)
        return unscale_input_columns(w, c.input_scale, dtype or self.dtype)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes (int8, also for int4 activations; or float8) and float32 scales [M, 1], one per
        token (row) of a 2-D activation: what every kernel and the reference apply."""
        qmax = INT_ACT_QMAX.get(self.act_dtype)
        if qmax is not None:
            return quantize_int_per_token(x2, qmax)
        return quantize_input_float8(x2, "per_row", self.act_dtype)


def check_act_fields(act_quant, act_dtype, name: str | None) -> None:
    """Int4Tensor's activation attributes: both None (weight-only) or "per_token" with one of
    ACT_DTYPES. `name`: the weight being quantized (None: checking a checkpoint's attributes)."""
    where = "attribute" if name is None else f"{name}: Int4Tensor"
    if act_quant not in ACT_QUANTS:
        raise AOQError(f"{where} 'act_quant' must be one of {ACT_QUANTS}, got {act_quant!r}")
    if (act_quant is None) != (act_dtype is None):
        raise AOQError(f"{where} 'act_dtype' must be given with act_quant 'per_token' and only then "
                       f"(act_quant {act_quant!r}, act_dtype {act_dtype!r})")
    if act_dtype is not None and act_dtype not in ACT_DTYPES:
        raise AOQError(f"{where} 'act_dtype' must be one of {ACT_DTYPES}, got {act_dtype!r}")



def choose_int4_qparams(block: torch.Tensor, config, dtype: torch.dtype, *, name: str = "weight"):
    """(scale, zero) of one group per row of `block` [N, <= g], chosen as `config` (an
    Int4WeightOnlyConfig) would, stored in `dtype`. Used by calibrated quantization, which picks
    each group's parameters on weights it has already adjusted."""
    return choose_qparams_affine(
        block, (1, block.shape[1]), QMIN, QMAX, symmetric=config.symmetric, param_dtype=dtype, name=name,
        method=config.qparams,
    )
