"""IntxTensor: 1- to 8-bit integer weights, bit-packed, per row or in groups along the input
dimension, symmetric or asymmetric; weight-only or with int8 per-token activations.

Canonical layout (what is saved), weight [N, K], b = `bits`, g = block_size[1]:
    qdata      uint8 [N, ceil(K * b / 8)]   per row a little-endian bit stream: the code of column
                                            k is stream bits [k*b, (k+1)*b), stream bit i being bit
                                            i % 8 of byte i // 8 (for b = 4, Int4Tensor's nibble
                                            order; every 8 codes are exactly b bytes). Bits past
                                            K * b in a row's last byte are 0.
    scale      [N, ceil(K / g)]             in the weight's dtype
    zero       [N, ceil(K / g)] or None     the value that code 2^(b-1) stands for; None = symmetric
    bits       1 .. 8
    act_quant  None (weight-only), "per_token" (activations quantized to int8 per token at run
               time, exactly as Int8Tensor's: symmetric) or "per_token_asymmetric" (int8 per
               token with a zero point, torchao's "int8_asym_per_token": the reference kernel
               fake-quantizes the activation, kernels.common.fake_quantize_int8_per_token_asymmetric)
    w = (q - 2^(b-1)) * scale + zero        q unsigned in [0, 2^b - 1]

g is one of GROUP_SIZES or K (one group per row). K need not be a multiple of g: the last group
then covers the remaining K % g columns, as Int4Tensor's does.

Scales and zeros are chosen by core.primitives' "mse" search (the least squared reconstruction
error among a few clipping candidates, never worse than the plain min/max range): as for
Int4Tensor, it is the more accurate (README's quality table has the figures).
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError
from ..core.primitives import by_row_chunks, choose_qparams_affine, dequantize_affine, quantize_affine
from ..core.registry import register_tensor_type
from ..kernels.common import fake_quantize_int8_per_token_asymmetric, quantize_int8_per_token
from .common import (
    BlockGridTensor,
    DevicePacked,
    check_built,
    check_grid_fields,
    check_layout,
    check_weight,
    slice_grid,
)

BITS = tuple(range(1, 9))
GROUP_SIZES = (16, 32, 64, 128, 256)  # or K: one group per row
ACT_QUANTS = (None, "per_token", "per_token_asymmetric")
ASYMMETRIC_ACTS = "per_token_asymmetric"  # no integer kernel: the reference fake-quantizes
DEFAULT_QPARAMS = "mse"


def packed_width(k: int, bits: int) -> int:
    """Bytes per row of `k` codes of `bits` bits."""
    return -(-k * bits // 8)


def _check_bits(bits, where: str) -> None:
    if type(bits) is not int or bits not in BITS:
        raise AOQError(f"{where}: bits must be an int in 1..8, got {bits!r}")


def pack_intx(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes in [0, 2^bits) of shape [..., K] into the bit stream of the module
    docstring: [..., ceil(K * bits / 8)] uint8."""
    _check_bits(bits, "pack_intx")
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes.contiguous()
    k = codes.shape[-1]
    lead = codes.shape[:-1]
    pad = -k % 8
    if pad:
        codes = torch.nn.functional.pad(codes, (0, pad))
    # [..., K8/8, 8 codes, bits] -> the same bits as [..., K8/8, bits bytes, 8 bits].
    shifts = torch.arange(bits, dtype=torch.uint8, device=codes.device)
    stream = (codes.reshape(*lead, -1, 8, 1) >> shifts) & 1
    stream = stream.reshape(*lead, -1, bits, 8)
    weights = torch.arange(8, dtype=torch.uint8, device=codes.device)
    packed = (stream << weights).sum(-1, dtype=torch.uint8).reshape(*lead, -1)
    return packed[..., : packed_width(k, bits)].contiguous()


