"""hf_aoq tensors <-> GGUF tensor blocks (ggml's quantization formats, from their published block
layouts; neither gguf-py nor llama.cpp is imported). docs/gguf.md has the mapping:

    hf_aoq                                   GGUF (one block per 32 values of a row unless noted)
    Int4Tensor symmetric, group 32           Q4_0: fp16 d, 16 bytes: value j in the low nibble of
                                             byte j, value j+16 in its high nibble; w = d * (q - 8)
    Int4Tensor asymmetric, group 32          Q4_1: fp16 d, fp16 m, the same 16 bytes; w = d * q + m
                                             (hf_aoq: scale = d, zero = m + 8 d)
    Int8Tensor weight-only, group 32         Q8_0: fp16 d, 32 int8 codes; w = d * q
    plain float                              F32 / F16 / BF16 (1-D tensors as F32, as llama.cpp wants)
    (convert only) Q4_K                      Int4Tensor asymmetric, group 32 (float32 scale and zero)
    (convert only) Q6_K                      Int8Tensor, group 16 (6-bit codes, float32 scales)

`export_tensor` gives a weight's (ggml type, raw bytes [N, row bytes]) or raises NotExact saying
why GGUF cannot hold it; every export is checked by decoding the bytes as GGUF readers do
(`decode`, float32) and comparing bit for bit with hf_aoq's `dequantize`. `import_tensor` is the
way back. Row permutations (llama's q/k) act on whole rows, so they are applied to the hf_aoq
fields before encoding and after decoding (`permute_rows`).
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError, FormatError
from ..core.primitives import pack_int4, unpack_int4
from ..core.tensor import AOQTensor
from ..tensors import Int4Tensor, Int8Tensor
from .gguf_file import BF16, F16, F32, GGML_TYPES, Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, type_name

BLOCK = 32
_FLOAT_TYPES = {torch.float32: F32, torch.float16: F16, torch.bfloat16: BF16}
_TORCH_OF = {F32: torch.float32, F16: torch.float16, BF16: torch.bfloat16}


class NotExact(AOQError):
    """A weight GGUF cannot hold exactly (the message says why)."""


# ---------------------------------------------------------------------- small helpers
def _half_bytes(x: torch.Tensor) -> torch.Tensor:
    """float [..] -> uint8 [.., 2]: the fp16 values' little-endian bytes."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(*x.shape, 2)


def _half_of(b: torch.Tensor) -> torch.Tensor:
    """uint8 [.., 2] -> float32 [..]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _fits_fp16(x: torch.Tensor) -> bool:
    x = x.float()
    return bool(torch.isfinite(x).all()) and torch.equal(x.to(torch.float16).float(), x)


def _blocks(raw: torch.Tensor, block_bytes: int) -> torch.Tensor:
    return raw.reshape(raw.shape[0], -1, block_bytes)


def _nibble_bytes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [N, K] in [0, 15] -> [N, K/32, 16]: value j low, value j+16 high."""
    c = codes.reshape(codes.shape[0], -1, 2, 16)
    return c[:, :, 0] | (c[:, :, 1] << 4)


