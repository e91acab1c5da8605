"""hf_aoq tensors <-> compressed-tensors' stored form (the format vLLM, SGLang and transformers'
compressed-tensors integration read), tensor by tensor, from the format's published layout;
compressed-tensors is never imported. docs/compressed_tensors.md has the mapping:

    hf_aoq                                      compressed-tensors (keys under the module name)
    Int4Tensor symmetric, whole groups          pack-quantized int4 group: weight_packed int32 [N, K/8]
                                                (qdata's bytes as int32), weight_scale [N, K/g], weight_shape
    Int4Tensor asymmetric, zero = -zp * scale   the same, with weight_zero_point packed int32 [N/8, K/g]
    Int8Tensor weight-only, per row or group    pack-quantized int8 channel/group (codes + 128, 4 per int32)
    Int8Tensor dynamic per-token activations    int-quantized: weight int8 [N, K], weight_scale [N, 1]
    Float8Tensor e4m3, per row or per tensor    float-quantized: weight float8 [N, K], weight_scale [N, 1] / [1]

`export_tensor` gives the stored tensors of one weight, or raises NotExact saying why the format
cannot hold it; every export is checked by dequantizing the stored tensors the way
compressed-tensors does and comparing bit for bit with hf_aoq's `dequantize`. `nearest_exportable`
re-quantizes a weight into the nearest form that can go (for --requantize). `import_tensor` is the
way back, exact for every form above.
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass

import torch

from ..core.errors import AOQError, FormatError
from ..core.tensor import AOQTensor
from ..tensors import Float8Tensor, Int4DQTensor, Int4Tensor, Int8Tensor
from ..tensors.int4 import GROUP_SIZES as INT4_GROUP_SIZES

QUANT_METHOD = "compressed-tensors"
PACKED, INT, FLOAT, MIXED = "pack-quantized", "int-quantized", "float-quantized", "mixed-precision"
FORMATS = (PACKED, INT, FLOAT)
# The suffixes a quantized Linear's tensors have in a compressed-tensors checkpoint.
SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight")


class NotExact(AOQError):
    """A weight compressed-tensors cannot hold exactly (the message says why)."""


@dataclass(frozen=True)
class Scheme:
    """One compressed-tensors config group, as far as hf_aoq's types reach: the weights'
    bits, kind ("int" / "float"), strategy ("group", "channel", "tensor") and group size,
    symmetry, and the dynamic input quantization (None, "token" or "tensor")."""

    format: str
    num_bits: int
    type: str
    strategy: str
    group_size: int | None = None
    symmetric: bool = True
    inputs: str | None = None

    def weights_json(self) -> dict:
        out = {"num_bits": self.num_bits, "type": self.type, "symmetric": self.symmetric,
               "strategy": self.strategy, "group_size": self.group_size, "dynamic": False, "actorder": None}
        if not self.symmetric:
            out["zp_dtype"] = "torch.int8"
        return out

    def inputs_json(self) -> dict | None:
        if self.inputs is None:
            return None
        return {"num_bits": 8, "type": self.type, "symmetric": True, "strategy": self.inputs, "group_size": None,
                "dynamic": True, "actorder": None}

    def describe(self) -> str:
        grain = f"group {self.group_size}" if self.strategy == "group" else f"per {self.strategy}"
        kind = "fp8 e4m3" if self.type == "float" else f"int{self.num_bits}"
        sym = "" if self.symmetric else ", asymmetric"
        act = f", dynamic {self.type}8 activations per {self.inputs}" if self.inputs else ", weight-only"
        return f"{self.format} {kind} {grain}{sym}{act}"


# ---------------------------------------------------------------------- packing
def _bytes_to_int32(b: torch.Tensor) -> torch.Tensor:
    """uint8 [N, B] -> int32 [N, ceil(B / 4)]: byte j of a row is bits 8j.. of its words (the
    little-endian order compressed-tensors packs in; zero bytes pad the last word)."""
    pad = -b.shape[-1] % 4
    if pad:
        b = torch.cat([b, b.new_zeros(*b.shape[:-1], pad)], dim=-1)
    b = b.contiguous()
    if sys.byteorder == "big":
        b = b.reshape(*b.shape[:-1], -1, 4).flip(-1).reshape(b.shape)
    return b.view(torch.int32)


def _int32_to_bytes(w: torch.Tensor, nbytes: int) -> torch.Tensor:
    b = w.contiguous().view(torch.uint8)
    if sys.byteorder == "big":
        b = b.reshape(*w.shape, 4).flip(-1).reshape(b.shape)
    return b[..., :nbytes].contiguous()


def _pack_zero_points(zp: torch.Tensor) -> torch.Tensor:
    """int zero points [N, G] in [-8, 7] -> int32 [ceil(N / 8), G], packed along N (dim 0)."""
    codes = (zp.to(torch.int16) + 8).to(torch.uint8).t()  # [G, N]
    if codes.shape[1] % 2:
        codes = torch.cat([codes, codes.new_zeros(codes.shape[0], 1)], dim=1)
    return _bytes_to_int32(codes[:, 0::2] | (codes[:, 1::2] << 4)).t().contiguous()


def _unpack_zero_points(packed: torch.Tensor, n: int) -> torch.Tensor:
    b = _int32_to_bytes(packed.t(), -(-n // 2))
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(b.shape[0], -1)[:, :n]
    return (codes.to(torch.int16) - 8).t().contiguous()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


# ---------------------------------------------------------------------- hf_aoq -> compressed-tensors
def _ct_dequantize(q: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, block: int, dtype) -> torch.Tensor:
    """compressed-tensors' dequantization: codes in the scale's dtype, minus the zero point,
    times the scale, then the model's dtype."""
    s = scale.reshape(scale.shape[0], -1)
    x = q.to(s.dtype).reshape(q.shape[0], -1, block) if s.shape[1] > 1 else q.to(s.dtype).unsqueeze(1)
    if zp is not None:
        x = x - zp.to(s.dtype).unsqueeze(-1)
    return (x * s.unsqueeze(-1)).reshape(q.shape).to(dtype)


