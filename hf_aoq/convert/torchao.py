"""Convert a checkpoint written by torchao's safetensors support into an hf_aoq checkpoint.

`torchao_format` reads torchao's tensors and metadata strictly (torchao is never imported);
this module maps each torchao tensor to an hf_aoq tensor type and writes the hf_aoq checkpoint.
docs/torchao.md describes the format and the mapping:

    torchao                                   hf_aoq
    Int4Tensor (plain int4, mslk)             Int4Tensor      codes + 8, scale/zero transposed; with
                                                              float8 activations: act_quant per_token
    Int8Tensor (symmetric)                    Int8Tensor      per row, per group; per tensor as rows
    Float8Tensor (per row / per tensor)       Float8Tensor
    IntxUnpackedToInt8Tensor int4, group      Int4Tensor      zero = -zero_point * scale
                             int8, symmetric  Int8Tensor
                             other int1-int8  IntxTensor      codes + 2^(b-1), bit-packed
                             any, with int8   IntxTensor      act_quant per_token_asymmetric
                             asym per-token
                             activations
    MXTensor (mx_formats) MXFP8, MXFP4        MXTensor        the same codes and e8m0 scales (torchao_mx.py)
    NVFP4Tensor (2-D, plain or swizzled       NVFP4Tensor     bits copied; no per-tensor scale = 1;
                 e4m3 scales)                                 dynamic NVFP4 activations: act_quant nvfp4

Anything else (another torchao type, another bit width or block shape, asymmetric int8 in
Int8Tensor, activation pre-scales, static activation scales) is refused with an error that names the tensor
and what it uses, so a conversion never produces a model that computes something else. Every
converted weight is dequantized both ways (torchao's formula on torchao's fields, and hf_aoq's
`dequantize`) and the two must agree to the rounding of the weight's dtype.
"""
from __future__ import annotations

import json
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..configs import (
    AOQBaseConfig,
    Float8DynamicActivationFloat8WeightConfig,
    Float8DynamicActivationInt4WeightConfig,
    Float8WeightOnlyConfig,
    INT_DTYPES_BY_BITS,
    FqnToConfig,
    Int4WeightOnlyConfig,
    Int8DynamicActivationInt8WeightConfig,
    Int8DynamicActivationIntxWeightConfig,
    Int8WeightOnlyConfig,
    IntxWeightOnlyConfig,
)
from ..core.errors import AOQError
from ..core.granularity import PerGroup, PerRow, PerTensor
from ..core.primitives import pack_int4
from ..core.tensor import AOQTensor
from ..serialization import replace_folder, save_shards, write_atomic
from ..serialization.common import read_json_file
from ..tensors import Float8Tensor, Int4Tensor, Int8Tensor, IntxTensor
from ..tensors import intx
from ..tensors.int4 import GROUP_SIZES
from .torchao_mx import MX_SPEC, mx_tensor
from . import torchao_nvfp4
from .torchao_format import (
    FLOAT8_DTYPES,
    FLOAT_DTYPES,
    INDEX_NAME,
    INT_DTYPES,
    PICKLE_SUFFIXES,
    WEIGHTS_NAME,
    Dtype,
    Enum,
    Obj,
    Record,
    Spec,
    TorchaoConversionError,
    parse_records,
    read_checkpoint,
    show,
)

CONFIG_NAME = "config.json"
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3


@dataclass
class TensorConversion:
    """One quantized weight: what torchao stored and what hf_aoq got."""

    name: str
    torchao_type: str
    aoq_type: str
    detail: str  # e.g. "int4, group 32, asymmetric"
    shape: tuple[int, ...]


