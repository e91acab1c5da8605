"""torchao's MXTensor (torchao.prototype.mx_formats) -> hf_aoq MXTensor, bit for bit.

torchao stores an MX weight [..., N, K] (2-D, or 3-D experts) as
    qdata   float8_e4m3fn / float8_e5m2 [..., K]    (MXFP8), or
            uint8 [..., K/2]                        (MXFP4: two e2m1 codes a byte, element 2j in the
                                                     low nibble; float4_e2m1fn_x2 read as its bytes)
    scale   float8_e8m0fnu [..., K/block_size]      2^(code - 127), 255 = NaN
with attributes elem_dtype, block_size, orig_dtype, kernel_preference, act_quant_kwargs (a
QuantizeTensorToMXKwargs for dynamic activations, or None) and, by version, is_swizzled_scales /
swizzle_type; w = element * scale, computed in orig_dtype. hf_aoq's MXTensor has the same codes and
scale bytes, so the fields are taken as they are. Refused, naming the tensor: a block size other
than 32 (OCP MX's only one, and hf_aoq's), fp6 elements, swizzled scales (a GPU GEMM layout),
scale code 255 in a weight, activation scales not chosen by FLOOR (the OCP rule hf_aoq uses) or
swizzled. NVFP4Tensor is not converted here.
"""
from __future__ import annotations

import torch

from ..configs import MXFPInferenceConfig
from ..tensors import MXTensor
from ..tensors import mx
from .torchao_format import Dtype, Enum, Obj, Record, Spec, show

MX_SPEC = Spec(
    frozenset({"qdata", "scale"}), frozenset(),
    frozenset({"elem_dtype", "block_size", "orig_dtype"}),
    frozenset({"kernel_preference", "act_quant_kwargs", "is_swizzled_scales", "swizzle_type",
               "gemm_kernel_choice", "pack_fp6"}),
)
ELEMENTS = {mx._name(d): d for d in mx.ELEM_DTYPES}  # float8_e4m3fn, float8_e5m2, float4_e2m1fn_x2
_KWARGS_KEYS = {"elem_dtype", "block_size", "scaling_mode", "kernel_preference", "gemm_kernel_choice",
                "pack_fp6", "is_swizzled_scales", "swizzle_type"}


def _element(r: Record, value, where: str) -> torch.dtype:
    if isinstance(value, Dtype) and value.name in ELEMENTS:
        return ELEMENTS[value.name]
    raise r.fail(f"{where} {show(value)}: hf_aoq's MXTensor takes {sorted(ELEMENTS)} (fp6 is not converted)")


def _not_swizzled(r: Record, attrs: dict, where: str) -> None:
    swizzle = attrs.get("swizzle_type")
    if attrs.get("is_swizzled_scales") not in (None, False) or (
            swizzle is not None and swizzle != Obj("NoSwizzle", {})):
        raise r.fail(f"{where}swizzled scales ({show(swizzle if swizzle is not None else True)}): the layout of "
                     f"torchao's GPU GEMMs is not converted; save with swizzling off")


def _act_dtype(r: Record) -> torch.dtype | None:
    kwargs = r.attributes.get("act_quant_kwargs")
    if kwargs is None:
        return None
    if not isinstance(kwargs, Obj) or kwargs.type != "QuantizeTensorToMXKwargs" or set(kwargs.data) - _KWARGS_KEYS:
        raise r.fail(f"act_quant_kwargs {show(kwargs)} is not QuantizeTensorToMXKwargs as this converter knows it")
    d = kwargs.data
    act = _element(r, d.get("elem_dtype", Dtype("float8_e4m3fn")), "act_quant_kwargs.elem_dtype")
    if d.get("block_size", mx.BLOCK_SIZE) != mx.BLOCK_SIZE:
        raise r.fail(f"act_quant_kwargs.block_size {show(d.get('block_size'))}: hf_aoq quantizes activations in "
                     f"blocks of {mx.BLOCK_SIZE}")
    mode = d.get("scaling_mode", Enum("ScaleCalculationMode", "FLOOR"))
    if mode != Enum("ScaleCalculationMode", "FLOOR"):
        raise r.fail(f"act_quant_kwargs.scaling_mode {show(mode)}: hf_aoq chooses activation scales by the OCP "
                     f"rule (torchao's FLOOR), so the outputs would differ")
    if d.get("pack_fp6") not in (None, False):
        raise r.fail("act_quant_kwargs.pack_fp6 is set: fp6 is not converted")
    _not_swizzled(r, d, "act_quant_kwargs: ")
    return act