def scheme_of(t: AOQTensor) -> Scheme:
    """The config group a weight goes into, or NotExact saying why none holds it."""
    c = t.to_canonical() if hasattr(t, "to_canonical") else t
    if getattr(c, "input_scale", None) is not None:
        raise NotExact("activation-aware input scales (input_scale, AWQ where no fold was possible): "
                       "compressed-tensors has no per-input-channel scale")
    if isinstance(c, Int4DQTensor):
        raise NotExact("Int4DQ stores 4-bit indices into per-row grids for its group scales; compressed-tensors "
                       "has one float scale per group")
    shape = tuple(c.shape)
    if len(shape) != 2:
        raise NotExact(f"shape {shape} is not a 2-D linear weight")
    n, k = shape
    if isinstance(c, Int4Tensor):
        g = c.group_size
        if c.act_quant is not None:
            raise NotExact(f"activations quantized to {c.act_dtype} per token at run time: hf_aoq exports int4 "
                           "weight-only groups")
        if k % g:
            raise NotExact(f"input dimension {k} ends in a partial group of {k % g} (groups of {g}); "
                           f"compressed-tensors needs whole groups")
        symmetric = c.zero is None or not bool(c.zero.any())
        return Scheme(PACKED, 4, "int", "group", g, symmetric)
    if isinstance(c, Int8Tensor):
        b = c.block_size
        if b[0] != 1:
            raise NotExact(f"block_size {b}: the saved transpose of an int8 weight (scales per column)")
        if c.act_quant == "per_token":
            return Scheme(INT, 8, "int", "channel", None, True, "token")
        return Scheme(PACKED, 8, "int", "channel" if b[1] == k else "group", None if b[1] == k else b[1])
    if isinstance(c, Float8Tensor):
        if c.qdata.dtype != torch.float8_e4m3fn:
            raise NotExact(f"{c.qdata.dtype}: compressed-tensors' float8 is e4m3fn")
        if c.act_dtype not in (None, torch.float8_e4m3fn):
            raise NotExact(f"activations in {c.act_dtype}: compressed-tensors' float8 is e4m3fn")
        b = tuple(c.block_size)
        if b == (1, k):
            strategy = "channel"
        elif b == (n, k):
            strategy = "tensor"
        else:
            raise NotExact(f"block_size {b}: the saved transpose of a float8 weight (scales per column)")
        if c.act_quant == "static":
            raise NotExact("a static activation scale (act_scale): hf_aoq exports dynamic float8 activations only")
        inputs = {None: None, "per_row": "token", "per_tensor": "tensor"}[c.act_quant]
        return Scheme(FLOAT, 8, "float", strategy, None, True, inputs)
    raise NotExact(f"{type(c).__name__} has no compressed-tensors form")