@dataclass
class ConversionSummary:
    src: str
    dst: str
    tensors: list[TensorConversion] = field(default_factory=list)
    plain_tensors: int = 0
    copied_files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def format(self) -> str:
        """A short report: one line per kind of conversion, then the notes."""
        kinds: dict[tuple[str, str, str], int] = {}
        for t in self.tensors:
            key = (t.torchao_type, t.aoq_type, t.detail)
            kinds[key] = kinds.get(key, 0) + 1
        lines = [f"converted {self.src} -> {self.dst}"]
        for (src_type, dst_type, detail), n in sorted(kinds.items()):
            lines.append(f"  {n:5d} x {src_type} -> {dst_type} ({detail})")
        lines.append(f"  {self.plain_tensors:5d} plain tensors copied unchanged")
        if self.copied_files:
            lines.append(f"  files copied: {', '.join(self.copied_files)}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _weight_2d(r: Record, shape: tuple[int, ...]) -> tuple[int, int]:
    if len(shape) != 2:
        raise r.fail(f"shape {shape} is not 2-D; this converter maps torchao's 2-D layouts of this type "
                     f"only (3-D MoE weights are not converted)")
    return shape


def _grid(r: Record, shape: tuple[int, int], block: tuple[int, ...]) -> tuple[int, int]:
    if len(block) != 2 or shape[0] % block[0] or shape[1] % block[1]:
        raise r.fail(f"block_size {list(block)} does not tile shape {list(shape)}")
    return shape[0] // block[0], shape[1] // block[1]


def _check_close(r: Record, got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """hf_aoq's dequantized weight against torchao's formula on torchao's fields: equal up to the
    final rounding to the weight's dtype, plus a few float32 steps of the row's largest value
    (hf_aoq adds `zero` in float32, which can round where torchao's `(q - zero_point) * scale`
    does not; in bfloat16 and float16 the two are exactly equal)."""
    got, want = got.float(), want.float()
    if got.shape != want.shape:
        raise r.fail(f"converted weight has shape {tuple(got.shape)}, torchao's {tuple(want.shape)}")
    row_max = want.abs().amax(dim=-1, keepdim=True)
    f32 = torch.finfo(torch.float32)
    bound = want.abs() * (2 * torch.finfo(dtype).eps) + row_max * (4 * f32.eps) + f32.tiny
    diff = (got - want).abs()
    if not bool((diff <= bound).all()):
        raise r.fail(f"the converted weight does not match torchao's dequantization "
                     f"(max difference {float(diff.max()):g}); please report this")


def _signed_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """torchao/mslk int4 packing: int8 bytes, two's-complement nibbles, even column low -> int8 codes."""
    low = torch.bitwise_left_shift(packed, 4) >> 4  # arithmetic shift sign-extends
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _int4_tensor(r: Record):
    """torchao Int4Tensor (plain, "version 2"): qdata int8 [N, K/2] (two's-complement nibbles, even
    column in the low nibble), scale and zero_point [K/g, N]; w = q * scale + zero_point."""
    shape = _weight_2d(r, r.ints("shape"))
    n, k = shape
    block = r.ints("block_size", 2)
    if block[0] != 1 or block[1] not in GROUP_SIZES:
        raise r.fail(f"block_size {list(block)}: hf_aoq's int4 takes groups of one row and {GROUP_SIZES} columns")
    act = r.attributes.get("activation_dtype")
    float8_acts = act == Dtype("float8_e4m3fn")  # torchao's Float8DynamicActivationInt4WeightConfig: per row
    if act is not None and act != Dtype("bfloat16") and not float8_acts:
        raise r.fail(f"activation_dtype {show(act)}: hf_aoq's int4 takes bfloat16 (weight-only) or "
                     f"float8_e4m3fn (per-token float8) activations")
    r.unset("act_pre_scale", "torchao multiplies activations by it before the matmul")
    g = block[1]
    grid = _grid(r, shape, block)
    if k % 2:
        raise r.fail(f"shape {list(shape)}: an odd input dimension cannot hold packed int4")
    qdata = r.tensor("qdata", (torch.int8, torch.uint8), (n, k // 2))
    scale = r.tensor("scale", tuple(FLOAT_DTYPES.values()), (grid[1], grid[0]))
    zero = r.tensor("zero_point", (scale.dtype,), (grid[1], grid[0]))
    dtype = scale.dtype
    # Signed nibble s <-> hf_aoq code s + 8: flipping the top bit of each nibble does exactly that.
    codes = qdata.view(torch.uint8) ^ 0x88
    scale_t, zero_t = scale.t().contiguous(), zero.t().contiguous()
    symmetric = not bool(zero_t.any())
    act_fields = {"act_quant": "per_token", "act_dtype": torch.float8_e4m3fn} if float8_acts else {}
    out = Int4Tensor(codes.contiguous(), scale_t, (1, g), shape, dtype, zero=None if symmetric else zero_t,
                     **act_fields)
    q = _signed_nibbles(qdata.view(torch.int8)).float().reshape(n, grid[1], g)
    want = (q * scale_t.float().unsqueeze(-1) + zero_t.float().unsqueeze(-1)).reshape(n, k)
    detail = f"int4, group {g}, {'symmetric' if symmetric else 'asymmetric'}"
    if float8_acts:
        config = Float8DynamicActivationInt4WeightConfig(
            group_size=g, mapping_type="symmetric" if symmetric else "asymmetric")
        return out, config, detail + ", dynamic float8_e4m3fn activations per token", want.to(dtype)
    return out, Int4WeightOnlyConfig(group_size=g, symmetric=symmetric), detail, want.to(dtype)


def _int8_codes(r: Record):
    """The int8 codes of a 2-D torchao weight and what frames them: (qdata, shape, dtype,
    block_size, the block grid its scales and zero points must have)."""
    qdata = r.tensor("qdata", (torch.int8,))
    shape = _weight_2d(r, tuple(qdata.shape))
    dtype = r.float_dtype("dtype")
    block = r.ints("block_size", 2)
    return qdata, shape, dtype, block, _grid(r, shape, block)


def _int8_tensor(r: Record):
    """torchao Int8Tensor: qdata int8 [N, K], scale float32 per block, zero_point int8 (zero
    when symmetric); w = (q - zero_point) * scale. Optional dynamic per-row int8 activations."""
    qdata, shape, dtype, block, grid = _int8_codes(r)
    n, k = shape
    scale = r.tensor("scale", tuple(FLOAT_DTYPES.values()), grid)
    zp = r.fields.get("zero_point")
    if zp is not None:
        zp = r.tensor("zero_point", (torch.int8, torch.int16, torch.int32) + tuple(FLOAT_DTYPES.values()), grid)
        if bool(zp.any()):
            raise r.fail("non-zero zero_point (asymmetric int8 weights): hf_aoq's Int8Tensor is symmetric")
    for f, why in (
        ("act_quant_scale", "a static activation scale"),
        ("act_quant_zero_point", "a static activation zero point"),
        ("act_pre_scale", "torchao multiplies activations by it before the matmul"),
    ):
        r.unset(f, why)
    if block == (n, k):  # per tensor: the same scale on every row is exactly per row
        scale, block = scale.reshape(1, 1).expand(n, 1).contiguous(), (1, k)
    if block[0] != 1:
        raise r.fail(f"block_size {list(block)}: hf_aoq's Int8Tensor has blocks of one row (per row or per group)")
    act_quant, act_detail = None, "weight-only"
    kwargs = r.attributes.get("act_quant_kwargs")
    if kwargs is not None:
        if not (isinstance(kwargs, Obj) and kwargs.type == "QuantizeTensorToInt8Kwargs"):
            raise r.fail(f"act_quant_kwargs {show(kwargs)} is not QuantizeTensorToInt8Kwargs")
        extra = set(kwargs.data) - {"granularity", "mapping_type", "reduce_range"}
        gran = kwargs.data.get("granularity")
        mapping = kwargs.data.get("mapping_type", Enum("MappingType", "SYMMETRIC"))
        if extra or not _is_per_row(gran) or mapping != Enum("MappingType", "SYMMETRIC") \
                or kwargs.data.get("reduce_range", False) is not False or block[1] != k:
            raise r.fail(
                f"act_quant_kwargs {show(kwargs)} with block_size {list(block)}: hf_aoq's dynamic int8 "
                f"quantizes activations symmetrically per token (row), full range, with per-row weights"
            )
        act_quant, act_detail = "per_token", "dynamic per-token int8 activations"
    if r.attributes.get("reduce_range") not in (None, False) and act_quant is not None:
        raise r.fail("reduce_range=True with dynamic activations: hf_aoq quantizes activations to the full int8 range")
    out = Int8Tensor(qdata.contiguous(), scale.float().contiguous(), block, shape, dtype, act_quant=act_quant)
    want = qdata.to(dtype) * scale.float().repeat_interleave(block[1], dim=1)
    group = "per row" if block[1] == k else f"group {block[1]}"
    config = (
        Int8DynamicActivationInt8WeightConfig() if act_quant
        else Int8WeightOnlyConfig(group_size=None if block[1] == k else block[1])
    )
    return out, config, f"int8, {group}, {act_detail}", want.to(dtype)


def _is_per_row(g: Any) -> bool:
    return isinstance(g, Obj) and g.type == "PerRow" and g.data.get("dim", -1) in (-1, 1) and set(g.data) <= {"dim"}


def _is_per_tensor(g: Any) -> bool:
    return isinstance(g, Obj) and g.type == "PerTensor" and not g.data


def _float8_tensor(r: Record):
    """torchao Float8Tensor: qdata float8 [N, K], scale float32 [N, 1] (per row) or [1, 1] (per
    tensor); w = q * scale. Optional dynamic float8 activations (act_quant_kwargs)."""
    qdata = r.tensor("qdata", tuple(FLOAT8_DTYPES.values()))
    shape = _weight_2d(r, tuple(qdata.shape))
    n, k = shape
    dtype = r.float_dtype("dtype")
    block = r.ints("block_size", 2) if r.attributes.get("block_size") is not None else None
    if block == (1, k):
        granularity, gname = PerRow(), "per row"
    elif block == (n, k):
        granularity, gname = PerTensor(), "per tensor"
    else:
        raise r.fail(f"block_size {show(r.attributes.get('block_size'))}: hf_aoq's Float8Tensor is per row "
                     f"[1, {k}] or per tensor [{n}, {k}] (block-wise float8 is not converted)")
    scale = r.tensor("scale", (torch.float32,), _grid(r, shape, block))
    act_quant, act_dtype, act_detail = None, None, "weight-only"
    kwargs = r.attributes.get("act_quant_kwargs")
    if kwargs is not None:
        ok_keys = {"float8_dtype", "granularity", "mm_config", "hp_value_lb", "hp_value_ub", "kernel_preference"}
        known = isinstance(kwargs, Obj) and kwargs.type == "QuantizeTensorToFloat8Kwargs"
        if not known or set(kwargs.data) - ok_keys:
            raise r.fail(f"act_quant_kwargs {show(kwargs)} is not QuantizeTensorToFloat8Kwargs as this "
                         f"converter knows it")
        d = kwargs.data
        if d.get("hp_value_lb") is not None or d.get("hp_value_ub") is not None:
            raise r.fail(f"act_quant_kwargs clamps activation scales (hp_value_lb/ub = {show(d.get('hp_value_lb'))}, "
                         f"{show(d.get('hp_value_ub'))}): hf_aoq's float8 activations are not clamped")
        act = d.get("float8_dtype", Dtype("float8_e4m3fn"))
        if not isinstance(act, Dtype) or act.name not in FLOAT8_DTYPES:
            raise r.fail(f"act_quant_kwargs.float8_dtype {show(act)} is not a float8 dtype")
        gran = d.get("granularity")
        if not ((_is_per_row(gran) and isinstance(granularity, PerRow))
                or (_is_per_tensor(gran) and isinstance(granularity, PerTensor))):
            raise r.fail(f"activation granularity {show(gran)} with a {gname} weight: hf_aoq's float8 "
                         f"scheme uses the same granularity (per row or per tensor) for both")
        act_quant = "per_row" if isinstance(granularity, PerRow) else "per_tensor"
        act_dtype = FLOAT8_DTYPES[act.name]
        act_detail = f"dynamic {act.name} activations {gname}"
    out = Float8Tensor(
        qdata.contiguous(), scale.contiguous(), block, shape, dtype, act_quant=act_quant, act_dtype=act_dtype
    )
    want = qdata.float() * scale.expand(n, 1) if block == (1, k) else qdata.float() * scale.reshape(())
    config = (
        Float8DynamicActivationFloat8WeightConfig(
            activation_dtype=act_dtype, weight_dtype=qdata.dtype, granularity=granularity
        )
        if act_quant else Float8WeightOnlyConfig(weight_dtype=qdata.dtype, granularity=granularity)
    )
    return out, config, f"{str(qdata.dtype).removeprefix('torch.')}, {gname}, {act_detail}", want.to(dtype)


def _intx_tensor(r: Record):
    """torchao IntxUnpackedToInt8Tensor: qdata int8 [N, K] holding b-bit codes in [-2^(b-1),
    2^(b-1) - 1], scale and zero_point per block; w = (q - zero_point) * scale."""
    bits_v = r.attributes.get("target_dtype")
    if not isinstance(bits_v, Dtype) or bits_v.name not in INT_DTYPES:
        raise r.fail(f"target_dtype {show(bits_v)} is not torch.int1 .. torch.int8")
    bits = INT_DTYPES[bits_v.name]
    qdata, shape, dtype, block, grid = _int8_codes(r)
    n, k = shape
    act = r.attributes.get("activation_quantization")
    asym_acts = act in _ASYM_PER_TOKEN
    if act is not None and not asym_acts:
        raise r.fail(f"activation_quantization {show(act)}: this converter knows only torchao's "
                     f"'int8_asym_per_token' (or none)")
    scale = r.tensor("scale", tuple(FLOAT_DTYPES.values()), grid)
    zp = r.tensor("zero_point", (torch.int8,) + tuple(FLOAT_DTYPES.values()), grid)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    # torchao's formula, in its order: (q - zero_point) in the weight dtype, times the scale.
    expand = lambda t: t.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)  # noqa: E731
    want = ((qdata.to(dtype) - expand(zp).to(dtype)) * expand(scale)).to(dtype)
    symmetric = not bool(zp.any())
    if asym_acts:  # only IntxTensor has torchao's asymmetric per-token int8 activations
        return _intx_from_codes(r, qdata, scale, zp, bits, symmetric, shape, dtype, block, want,
                                act_quant="per_token_asymmetric")
    if bits == 4:
        if block[0] != 1 or block[1] not in GROUP_SIZES:
            raise r.fail(f"int4 with block_size {list(block)}: hf_aoq's Int4Tensor takes groups of one row and "
                         f"{GROUP_SIZES} columns")
        if bool((qdata < lo).any() or (qdata > hi).any()):
            raise r.fail(f"int4 codes outside [{lo}, {hi}]")
        codes = pack_int4((qdata.to(torch.int16) + 8).to(torch.uint8))
        if symmetric:
            out = Int4Tensor(codes, scale.contiguous(), block, shape, dtype)
        else:
            # zero (value domain) = -zero_point * scale, exact in float32 for int zero points, so
            # the float32 dequantization (q - 8 + 8 - zp) * scale rounds once, like torchao's.
            s32 = scale.float().contiguous()
            out = Int4Tensor(codes, s32, block, shape, dtype, zero=(-zp.float() * s32).contiguous())
        config = Int4WeightOnlyConfig(group_size=block[1], symmetric=symmetric)
        detail = f"int4, group {block[1]}, {'symmetric' if symmetric else 'asymmetric'}"
        return out, config, detail, want
    if bits == 8 and symmetric:
        if block[0] != 1:
            raise r.fail(f"int8 with block_size {list(block)}: hf_aoq's Int8Tensor has blocks of one row")
        out = Int8Tensor(qdata.contiguous(), scale.float().contiguous(), block, shape, dtype)
        group = "per row" if block[1] == k else f"group {block[1]}"
        return out, Int8WeightOnlyConfig(group_size=None if block[1] == k else block[1]), f"int8, {group}", want
    return _intx_from_codes(r, qdata, scale, zp, bits, symmetric, shape, dtype, block, want)


# torchao's IntxUnpackedToInt8TensorActivationQuantization.INT8_ASYM_PER_TOKEN, as its value or as
# an enum object: activations fake-quantized to int8 per token with a zero point before the
# matmul, which is IntxTensor's act_quant "per_token_asymmetric" (kernels.common).
_ASYM_PER_TOKEN = ("int8_asym_per_token", Enum("IntxUnpackedToInt8TensorActivationQuantization", "INT8_ASYM_PER_TOKEN"))


def _intx_from_codes(r: Record, qdata, scale, zp, bits: int, symmetric: bool, shape, dtype, block, want,
                     act_quant: str | None = None):
    """Other bit widths (and asymmetric int8, and any width with torchao's int8 activations):
    IntxTensor, codes q + 2^(b-1) bit-packed, the zero point as in the int4 case
    (zero = -zero_point * scale, in float32)."""
    n, k = shape
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if block[0] != 1 or (block[1] not in intx.GROUP_SIZES and block[1] != k):
        raise r.fail(f"int{bits} with block_size {list(block)}: hf_aoq's IntxTensor takes groups of one row and "
                     f"{intx.GROUP_SIZES} columns, or whole rows")
    if bool((qdata < lo).any() or (qdata > hi).any()):
        raise r.fail(f"int{bits} codes outside [{lo}, {hi}]")
    codes = intx.pack_intx((qdata.to(torch.int16) - lo).to(torch.uint8), bits)
    if symmetric:
        out = IntxTensor(codes, scale.contiguous(), bits, block, shape, dtype, act_quant=act_quant)
    else:
        s32 = scale.float().contiguous()
        out = IntxTensor(codes, s32, bits, block, shape, dtype, zero=(-zp.float() * s32).contiguous(),
                         act_quant=act_quant)
    granularity = PerRow() if block[1] == k else PerGroup(block[1])
    mapping = "symmetric" if symmetric and bits > 1 else "asymmetric"
    group = "per row" if block[1] == k else f"group {block[1]}"
    detail = f"int{bits}, {group}, {'symmetric' if symmetric else 'asymmetric'}"
    if act_quant is None:
        return out, IntxWeightOnlyConfig(INT_DTYPES_BY_BITS[bits], granularity, mapping), detail, want
    config = Int8DynamicActivationIntxWeightConfig(INT_DTYPES_BY_BITS[bits], granularity, mapping,
                                                   act_mapping_type="asymmetric")
    return out, config, detail + ", dynamic asymmetric per-token int8 activations", want


_CONVERTERS: dict[str, tuple[Spec, Callable]] = {
    "Int4Tensor": (
        Spec(frozenset({"qdata", "scale", "zero_point"}), frozenset({"act_pre_scale"}),
              frozenset({"block_size", "shape"}), frozenset({"activation_dtype"})),
        _int4_tensor,
    ),
    "Int8Tensor": (
        Spec(frozenset({"qdata", "scale"}), frozenset({"zero_point", "act_quant_scale", "act_quant_zero_point",
                                                        "act_pre_scale"}),
              frozenset({"block_size", "dtype"}), frozenset({"act_quant_kwargs", "reduce_range"})),
        _int8_tensor,
    ),
    "Float8Tensor": (
        Spec(frozenset({"qdata", "scale"}), frozenset(),
              frozenset({"dtype"}), frozenset({"block_size", "mm_config", "act_quant_kwargs", "kernel_preference"})),
        _float8_tensor,
    ),
    "IntxUnpackedToInt8Tensor": (
        Spec(frozenset({"qdata", "scale", "zero_point"}), frozenset(),
              frozenset({"target_dtype", "block_size", "dtype"}), frozenset({"activation_quantization"})),
        _intx_tensor,
    ),
    "MXTensor": (MX_SPEC, mx_tensor),
    "NVFP4Tensor": (torchao_nvfp4.SPEC, torchao_nvfp4.convert_nvfp4),
}
# torchao types its safetensors support writes that have no hf_aoq equivalent.
_UNSUPPORTED = {
    "Int4TilePackedTo4dTensor": "int4 in tinygemm's CUDA tile packing (hf_aoq's int4 is plain; re-save with "
                                "Int4WeightOnlyConfig(int4_packing_format='plain'))",
    "Int4PlainInt32Tensor": "int4 packed in int32 for XPU/NPU kernels",
    "Int4PreshuffledTensor": "int4 preshuffled for mslk's kernels",
}


def _convert_record(r: Record) -> tuple[AOQTensor, AOQBaseConfig, str]:
    convert = _CONVERTERS[r.type_name][1]
    try:
        tensor, config, detail, want = convert(r)
    except TorchaoConversionError:
        raise
    except AOQError as e:  # a field hf_aoq's own checks refuse
        raise r.fail(str(e)) from None
    try:
        type(tensor).check_fields(tensor.fields())
    except AOQError as e:
        raise r.fail(f"the converted {type(tensor).__name__} is not valid: {e}") from None
    _check_close(r, tensor.dequantize(), want, tensor.dtype)
    return tensor, config, detail


def convert_torchao_checkpoint(
    src, dst, *, overwrite: bool = False, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
) -> ConversionSummary:
    """Convert the torchao checkpoint folder `src` into an hf_aoq checkpoint folder `dst`.

    Writes `dst/model.safetensors` (hf_aoq format, docs/format.md; shards of at most
    `max_shard_size` bytes and `model.safetensors.index.json` when larger), `dst/config.json` with the
    `quantization_config` replaced by an `AOQConfig` recipe naming each converted weight, and copies
    the other files (tokenizer, generation config, ...). `dst` is written under a temporary name
    and renamed into place: it is either complete or not there. An existing `dst` is an error
    unless `overwrite`. Raises TorchaoConversionError naming the tensor for anything not converted.
    """
    from ..integrations.transformers import AOQConfig  # imports transformers: only when converting

    src, dst = Path(src), Path(dst)
    if not src.is_dir():
        raise TorchaoConversionError(f"{src}: not a folder")
    if dst.exists() and not overwrite:
        raise TorchaoConversionError(f"{dst} already exists; choose a new folder or pass overwrite=True (--overwrite)")
    if dst.resolve() == src.resolve():
        raise TorchaoConversionError(f"{dst}: the destination must differ from the source")
    config_path = src / CONFIG_NAME
    if not config_path.is_file():
        raise TorchaoConversionError(f"{src}: no {CONFIG_NAME}")
    config = read_json_file(config_path, TorchaoConversionError)
    qc = config.get("quantization_config")
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "torchao":
        raise TorchaoConversionError(
            f"{config_path}: quantization_config.quant_method is {method!r}, not 'torchao'; "
            f"this is not a torchao checkpoint"
        )

    tensors, metadata, shards = read_checkpoint(src)
    summary = ConversionSummary(str(src), str(dst))
    state: dict[str, torch.Tensor] = {}
    recipe: dict[str, AOQBaseConfig] = {}
    source = str(shards[0]) if len(shards) == 1 else str(src)
    specs = {name: spec for name, (spec, _) in _CONVERTERS.items()}
    from transformers.utils import logging as hf_logging  # its tqdm: honours disable_progress_bar()

    records = parse_records(tensors, metadata, source, specs, _UNSUPPORTED)
    for kind, name, value in hf_logging.tqdm(records, desc="convert", unit="tensor"):
        if kind == "plain":
            state[name] = value
            summary.plain_tensors += 1
        elif kind == "missing":
            summary.notes.append(
                f"{name} is listed in torchao's metadata but not stored (transformers leaves out tied weights); "
                f"it is left out here too"
            )
        else:
            tensor, cfg, detail = _convert_record(value)
            state[name] = tensor
            recipe[name] = cfg
            summary.tensors.append(TensorConversion(name, value.type_name, type(tensor).__name__, detail,
                                                    tuple(tensor.shape)))
    if any(t.aoq_type == "Int8Tensor" and "dynamic" in t.detail for t in summary.tensors):
        summary.notes.append(
            "dynamic int8 activations: torchao scales each token by absmax/127.5 over [-128, 127], hf_aoq by "
            "absmax/127 over [-127, 127]; the weights convert exactly, outputs differ by activation rounding"
        )
    if not recipe:
        raise TorchaoConversionError(f"{source}: torchao's metadata lists no quantized tensor; nothing to convert")
    config["quantization_config"] = AOQConfig(FqnToConfig(recipe)).to_dict()

    tmp = dst.parent / f".{dst.name}.{secrets.token_hex(6)}.tmp"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        save_shards(state, tmp, max_shard_size)
        write_atomic(tmp / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
        skip = {CONFIG_NAME, WEIGHTS_NAME, INDEX_NAME} | {p.name for p in shards}
        for p in sorted(src.iterdir()):
            if p.name in skip or not p.is_file() or p.suffix in PICKLE_SUFFIXES:
                continue
            shutil.copy2(p, tmp / p.name)
            summary.copied_files.append(p.name)
        _replace_dir(tmp, dst, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return summary


def _replace_dir(tmp: Path, dst: Path, overwrite: bool) -> None:
    """Move the finished `tmp` to `dst`, replacing an old `dst` as a whole (replace_folder)."""
    if dst.exists() and not overwrite:
        raise TorchaoConversionError(f"{dst} appeared during the conversion; not overwriting it")
    replace_folder(tmp, dst)