def mx_tensor(r: Record):
    """(hf_aoq MXTensor, its config, a description, torchao's dequantized weight)."""
    elem = _element(r, r.attributes.get("elem_dtype"), "elem_dtype")
    block = r.attributes.get("block_size")
    if block != mx.BLOCK_SIZE:
        raise r.fail(f"block_size {show(block)}: hf_aoq's MXTensor has blocks of {mx.BLOCK_SIZE} (OCP MX v1.0)")
    dtype = r.float_dtype("orig_dtype")
    _not_swizzled(r, r.attributes, "")
    if r.attributes.get("pack_fp6") not in (None, False):
        raise r.fail("pack_fp6 is set: fp6 is not converted")
    act = _act_dtype(r)
    fp4 = elem == mx.FP4
    qdata = r.tensor("qdata", (torch.uint8, mx.FP4) if fp4 else (elem,))
    if qdata.ndim not in (2, 3) or 0 in qdata.shape:
        raise r.fail(f"field 'qdata' has shape {tuple(qdata.shape)}: an MX weight is 2-D [N, K] or 3-D [E, N, K]")
    lead, k = tuple(qdata.shape[:-1]), qdata.shape[-1] * (2 if fp4 else 1)
    if k % mx.BLOCK_SIZE:
        raise r.fail(f"input dimension {k} is not a multiple of the block size {mx.BLOCK_SIZE}")
    scale = r.tensor("scale", (torch.float8_e8m0fnu, torch.uint8), lead + (k // mx.BLOCK_SIZE,)).view(torch.uint8)
    if bool((scale == mx.E8M0_NAN).any()):
        raise r.fail("field 'scale' holds the e8m0 code 255 (NaN): no finite weight has it")
    codes = qdata.view(torch.uint8) if fp4 else qdata
    block_size = (1,) * len(lead) + (mx.BLOCK_SIZE,)
    out = MXTensor(codes.contiguous(), scale.contiguous(), elem, block_size, lead + (k,), dtype, act_dtype=act)
    config = MXFPInferenceConfig(activation_dtype=act, weight_dtype=elem)
    acts = "weight-only" if act is None else f"dynamic {mx._name(act)} activations in blocks of {mx.BLOCK_SIZE}"
    return out, config, f"{mx._name(elem)}, e8m0 scale per {mx.BLOCK_SIZE}, {acts}", _torchao_values(codes, scale, fp4, dtype)


def _torchao_values(codes: torch.Tensor, scale: torch.Tensor, fp4: bool, dtype: torch.dtype) -> torch.Tensor:
    """torchao's dequantization: each element's value times 2^(code - 127), in orig_dtype (the
    product is exact before that rounding), written apart from hf_aoq's decoder."""
    if fp4:
        nibbles = torch.stack([codes & 0x0F, codes >> 4], dim=-1).reshape(*codes.shape[:-1], -1).long()
        values = torch.tensor(mx.E2M1_VALUES, dtype=torch.float32)[nibbles]
    else:
        values = codes.float()
    blocks = values.reshape(*values.shape[:-1], -1, mx.BLOCK_SIZE)
    scaled = torch.ldexp(blocks, scale.to(torch.int32).unsqueeze(-1) - mx.E8M0_BIAS)
    return scaled.reshape(values.shape).to(dtype)
