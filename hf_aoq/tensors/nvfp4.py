"""NVFP4Tensor: NVIDIA's FP4 weights: e2m1 elements two per byte, one float8 e4m3 scale per block
of 16 elements along K, and one float32 scale per tensor (two-level scaling). Weight-only, or with
activations quantized at run time to NVFP4 in the same blocks (a per-tensor scale computed from
each activation tensor).

Canonical layout (what is saved), weight [..., K] (2-D [N, K] or 3-D experts [E, N, K]),
B = ceil(K / 16) blocks per row (the last may be partial, as MXTensor's):
    qdata             uint8 [..., K/2]    e2m1 codes, the even element in the low nibble (the bytes
                                          of torch.float4_e2m1fn_x2, MXTensor's FP4 order)
    scale             float8_e4m3fn [..., B]   the block scales
    per_tensor_scale  float32 [] (2-D) or [E] (3-D: one per expert, each expert is a 2-D weight)
    act_quant         None (weight-only) or "nvfp4" (activations quantized as below)
    w[..., k] = e2m1(qdata[..., k]) * (per_tensor_scale * scale[..., k // 16]), in float32

Encoding a weight W (docs/format.md "NVFP4Tensor"), every step a float32 operation:
    p = max(amax|W| / 2688, 2^-126)                    2688 = 448 (e4m3 max) * 6 (e2m1 max)
    s_b = e4m3(clamp(amax|V_b| / 6 / p, 2^-6, 448))    round to nearest even (torch's cast)
    q_i = e2m1(V_i / (p * s_b))                        nearest, ties to even, saturating at 6
An all-zero block gets s = 2^-6 and zero elements (signs kept). Weights holding inf or NaN are
refused. Activations: p from the amax of their finite values; a block holding inf or NaN gets
the e4m3 NaN scale and zero elements, so it decodes to NaN.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.errors import AOQError
from ..core.primitives import by_row_chunks, check_finite, pack_int4, unpack_int4
from ..core.registry import register_tensor_type
from .common import BlockGridTensor, check_built, check_weight
from .experts import quantize_experts
from .mx import FP4, decode_e2m1, encode_e2m1

BLOCK_SIZE = 16  # NVFP4's only block size
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
E2M1_MAX = 6.0
MIN_BLOCK_SCALE = 2.0 ** -6  # e4m3's smallest normal: block scales are clamped to [2^-6, 448]
MIN_PER_TENSOR_SCALE = 2.0 ** -126  # float32's smallest normal
E4M3_NAN = 0x7F
ACT_QUANT = ("nvfp4",)


# ---------------------------------------------------------------------- the numerics
def _blocks(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., B, 16]: x along its last dim, a partial last block padded with zeros."""
    k = x.shape[-1]
    pad = -k % BLOCK_SIZE
    xf = x.float()
    if pad:
        xf = F.pad(xf, (0, pad))
    return xf.reshape(*x.shape[:-1], (k + pad) // BLOCK_SIZE, BLOCK_SIZE)


def per_tensor_scale_of(x: torch.Tensor) -> torch.Tensor:
    """float32 0-d: max(amax|x| / (448 * 6), 2^-126), the amax over x's finite values."""
    a = x.detach().abs().float()
    amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax()
    return (amax / (E4M3_MAX * E2M1_MAX)).clamp(min=MIN_PER_TENSOR_SCALE)


def nvfp4_quantize(x: torch.Tensor, per_tensor_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata, scale) of `x` [..., K] (K even) in NVFP4 blocks of 16 along the last dim, with the
    0-d float32 `per_tensor_scale` (module docstring)."""
    k = x.shape[-1]
    xb = _blocks(x)
    amax = xb.abs().amax(-1)  # NaN propagates
    finite = torch.isfinite(amax)
    s = (amax / E2M1_MAX / per_tensor_scale).clamp(MIN_BLOCK_SCALE, E4M3_MAX)
    s = torch.where(finite, s, torch.full_like(s, MIN_BLOCK_SCALE)).to(E4M3)
    q = xb / (per_tensor_scale * s.float())[..., None]
    q = torch.where(finite[..., None], q, torch.zeros_like(q)).reshape(*x.shape[:-1], -1)[..., :k]
    bits = torch.where(finite, s.view(torch.uint8), torch.full_like(s.view(torch.uint8), E4M3_NAN))
    return pack_int4(encode_e2m1(q)), bits.view(E4M3)


def block_scales(scale: torch.Tensor, per_tensor_scale: torch.Tensor) -> torch.Tensor:
    """float32 per_tensor_scale * scale (each block's whole scale), per_tensor_scale broadcast
    over the trailing [N, B] (or [B]) of `scale`."""
    p = per_tensor_scale.float()
    return p.reshape(*p.shape, *([1] * (scale.ndim - p.ndim))) * scale.float()


def nvfp4_dequantize(qdata: torch.Tensor, scale: torch.Tensor, per_tensor_scale: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """The values of NVFP4 (qdata, scale, per_tensor_scale), computed in float32, as `out_dtype`."""
    values = decode_e2m1(unpack_int4(qdata))
    k = values.shape[-1]
    w = _blocks(values) * block_scales(scale, per_tensor_scale)[..., None]
    return w.reshape(*values.shape[:-1], -1)[..., :k].to(out_dtype).contiguous()


# ---------------------------------------------------------------------- the tensor type
def _check_weight(weight, name: str) -> None:
    check_weight(weight, name, ndims=(2, 3), shapes="a 2-D [N, K] or 3-D [E, N, K]")
    if weight.shape[-1] % 2:
        raise AOQError(f"{name}: NVFP4 (e2m1, two per byte) needs an even input dimension, got shape "
                       f"{tuple(weight.shape)}")


@register_tensor_type
class NVFP4Tensor(BlockGridTensor):
    tensor_data_names = ("qdata", "scale", "per_tensor_scale")
    tensor_attribute_names = ("block_size", "shape", "dtype")
    optional_tensor_attribute_names = ("act_quant",)
    schema_version = 1
    codes_per_byte = 2

    @classmethod
    def from_float(cls, weight: torch.Tensor, act_quant: str | None = None, block_size: int = BLOCK_SIZE, *,
                   name: str = "weight"):
        """Quantize a float [N, K] weight (or [E, N, K] experts, each with its own per-tensor
        scale) to NVFP4 blocks of 16 along K."""
        if block_size != BLOCK_SIZE or type(block_size) is not int:
            raise AOQError(f"{name}: NVFP4 block_size must be {BLOCK_SIZE}, got {block_size!r}")
        if act_quant not in (None,) + ACT_QUANT:
            raise AOQError(f"{name}: act_quant must be None or one of {list(ACT_QUANT)}, got {act_quant!r}")
        _check_weight(weight, name)
        if weight.ndim == 3:
            return quantize_experts(cls.from_float, weight, name, act_quant=act_quant)
        check_finite(weight, name)
        p = per_tensor_scale_of(weight)
        qdata, scale = by_row_chunks(weight, lambda w: nvfp4_quantize(w, p))
        out = cls(qdata, scale, p, (1, BLOCK_SIZE), weight.shape, weight.dtype, act_quant=act_quant)
        return check_built(out, weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        shape, block, dtype = tuple(fields["shape"]), fields["block_size"], fields["dtype"]
        if len(shape) not in (2, 3) or 0 in shape:
            raise AOQError(f"attribute 'shape': NVFP4Tensor is a non-empty [N, K] or [E, N, K] weight, got {shape}")
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise AOQError(f"attribute 'dtype': {dtype} is not a float dtype of 16 bits or more")
        want_block = (1,) * (len(shape) - 1) + (BLOCK_SIZE,)
        if block != want_block:
            raise AOQError(f"attribute 'block_size': {block!r}, expected {want_block} for shape {shape}")
        if fields.get("act_quant") not in (None,) + ACT_QUANT:
            raise AOQError(f"attribute 'act_quant': {fields.get('act_quant')!r}, expected None or one of {list(ACT_QUANT)}")
        k = shape[-1]
        if k % 2:
            raise AOQError(f"attribute 'shape': NVFP4 needs an even last dimension, got {shape}")
        expected = {
            "qdata": (shape[:-1] + (k // 2,), torch.uint8),
            "scale": (shape[:-1] + (-(-k // BLOCK_SIZE),), E4M3),
            "per_tensor_scale": (shape[:-2], torch.float32),
        }
        for field, (want_shape, want_dtype) in expected.items():
            t = fields[field]
            if t.dtype != want_dtype or tuple(t.shape) != want_shape:
                raise AOQError(f"field {field!r}: {t.dtype} {tuple(t.shape)}, expected {want_dtype} {want_shape} "
                               f"for shape {shape}")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return nvfp4_dequantize(self.qdata, self.scale, self.per_tensor_scale, dtype or self.dtype)

    def simulate_input_quantization(self, x: torch.Tensor) -> torch.Tensor:
        """The activation as the kernels see it: quantized to NVFP4 in blocks of 16 along K with
        its own per-tensor scale (over all of x) and decoded, in x's dtype; x itself for a
        weight-only tensor or an empty batch."""
        if self.act_quant is None or x.numel() == 0:
            return x
        p = per_tensor_scale_of(x)
        qdata, scale = nvfp4_quantize(x, p)
        return nvfp4_dequantize(qdata, scale, p, x.dtype)