def export_tensor(t: AOQTensor) -> tuple[Scheme, dict[str, torch.Tensor]]:
    """(config group, {suffix: stored tensor}) of one weight, exactly; NotExact otherwise."""
    scheme = scheme_of(t)
    c = t.to_canonical()
    n, k = c.shape
    if isinstance(c, Int4Tensor):
        g = c.group_size
        stored = {"weight_packed": _bytes_to_int32(c.qdata), "weight_scale": c.scale.contiguous(),
                  "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        q = _nibbles(c.qdata).to(torch.int16) - 8
        zp = None
        if not scheme.symmetric:
            zp = _zero_points(c)
            stored["weight_zero_point"] = _pack_zero_points(zp)
        ct = _ct_dequantize(q, c.scale, zp, g, c.dtype)
    elif isinstance(c, Int8Tensor):
        scale = c.scale.contiguous()
        block = c.block_size[1]
        if scheme.format == INT:
            stored = {"weight": c.qdata.contiguous(), "weight_scale": scale}
        else:
            stored = {"weight_packed": _bytes_to_int32((c.qdata.view(torch.uint8) ^ 0x80).contiguous()),
                      "weight_scale": scale, "weight_shape": torch.tensor([n, k], dtype=torch.int64)}
        ct = _ct_dequantize(c.qdata, scale, None, block, c.dtype)
    else:
        scale = c.scale.reshape(1) if scheme.strategy == "tensor" else c.scale.contiguous()
        stored = {"weight": c.qdata.contiguous(), "weight_scale": scale.contiguous()}
        ct = _ct_dequantize(c.qdata, scale.reshape(-1, 1), None, k, c.dtype)
    if not torch.equal(ct, c.dequantize()):
        raise NotExact("compressed-tensors' dequantization of the stored tensors would differ from hf_aoq's "
                       "(rounding of the scale arithmetic)")
    return scheme, stored


def _zero_points(c: Int4Tensor) -> torch.Tensor:
    """The integer zero points zp with zero = -zp * scale, or NotExact."""
    s, z = c.scale.float(), c.zero.float()
    zp = torch.where(s != 0, -z / torch.where(s != 0, s, torch.ones_like(s)), torch.zeros_like(s))
    r = zp.round()
    if not bool(((r == zp) & (r >= -8) & (r <= 7)).all()) or not torch.equal((-r * s).to(c.zero.dtype), c.zero):
        raise NotExact("asymmetric int4 with zeros that are not whole multiples -8..7 of the scale; "
                       "compressed-tensors' zero points are integers")
    return r.to(torch.int16)


def nearest_exportable(t: AOQTensor, name: str) -> tuple[AOQTensor | None, str]:
    """For --requantize: the weight re-quantized from its dequantized values into the nearest
    form compressed-tensors holds, and what was done; (None, why) when it stays in float."""
    c = t.to_canonical() if hasattr(t, "to_canonical") else t
    w = c.dequantize()
    if w.ndim != 2:
        return None, "kept in float (not a 2-D weight)"
    k = w.shape[1]
    if isinstance(c, (Int4Tensor, Int4DQTensor)):
        g = c.group_size if hasattr(c, "group_size") else c.block_size[-1]
        fits = [s for s in (g, 128, 64, 32) if s in INT4_GROUP_SIZES and k % s == 0]
        if not fits:
            return None, f"kept in float: input dimension {k} is not a multiple of 32"
        out = Int4Tensor.from_float(w, fits[0], symmetric=True, name=name)
        return out, f"re-quantized to symmetric int4, group {fits[0]}"
    if isinstance(c, Int8Tensor):
        return Int8Tensor.from_float(w, None, act_quant=c.act_quant, name=name), "re-quantized to int8 per row"
    if isinstance(c, Float8Tensor):
        from ..core.granularity import PerRow, PerTensor

        gran = PerTensor() if tuple(c.block_size) == tuple(c.shape) else PerRow()
        act = None if c.act_quant is None else torch.float8_e4m3fn
        act_quant = "per_tensor" if c.act_quant == "static" else c.act_quant  # the nearest: dynamic per tensor
        out = Float8Tensor.from_float(w, torch.float8_e4m3fn, gran, act_quant, act, name=name)
        return out, "re-quantized to float8 e4m3" + (" (static activations become dynamic)" if act_quant != c.act_quant else "")
    return None, f"kept in float ({type(c).__name__} has no compressed-tensors form)"


# ---------------------------------------------------------------------- compressed-tensors -> hf_aoq
def parse_scheme(group: dict, fmt: str | None, where: str) -> Scheme:
    """A config group of a compressed-tensors quantization_config, or FormatError naming what
    hf_aoq has no type for."""
    if not isinstance(group, dict):
        raise FormatError(f"{where}: expected an object, got {type(group).__name__}")
    fmt = group.get("format") or fmt
    w, a = group.get("weights"), group.get("input_activations")
    if group.get("output_activations") is not None:
        raise FormatError(f"{where}: output activation quantization has no hf_aoq scheme")
    if not isinstance(w, dict):
        raise FormatError(f"{where}: no weights quantization")
    bits, kind, strategy = w.get("num_bits"), w.get("type", "int"), w.get("strategy")
    group_size, symmetric = w.get("group_size"), w.get("symmetric", True)
    if w.get("dynamic") not in (False, None) or w.get("actorder") not in (None, False, "weight", "static"):
        raise FormatError(f"{where}: dynamic weights or activation reordering (g_idx) have no hf_aoq scheme")
    if strategy == "channel" or (strategy is None and group_size == -1):
        strategy, group_size = "channel", None
    inputs = None
    if a is not None:
        if not (isinstance(a, dict) and a.get("dynamic") is True and a.get("symmetric", True)
                and a.get("num_bits") == 8 and a.get("type") == kind and a.get("strategy") in ("token", "tensor")):
            raise FormatError(f"{where}: input activations {a!r}: hf_aoq quantizes activations dynamically, "
                              f"symmetrically, to 8 bits of the weights' kind, per token or per tensor")
        inputs = a["strategy"]
    scheme = Scheme(fmt, bits, kind, strategy, group_size, bool(symmetric), inputs)
    ok = (
        (fmt == PACKED and kind == "int" and bits == 4 and strategy == "group" and group_size in INT4_GROUP_SIZES
         and inputs is None)
        or (fmt == PACKED and kind == "int" and bits == 8 and symmetric and strategy in ("channel", "group")
            and inputs is None)
        or (fmt in (INT, "naive-quantized") and kind == "int" and bits == 8 and symmetric
            and (strategy == "channel" or (strategy == "group" and inputs is None)) and inputs in (None, "token"))
        or (fmt in (FLOAT, "naive-quantized") and kind == "float" and bits == 8 and symmetric
            and strategy in ("channel", "tensor") and inputs in (None, {"channel": "token", "tensor": "tensor"}[strategy]))
    )
    if not ok:
        raise FormatError(f"{where}: {fmt} {kind}{bits} {strategy} (group {group_size}, symmetric {symmetric}, "
                          f"inputs {inputs}) has no exact hf_aoq type")
    return scheme


def import_tensor(name: str, scheme: Scheme, stored: dict[str, torch.Tensor], dtype: torch.dtype) -> AOQTensor:
    """The hf_aoq tensor for one module's stored tensors ({suffix: tensor}); FormatError
    naming the module and the tensor for anything that does not match the scheme."""
    def get(suffix, dtypes, shape=None):
        t = stored.get(suffix)
        if t is None:
            raise FormatError(f"{name}.{suffix}: missing ({scheme.describe()})")
        if t.dtype not in dtypes or (shape is not None and tuple(t.shape) != tuple(shape)):
            raise FormatError(f"{name}.{suffix}: {t.dtype} {tuple(t.shape)}, expected one of {dtypes}"
                              + (f" of shape {tuple(shape)}" if shape is not None else ""))
        return t

    floats = (torch.float32, torch.bfloat16, torch.float16)
    expected = {"weight_packed", "weight_scale", "weight_shape"} if scheme.format == PACKED else {"weight", "weight_scale"}
    if not scheme.symmetric:
        expected.add("weight_zero_point")
    unexpected = set(stored) - expected
    if unexpected:
        raise FormatError(f"{name}: stored tensors {sorted(unexpected)} do not belong to {scheme.describe()} "
                          f"(static input scales, g_idx, ...); hf_aoq has no type that holds them")
    if scheme.format == PACKED:
        n, k = (int(v) for v in get("weight_shape", (torch.int64, torch.int32), (2,)).tolist())
        per_word = 32 // scheme.num_bits
        packed = get("weight_packed", (torch.int32,), (n, -(-k // per_word)))
        g = k if scheme.strategy == "channel" else scheme.group_size
        if k % g:
            raise FormatError(f"{name}: input dimension {k} is not a multiple of the group size {g}")
        scale = get("weight_scale", floats, (n, k // g))
        if scheme.num_bits == 4:
            if k % 2:
                raise FormatError(f"{name}: odd input dimension {k} cannot hold packed int4")
            qdata = _int32_to_bytes(packed, k // 2)
            zero = None
            if not scheme.symmetric:
                zp = _unpack_zero_points(get("weight_zero_point", (torch.int32,), (-(-n // 8), k // g)), n)
                zero = (-zp.to(torch.float32) * scale.float())
                if not torch.equal(zero.to(scale.dtype).float(), zero):
                    scale = scale.float()
                zero = zero.to(scale.dtype).contiguous()
            return Int4Tensor(qdata, scale.contiguous(), (1, g), (n, k), dtype, zero=zero)
        codes = (_int32_to_bytes(packed, k) ^ 0x80).view(torch.int8)
        return Int8Tensor(codes.contiguous(), scale.float().contiguous(), (1, g), (n, k), dtype)
    weight = get("weight", (torch.int8,) if scheme.type == "int" else (torch.float8_e4m3fn,))
    if weight.ndim != 2:
        raise FormatError(f"{name}.weight: shape {tuple(weight.shape)} is not 2-D")
    n, k = weight.shape
    if scheme.type == "int":
        g = k if scheme.strategy == "channel" else scheme.group_size
        if k % g:
            raise FormatError(f"{name}: input dimension {k} is not a multiple of the group size {g}")
        scale = get("weight_scale", floats, (n, k // g))
        act = "per_token" if scheme.inputs == "token" else None
        return Int8Tensor(weight.contiguous(), scale.float().contiguous(), (1, g), (n, k), dtype, act_quant=act)
    if scheme.strategy == "tensor":
        scale = get("weight_scale", floats)
        if scale.numel() != 1:
            raise FormatError(f"{name}.weight_scale: {tuple(scale.shape)}, expected one value (per tensor)")
        scale, block = scale.float().reshape(1, 1), (n, k)
    else:
        scale, block = get("weight_scale", floats, (n, 1)).float(), (1, k)
    act = {None: None, "token": "per_row", "tensor": "per_tensor"}[scheme.inputs]
    return Float8Tensor(weight.contiguous(), scale.contiguous(), block, (n, k), dtype, act_quant=act,
                        act_dtype=None if act is None else torch.float8_e4m3fn)


def targets_match(module: str, target: str) -> bool:
    """compressed-tensors' name matching: an exact name, "re:" a regex (matched from the start,
    as its matcher does), or the class name "Linear" (every module with stored quantized
    tensors is a Linear)."""
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module or target == "Linear"


def quantization_config(groups: dict[Scheme, list[str]], ignore: list[str]) -> dict:
    """config.json's quantization_config for these config groups (each listing its modules by
    exact name) and ignored modules."""
    formats = sorted({s.format for s in groups})
    config_groups = {}
    for i, (scheme, modules) in enumerate(groups.items()):
        config_groups[f"group_{i}"] = {"targets": sorted(modules), "weights": scheme.weights_json(),
                                       "input_activations": scheme.inputs_json(), "output_activations": None,
                                       "format": scheme.format}
    return {"quant_method": QUANT_METHOD, "format": formats[0] if len(formats) == 1 else MIXED,
            "quantization_status": "compressed", "config_groups": config_groups, "ignore": sorted(ignore),
            "kv_cache_scheme": None, "global_compression_ratio": None}