def unpack_intx(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of `pack_intx`: the uint8 codes [..., k] of `packed` [..., ceil(k * bits / 8)]."""
    _check_bits(bits, "unpack_intx")
    if bits == 8:
        return packed[..., :k]
    lead = packed.shape[:-1]
    k8 = -(-k // 8) * 8
    full = k8 * bits // 8
    if packed.shape[-1] != full:
        packed = torch.nn.functional.pad(packed, (0, full - packed.shape[-1]))
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    stream = (packed.reshape(*lead, -1, bits, 1) >> shifts) & 1
    stream = stream.reshape(*lead, -1, 8, bits)
    weights = torch.arange(bits, dtype=torch.uint8, device=packed.device)
    codes = (stream << weights).sum(-1, dtype=torch.uint8).reshape(*lead, k8)
    return codes[..., :k]


def _qrange(bits: int) -> tuple[int, int]:
    return 0, (1 << bits) - 1


@register_tensor_type
class IntxTensor(DevicePacked, BlockGridTensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("bits", "block_size", "shape", "dtype")
    optional_tensor_data_names = ("zero",)
    optional_tensor_attribute_names = ("act_quant", "packing")
    schema_version = 1

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bits: int,
        group_size: int | None = 32,
        symmetric: bool = True,
        act_quant: str | None = None,
        *,
        qparams: str = DEFAULT_QPARAMS,
        name: str = "weight",
    ):
        """Quantize a float [N, K] weight to `bits`-bit codes in groups of `group_size` along K
        (None: one group per row), symmetric (no zero) or asymmetric. `qparams` picks how each
        group's scale and zero are chosen: "mse" (default) or "minmax" (core.primitives)."""
        check_weight(weight, name)
        if type(bits) is not int or bits not in BITS:
            raise AOQError(f"{name}: IntxTensor bits must be one of {BITS}, got {bits!r}")
        if symmetric and bits == 1:
            raise AOQError(f"{name}: 1-bit weights must be asymmetric (symmetric int1 has only the codes -1 and 0)")
        if act_quant not in ACT_QUANTS:
            raise AOQError(f"{name}: IntxTensor act_quant must be one of {ACT_QUANTS}, got {act_quant!r}")
        k = weight.shape[1]
        if group_size is not None and group_size not in GROUP_SIZES:
            raise AOQError(f"{name}: IntxTensor group_size must be one of {GROUP_SIZES} or None (per row), "
                           f"got {group_size!r}")
        block = (1, k if group_size is None else group_size)
        qmin, qmax = _qrange(bits)

        def rows(w):
            scale, zero = choose_qparams_affine(
                w, block, qmin, qmax, symmetric=symmetric, param_dtype=weight.dtype, name=name, method=qparams
            )
            codes = quantize_affine(w, block, scale, zero, qmin, qmax, torch.uint8)
            return pack_intx(codes, bits), scale, zero

        qdata, scale, zero = by_row_chunks(weight, rows)
        out = cls(qdata, scale, bits, block, weight.shape, weight.dtype, zero=zero, act_quant=act_quant)
        return check_built(out, weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        bits = fields.get("bits")
        if type(bits) is not int or bits not in BITS:
            raise AOQError(f"attribute 'bits': {bits!r}, expected an int in 1..8")
        shape = tuple(fields["shape"])
        width = packed_width(shape[-1], bits) if shape else 0
        check_grid_fields(fields, (torch.uint8,), partial_last_block=True, qdata_last_dim=width)
        check_layout(fields, cls.__name__, f"(1, g) with g in {GROUP_SIZES} or K",
                     lambda b, s: len(b) == 2 and b[0] == 1 and (b[1] in GROUP_SIZES or b[1] == s[1]))
        if fields.get("act_quant") not in ACT_QUANTS:
            raise AOQError(f"attribute 'act_quant': {fields['act_quant']!r}, expected one of {ACT_QUANTS}")

    @property
    def group_size(self) -> int:
        return self.block_size[-1]

    def codes(self) -> torch.Tensor:
        """The uint8 codes in [0, 2^bits - 1], shape [N, K]."""
        c = self.to_canonical()
        return unpack_intx(c.qdata, c.bits, c.shape[-1])

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        c = self.to_canonical()
        qmin, qmax = _qrange(c.bits)
        codes = unpack_intx(c.qdata, c.bits, c.shape[-1])
        return dequantize_affine(codes, c.block_size, c.scale, c.zero, qmin, qmax, dtype or self.dtype)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Symmetric int8 codes and float32 scales, one per token (row): Int8Tensor's."""
        if self.act_quant == ASYMMETRIC_ACTS:
            raise AOQError("IntxTensor act_quant 'per_token_asymmetric' has zero points, not symmetric codes; "
                           "only simulate_input_quantization (the reference kernel) takes it")
        return quantize_int8_per_token(x2)

    def simulate_input_quantization(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_quant != ASYMMETRIC_ACTS or x.numel() == 0:
            return super().simulate_input_quantization(x)
        return fake_quantize_int8_per_token_asymmetric(x.reshape(-1, x.shape[-1])).reshape(x.shape)

    def slice_fields(self, dim: int, start: int, end: int) -> "IntxTensor":
        if dim % self.ndim == 0:
            return slice_grid(self, 0, start, end)
        # Along K a slice need not start on a byte: cut the codes, then pack them again.
        c = self.to_canonical()
        cut = slice_grid(c.replace(qdata=c.codes()), 1, start, end)
        return cut.replace(qdata=pack_intx(cut.qdata, c.bits))