def _codes_of(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 16] nibble bytes -> uint8 codes [N, B * 32]."""
    out = torch.empty(*qs.shape[:-1], 32, dtype=torch.uint8)
    torch.bitwise_and(qs, 0x0F, out=out[..., :16])
    torch.bitwise_right_shift(qs, 4, out=out[..., 16:])
    return out.reshape(qs.shape[0], -1)


def permute_rows(t, rows: torch.Tensor):
    """`t` (an hf_aoq tensor or a plain one) with its rows (dim 0) reordered: row i of the result
    is row rows[i] of `t`. Exact: every field is indexed by whole rows."""
    if isinstance(t, AOQTensor):
        return t.select_rows(rows)
    return t.index_select(0, rows)


def llama_rows(n_rows: int, n_head: int, to_gguf: bool) -> torch.Tensor:
    """The row order llama.cpp's converter gives q_proj (n_head = attention heads) and k_proj
    (n_head = key/value heads): within each head it interleaves the two halves that transformers'
    rotate_half pairs (GGUF row 2i is row i, row 2i+1 is row i + head_dim/2); `to_gguf=False` is
    the inverse, what transformers' GGUF loader undoes."""
    if n_rows % (2 * n_head):
        raise AOQError(f"{n_rows} rows do not split into {n_head} heads of an even size")
    idx = torch.arange(n_rows)
    if to_gguf:
        return idx.reshape(n_head, 2, n_rows // n_head // 2).transpose(1, 2).reshape(-1)
    return idx.reshape(n_head, n_rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


# ---------------------------------------------------------------------- decoding (as GGUF readers do)
def decode(ggml_type: int, raw: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The float32 values of one GGUF tensor's bytes (uint8 [rows, row bytes]), computed as
    llama.cpp's reference dequantization and gguf-py's do it, reshaped to `shape`."""
    if ggml_type in _TORCH_OF:
        return raw.contiguous().view(_TORCH_OF[ggml_type]).float().reshape(shape)
    _, _, size = GGML_TYPES[ggml_type]
    b = _blocks(raw, size)
    if ggml_type == Q4_0:
        out = _half_of(b[..., 0:2]).unsqueeze(-1) * (_codes_of(b[..., 2:18]).reshape(*b.shape[:2], 32).float() - 8)
    elif ggml_type == Q4_1:
        q = _codes_of(b[..., 4:20]).reshape(*b.shape[:2], 32).float()
        out = _half_of(b[..., 0:2]).unsqueeze(-1) * q + _half_of(b[..., 2:4]).unsqueeze(-1)
    elif ggml_type == Q8_0:
        out = _half_of(b[..., 0:2]).unsqueeze(-1) * b[..., 2:34].contiguous().view(torch.int8).float()
    elif ggml_type == Q4_K:
        scale, minimum, q = _q4_k_parts(b)
        out = scale.unsqueeze(-1) * q.float() - minimum.unsqueeze(-1)
    elif ggml_type == Q6_K:
        scale, q = _q6_k_parts(b)
        out = scale.unsqueeze(-1) * q.float()
    else:
        raise FormatError(f"ggml type {type_name(ggml_type)} is not decoded by hf_aoq")
    return out.reshape(shape)


def _q4_k_parts(b: torch.Tensor):
    """Q4_K blocks [N, B, 144] -> float32 scale [N, 8B], min [N, 8B] (w = scale * q - min, per
    32 values) and codes uint8 [N, 8B, 32]. Block: fp16 d, fp16 dmin, 12 bytes of 6-bit scales
    and mins for its 8 sub-blocks, 128 bytes of nibbles (bytes 32p.. hold sub-block 2p low and
    2p+1 high)."""
    n, nb = b.shape[:2]
    d, dmin = _half_of(b[..., 0:2]), _half_of(b[..., 2:4])
    s = b[..., 4:16]
    sc = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], dim=-1).float()
    mn = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1).float()
    qs = b[..., 16:144].reshape(n, nb, 4, 32)
    q = torch.stack([qs & 0x0F, qs >> 4], dim=3).reshape(n, nb * 8, 32)
    return (d.unsqueeze(-1) * sc).reshape(n, -1), (dmin.unsqueeze(-1) * mn).reshape(n, -1), q


def _q6_k_parts(b: torch.Tensor):
    """Q6_K blocks [N, B, 210] -> float32 scale [N, 16B] (per 16 values) and int8 codes
    [N, 16B, 16] in [-32, 31]. Block: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
    scales, fp16 d; each half of 128 values takes 64 low bytes and 32 high bytes: value 32k + l
    of the half is nibble (k >= 2) of low byte l + 32 (k % 2), with bits 2k.. of high byte l."""
    n, nb = b.shape[:2]
    ql = b[..., 0:128].reshape(n, nb, 2, 1, 2, 32)       # half, nibble, chunk-of-32 parity, l
    qh = b[..., 128:192].reshape(n, nb, 2, 1, 32)         # half, l
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3).reshape(n, nb, 2, 4, 32)  # k = 2 * nibble + parity
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 1, 4, 1)
    high = (qh >> shifts) & 3                              # [n, nb, 2, 4, 32]
    q = ((low | (high << 4)).to(torch.int16) - 32).to(torch.int8).reshape(n, nb * 16, 16)
    sc = b[..., 192:208].contiguous().view(torch.int8).float()
    d = _half_of(b[..., 208:210])
    return (d.unsqueeze(-1) * sc).reshape(n, -1), q


# ---------------------------------------------------------------------- hf_aoq -> GGUF
def ggml_type_of(t) -> int:
    """The GGUF type a tensor goes to, or NotExact saying why none holds it."""
    if not isinstance(t, AOQTensor):
        if t.dtype not in _FLOAT_TYPES:
            raise NotExact(f"dtype {t.dtype}: GGUF float tensors are F32, F16 or BF16")
        return F32 if t.ndim == 1 else _FLOAT_TYPES[t.dtype]
    c = t.to_canonical() if hasattr(t, "to_canonical") else t
    shape = tuple(c.shape)
    if len(shape) != 2:
        raise NotExact(f"shape {shape} is not a 2-D weight")
    k = shape[1]
    if getattr(c, "input_scale", None) is not None:
        raise NotExact("activation-aware input scales (input_scale, AWQ where no fold was possible): GGUF has no "
                       "per-input-channel scale")
    if isinstance(c, Int4Tensor):
        if c.group_size != BLOCK:
            raise NotExact(f"int4 in groups of {c.group_size}; GGUF's Q4_0 and Q4_1 have a scale per {BLOCK} "
                           f"values (quantize with --group-size 32, or --target gguf)")
        if k % BLOCK:
            raise NotExact(f"input dimension {k} ends in a partial group of {k % BLOCK}; GGUF rows are whole "
                           f"blocks of {BLOCK}")
        return Q4_0 if c.zero is None else Q4_1
    if isinstance(c, Int8Tensor):
        if c.act_quant is not None:
            raise NotExact("int8 with dynamic int8 activations; GGUF holds weights only (llama.cpp chooses its "
                           "own activation handling) and its Q8_0 has a scale per 32 values, not per row")
        if tuple(c.block_size) != (1, BLOCK):
            raise NotExact(f"int8 block_size {tuple(c.block_size)}; GGUF's Q8_0 has a scale per {BLOCK} values "
                           f"of a row (quantize with --target gguf)")
        return Q8_0
    raise NotExact(f"{type(c).__name__} has no GGUF form (Q4_0, Q4_1, Q8_0 hold int4 and int8 in groups of 32)")


def export_tensor(t) -> tuple[int, torch.Tensor]:
    """(ggml type, raw bytes uint8 [N, row bytes]) of one tensor, exactly; NotExact otherwise."""
    ggml_type = ggml_type_of(t)
    if not isinstance(t, AOQTensor):
        x = t.detach().float().contiguous() if ggml_type == F32 else t.detach().contiguous()
        raw = x.view(torch.uint8).reshape(x.shape[0] if x.ndim > 1 else 1, -1)
        return ggml_type, raw
    c = t.to_canonical()
    n, k = c.shape
    if isinstance(c, Int4Tensor):
        if not _fits_fp16(c.scale):
            raise NotExact(f"a scale ({_first_misfit(c.scale)}) is not an fp16 value; GGUF's Q4 blocks keep fp16 "
                           f"scales")
        qs = _nibble_bytes(unpack_int4(c.qdata))
        if c.zero is None:
            raw = torch.cat([_half_bytes(c.scale), qs], dim=-1)
        else:
            m = c.zero.float() - 8 * c.scale.float()
            if not _fits_fp16(m):
                raise NotExact(f"a block minimum zero - 8 * scale ({_first_misfit(m)}) is not an fp16 value; "
                               f"GGUF's Q4_1 keeps an fp16 minimum per block")
            raw = torch.cat([_half_bytes(c.scale), _half_bytes(m), qs], dim=-1)
    else:
        if not _fits_fp16(c.scale):
            raise NotExact(f"a scale ({_first_misfit(c.scale)}) is not an fp16 value; GGUF's Q8_0 keeps fp16 scales "
                           f"(quantize with --target gguf, which chooses fp16 scales)")
        codes = c.qdata.contiguous().view(torch.uint8).reshape(n, -1, BLOCK)
        raw = torch.cat([_half_bytes(c.scale), codes], dim=-1)
    raw = raw.reshape(n, -1).contiguous()
    if not torch.equal(decode(ggml_type, raw, (n, k)).to(c.dtype), c.dequantize()):
        why = "m + d * q rounds differently from hf_aoq's (q - 8) * scale + zero" if ggml_type == Q4_1 else \
            "the block arithmetic rounds differently"
        raise NotExact(f"GGUF's dequantization of the {type_name(ggml_type)} blocks would differ from hf_aoq's ({why})")
    return ggml_type, raw


def _first_misfit(x: torch.Tensor) -> str:
    flat = x.float().reshape(-1)
    bad = (flat.to(torch.float16).float() != flat).nonzero()
    return f"{float(flat[bad[0, 0]]):.9g}" if bad.numel() else "?"


def nearest_exportable(t, name: str) -> tuple[AOQTensor | None, str]:
    """For --requantize: the weight re-quantized from its dequantized values into the nearest
    form GGUF holds, and what was done; (None, why) when it is stored as a float tensor."""
    c = t.to_canonical() if hasattr(t, "to_canonical") else t
    w = c.dequantize()
    if w.ndim != 2:
        return None, "stored as a float tensor (not a 2-D weight)"
    if w.shape[1] % BLOCK:
        return None, f"stored as a float tensor: input dimension {w.shape[1]} is not a multiple of {BLOCK}"
    from ..tensors import Int4DQTensor

    eight_bit = not isinstance(c, (Int4Tensor, Int4DQTensor))  # int8, float8, MX: the 8-bit block
    if eight_bit:
        out = Int8Tensor.from_float(w, BLOCK, scale_dtype=torch.float16, name=name)
        return out.replace(dtype=c.dtype), "re-quantized to Q8_0 (int8, groups of 32, fp16 scales)"
    out = Int4Tensor.from_float(w.to(torch.float16), BLOCK, symmetric=True, name=name)
    return out.replace(dtype=c.dtype), "re-quantized to Q4_0 (symmetric int4, groups of 32, fp16 scales)"


# ---------------------------------------------------------------------- GGUF -> hf_aoq
def _pick_dtype(preferred: torch.dtype, *fields: torch.Tensor) -> torch.dtype:
    """The first of (preferred, float16, float32) that holds every value of `fields` exactly."""
    for dtype in (preferred, torch.float16, torch.float32):
        if all(bool(torch.isfinite(f.to(dtype)).all()) and torch.equal(f.to(dtype).float(), f) for f in fields):
            return dtype
    return torch.float32


def import_tensor(name: str, ggml_type: int, raw: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype,
                  where: str):
    """(hf_aoq tensor or plain tensor, exact) for one GGUF tensor. `dtype` is the model's dtype
    (and the scales' where they fit it); `exact` says whether hf_aoq's dequantization equals
    GGUF's decoding bit for bit (always, except Q4_K blocks whose zero does not fit float32)."""
    if ggml_type in _TORCH_OF:
        t = raw.contiguous().view(_TORCH_OF[ggml_type]).reshape(shape).clone()
        return t, True
    if len(shape) != 2:
        raise FormatError(f"{where}: tensor {name!r}: {type_name(ggml_type)} of shape {shape}; hf_aoq's quantized "
                          f"types are 2-D")
    n, k = shape
    _, _, size = GGML_TYPES[ggml_type]
    b = _blocks(raw, size)
    if ggml_type in (Q4_0, Q4_1):
        d = _half_of(b[..., 0:2])
        qdata = pack_int4(_codes_of(b[..., 2:18] if ggml_type == Q4_0 else b[..., 4:20]))
        if ggml_type == Q4_0:
            sd = _pick_dtype(dtype, d)
            t = Int4Tensor(qdata, d.to(sd), (1, BLOCK), (n, k), dtype)
        else:
            zero = _half_of(b[..., 2:4]) + 8 * d
            sd = _pick_dtype(dtype, d, zero)
            t = Int4Tensor(qdata, d.to(sd), (1, BLOCK), (n, k), dtype, zero=zero.to(sd))
    elif ggml_type == Q8_0:
        codes = b[..., 2:34].contiguous().view(torch.int8).reshape(n, k)
        t = Int8Tensor(codes.contiguous(), _half_of(b[..., 0:2]), (1, BLOCK), (n, k), dtype)
    elif ggml_type == Q4_K:
        scale, minimum, q = _q4_k_parts(b)
        zero = 8 * scale - minimum
        t = Int4Tensor(pack_int4(q.reshape(n, k)), scale, (1, BLOCK), (n, k), dtype, zero=zero)
    elif ggml_type == Q6_K:
        scale, q = _q6_k_parts(b)
        sign = torch.where(scale < 0, -1, 1).to(torch.int8)  # hf_aoq's int8 scales are not negative
        codes = (q * sign.unsqueeze(-1)).reshape(n, k)
        t = Int8Tensor(codes.contiguous(), scale.abs(), (1, 16), (n, k), dtype)
    else:
        raise FormatError(f"{where}: tensor {name!r}: {type_name(ggml_type)} has no hf_aoq type")
    try:
        type(t).check_fields(t.fields())
    except AOQError as e:
        raise FormatError(f"{where}: tensor {name!r}: {e}") from None
    exact = torch.equal(t.dequantize(torch.float32), decode(ggml_type, raw, (n, k)))
    return t, exact
