"""torchao's NVFP4Tensor -> hf_aoq's NVFP4Tensor (convert-torchao; docs/torchao.md).

torchao stores `qdata` uint8 [N, K/2] (e2m1 codes, the even element in the low nibble: hf_aoq's
order), `_scale_e4m3` float8_e4m3fn block scales of 16 ([N, K/16], or flattened in cuBLAS's
swizzled layout when `_is_swizzled_scales`), an optional float32 `_per_tensor_scale` (absent:
single-level scaling, which is hf_aoq's per-tensor scale 1) and `act_quant_kwargs` (a
QuantizeTensorToNVFP4Kwargs: activations quantized to NVFP4 as the model runs). torchao's
dequantization, e2m1 * (per_tensor_scale * scale) in float32, is hf_aoq's, so the bits are copied.
A static activation per-tensor scale (`_act_per_tensor_scale`, torchao's calibrated flow) and
activations without a dynamic per-tensor scale are refused: hf_aoq computes it from each
activation.
"""
from __future__ import annotations

import torch

from ..configs import NVFP4InferenceConfig, NVFP4WeightOnlyConfig
from ..tensors import NVFP4Tensor
from ..tensors.nvfp4 import BLOCK_SIZE
from ..tensors.mx import decode_e2m1
from ..core.primitives import unpack_int4
from .torchao_format import Obj, Record, Spec, show

SPEC = Spec(
    frozenset({"qdata", "_scale_e4m3"}), frozenset({"_per_tensor_scale", "_act_per_tensor_scale"}),
    frozenset({"_block_size", "_orig_dtype"}),
    frozenset({"_is_swizzled_scales", "use_triton_kernel", "act_quant_kwargs", "nvfp4_quantize_kernel_choice"}),
)
_ACT_KWARGS = {"block_size", "is_swizzled_scales", "use_triton_kernel", "use_dynamic_per_tensor_scale",
               "nvfp4_quantize_kernel_choice"}


def unswizzle_scales(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] scales from cuBLAS's block-scaling-factor layout: the matrix padded to 128-row,
    4-column tiles, tiles in row-major order, each tile's 512 bytes holding (r, c) at offset
    (r % 32) * 16 + (r // 32) * 4 + c."""
    rb, cb = -(-rows // 128), -(-cols // 4)
    tiles = flat.reshape(rb, cb, 32, 4, 4)  # [tile row, tile col, r % 32, r // 32, c]
    return tiles.permute(0, 3, 2, 1, 4).reshape(rb * 128, cb * 4)[:rows, :cols]


def _bool(r: Record, where: dict, key: str, default: bool) -> bool:
    v = where.get(key, default)
    if v is None:
        return default
    if type(v) is not bool:
        raise r.fail(f"{key!r} must be a bool, got {show(v)}")
    return v


def convert_nvfp4(r: Record):
    """(hf_aoq NVFP4Tensor, its config, a description, torchao's dequantized weight)."""
    block = r.attributes.get("_block_size")
    if block != BLOCK_SIZE:
        raise r.fail(f"_block_size {show(block)}: NVFP4's block size is {BLOCK_SIZE}")
    dtype = r.float_dtype("_orig_dtype")
    qdata = r.tensor("qdata", (torch.uint8,))
    if qdata.ndim != 2:
        raise r.fail(f"qdata has shape {tuple(qdata.shape)}; only 2-D NVFP4 weights are converted")
    n, k = qdata.shape[0], 2 * qdata.shape[1]
    if k % BLOCK_SIZE:
        raise r.fail(f"qdata has shape {tuple(qdata.shape)}: K = {k} is not a multiple of {BLOCK_SIZE}, which "
                     f"torchao's NVFP4Tensor requires")
    b = -(-k // BLOCK_SIZE)
    swizzled = _bool(r, r.attributes, "_is_swizzled_scales", False)
    raw = r.tensor("_scale_e4m3", (torch.float8_e4m3fn,))
    if swizzled:
        padded = -(-n // 128) * 128 * -(-b // 4) * 4
        if raw.numel() != padded:
            raise r.fail(f"_scale_e4m3 holds {raw.numel()} values; swizzled scales of a [{n}, {k}] weight hold {padded}")
        scale = unswizzle_scales(raw.reshape(-1).view(torch.uint8), n, b).contiguous().view(torch.float8_e4m3fn)
    else:
        if raw.numel() != n * b:
            raise r.fail(f"_scale_e4m3 has shape {tuple(raw.shape)}, expected [{n}, {b}] for a [{n}, {k}] weight")
        scale = raw.reshape(n, b).contiguous()
    pts = r.fields.get("_per_tensor_scale")
    if pts is None:
        pts, levels = torch.tensor(1.0), "single-level scales"
    else:
        pts = r.tensor("_per_tensor_scale", (torch.float32,))
        if pts.numel() != 1:
            raise r.fail(f"_per_tensor_scale has shape {tuple(pts.shape)}, expected one value")
        pts, levels = pts.reshape(()).clone(), "per-tensor and e4m3 block scales"
    r.unset("_act_per_tensor_scale", "a static (calibrated) activation scale")
    kwargs = r.attributes.get("act_quant_kwargs")
    act_quant = None
    if kwargs is not None:
        if not (isinstance(kwargs, Obj) and kwargs.type == "QuantizeTensorToNVFP4Kwargs") or set(kwargs.data) - _ACT_KWARGS:
            raise r.fail(f"act_quant_kwargs {show(kwargs)} is not QuantizeTensorToNVFP4Kwargs as this converter knows it")
        if kwargs.data.get("block_size", BLOCK_SIZE) != BLOCK_SIZE:
            raise r.fail(f"act_quant_kwargs.block_size {show(kwargs.data.get('block_size'))}: NVFP4's is {BLOCK_SIZE}")
        if not _bool(r, kwargs.data, "use_dynamic_per_tensor_scale", False):
            raise r.fail("act_quant_kwargs.use_dynamic_per_tensor_scale is not True: torchao then quantizes "
                         "activations without a per-tensor scale (or with a calibrated one); hf_aoq's NVFP4 "
                         "activations always take a dynamic per-tensor scale")
        act_quant = "nvfp4"
    out = NVFP4Tensor(qdata.contiguous(), scale, pts, (1, BLOCK_SIZE), (n, k), dtype, act_quant=act_quant)
    # torchao's to_dtype: e2m1 values times (per_tensor_scale * scale) in float32.
    values = decode_e2m1(unpack_int4(qdata)).reshape(n, b, BLOCK_SIZE)
    want = (values * (pts * scale.float())[..., None]).reshape(n, k).to(dtype)
    config = NVFP4InferenceConfig() if act_quant else NVFP4WeightOnlyConfig()
    detail = f"nvfp4, {levels}, {'dynamic NVFP4 activations' if act_quant else 'weight-only'}"
    return out, config, detail, want
