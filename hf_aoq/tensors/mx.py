"""MXTensor: OCP Microscaling (MX v1.0) weights: blocks of 32 elements along K that share one
power-of-two (e8m0) scale; elements e4m3 or e5m2 (MXFP8) or e2m1 (MXFP4). Weight-only, or with
activations quantized at run time in the same 32-element blocks.

Canonical layout (what is saved), weight [..., K] (2-D [N, K] or 3-D experts [E, N, K]),
B = ceil(K / 32) blocks per row (the last may be partial, see below):
    qdata       float8_e4m3fn / float8_e5m2 [..., K]   (MXFP8), or
                uint8 [..., K/2]                      (MXFP4: two e2m1 codes per byte, the even
                                                       element in the low nibble; the bytes are
                                                       torch.float4_e2m1fn_x2's)
    scale       uint8 [..., B]    e8m0 codes (the bytes of torch.float8_e8m0fnu): 2^(code - 127),
                                  255 = NaN
    elem_dtype  float8_e4m3fn, float8_e5m2 or float4_e2m1fn_x2: the element format
    act_dtype   None (weight-only), or the element format activations are quantized to
    w[..., k] = element(qdata[..., k]) * 2^(scale[..., k // 32] - 127), in float32

Encoding a block V (the spec's rule, docs/format.md "MXTensor"): shared exponent
e = floor(log2(max |V|)) - emax_elem (8 for e4m3, 15 for e5m2, 2 for e2m1), clamped to
[-127, 127] (and -127 for an all-zero block); each element is V / 2^e rounded to the nearest
element value, ties to even, saturating at the format's largest normal (448, 57344, 6), keeping
V's sign (zero included). A block holding inf or NaN (only activations can: weights are refused)
gets scale code 255 and zero elements, so it decodes to NaN.
K need not be a multiple of 32: the last block then covers the remaining K % 32 elements (its
scale is chosen from those alone), as Int4Tensor's last group does; MXFP4 needs K even.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.errors import AOQError
from ..core.primitives import by_row_chunks, check_finite, check_float8_codes_finite, pack_int4, unpack_int4
from ..core.registry import register_tensor_type
from .common import BlockGridTensor, check_built, check_weight

BLOCK_SIZE = 32  # OCP MX v1.0 defines k = 32 for every concrete format
FP4 = torch.float4_e2m1fn_x2
ELEM_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, FP4)
EMAX = {torch.float8_e4m3fn: 8, torch.float8_e5m2: 15, FP4: 2}  # exponent of the largest normal
MAX_NORMAL = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, FP4: 6.0}
E8M0_NAN = 255
E8M0_BIAS = 127
# The 16 e2m1 values by code (bit 3 is the sign), and the midpoints between neighbouring
# magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6 (a tie goes to the even code).
# (Python lists, made into tensors where used: a module-level tensor would be a constant that
# torch.compile refuses to trace through.)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


ELEM_NAMES = tuple(_name(d) for d in ELEM_DTYPES)


# ---------------------------------------------------------------------- e8m0 and e2m1
def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """float32 2^(code - 127) for uint8 e8m0 codes; 255 is NaN. Built from the bits, so exact
    (code 0 is the float32 subnormal 2^-127)."""
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, torch.full_like(c, 0x00400000), c << 23)
    return torch.where(c == E8M0_NAN, torch.full_like(bits, 0x7FC00000), bits).view(torch.float32)


def _pow2(n: torch.Tensor) -> torch.Tensor:
    """float32 2^n for int32 n in [-126, 127], from the bits."""
    return ((n + 127) << 23).view(torch.float32)


def encode_e2m1(q: torch.Tensor) -> torch.Tensor:
    """uint8 e2m1 codes (0..15) of float32 `q`: nearest value, ties to even, saturating at 6."""
    a = q.abs().clamp(max=MAX_NORMAL[FP4])
    mids = torch.tensor(_E2M1_MIDPOINTS, dtype=torch.float32, device=q.device)
    lower = torch.bucketize(a, mids, right=False)  # a tie takes the smaller magnitude...
    upper = torch.bucketize(a, mids, right=True)  # ...or the larger one
    index = torch.where(lower % 2 == 0, lower, upper)  # equal unless a tie: the even code wins
    return (index | (torch.signbit(q).to(index.dtype) << 3)).to(torch.uint8)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """float32 values of uint8 e2m1 codes (0..15)."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)[codes.long()]


# ---------------------------------------------------------------------- blocks
def _blocks(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., B, 32]: x along its last dim, a partial last block padded with zeros
    (which change neither the block's max nor any element)."""
    k = x.shape[-1]
    pad = -k % BLOCK_SIZE
    xf = x.float()
    if pad:
        xf = F.pad(xf, (0, pad))
    return xf.reshape(*x.shape[:-1], (k + pad) // BLOCK_SIZE, BLOCK_SIZE)


def mx_quantize(x: torch.Tensor, elem_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(qdata, scale) of `x` [..., K] in MX blocks of 32 along the last dim (module docstring)."""
    k = x.shape[-1]
    xb = _blocks(x)
    amax = xb.abs().amax(-1)  # NaN propagates
    finite = torch.isfinite(amax)
    _, e = torch.frexp(amax)  # amax = m * 2^e, m in [0.5, 1): floor(log2(amax)) = e - 1
    shared = (e.to(torch.int32) - 1 - EMAX[elem_dtype]).clamp(-E8M0_BIAS, E8M0_BIAS)
    shared = torch.where(amax == 0, torch.full_like(shared, -E8M0_BIAS), shared)
    shared = torch.where(finite, shared, torch.zeros_like(shared))
    scale = torch.where(finite, shared + E8M0_BIAS, torch.full_like(shared, E8M0_NAN)).to(torch.uint8)
    # V / 2^e as V * 2^-e: exact, -e is in [-125, 127] for any float32 V.
    q = xb * _pow2(-shared)[..., None]
    q = torch.where(finite[..., None], q, torch.zeros_like(q)).reshape(*x.shape[:-1], -1)[..., :k]
    if elem_dtype == FP4:
        return pack_int4(encode_e2m1(q)), scale
    m = MAX_NORMAL[elem_dtype]
    return q.clamp(-m, m).to(elem_dtype), scale


def mx_dequantize(
    qdata: torch.Tensor, scale: torch.Tensor, elem_dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:
    """The values of MX (qdata, scale), computed in float32 and returned as `out_dtype`."""
    values = decode_e2m1(unpack_int4(qdata)) if elem_dtype == FP4 else qdata.to(torch.float32)
    k = values.shape[-1]
    # Each element times its block's scale, gathered per element. (Under torch.compile, torch
    # 2.13's Inductor read a partial last block wrongly, uninitialized values, both when the
    # blocks were padded and sliced and when the scales were repeated and sliced.)
    per_block = e8m0_to_float(scale)
    blocks = -(-k // BLOCK_SIZE)
    if per_block.shape[-1] not in (1, blocks):  # one scale (broadcast) or one per block
        raise AOQError(f"MX scale: {blocks} blocks along K = {k} expected, got shape {tuple(scale.shape)}")
    if per_block.shape[-1] != 1:
        per_block = per_block[..., torch.arange(k, device=scale.device) // BLOCK_SIZE]
    return (values * per_block).to(out_dtype).contiguous()


# ---------------------------------------------------------------------- the tensor type
def _check_elem(value, what: str, allowed: tuple, where: str) -> None:
    if value not in allowed:
        names = [None if d is None else _name(d) for d in allowed]
        raise AOQError(f"{where}: {what} must be one of {names}, got {value!r}")


def _check_mx_weight(weight, name: str) -> None:
    check_weight(weight, name, ndims=(2, 3), shapes="a 2-D [N, K] or 3-D [E, N, K]")


@register_tensor_type
class MXTensor(BlockGridTensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("elem_dtype", "block_size", "shape", "dtype")
    optional_tensor_attribute_names = ("act_dtype",)
    schema_version = 1

    @property
    def codes_per_byte(self) -> int:
        return 2 if self.elem_dtype == FP4 else 1

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        elem_dtype: torch.dtype = torch.float8_e4m3fn,
        act_dtype: torch.dtype | None = None,
        block_size: int = BLOCK_SIZE,
        *,
        name: str = "weight",
    ):
        """Quantize a float [N, K] or [E, N, K] weight to MX blocks of 32 along K."""
        _check_mx_weight(weight, name)
        if block_size != BLOCK_SIZE or type(block_size) is not int:
            raise AOQError(f"{name}: MX block_size must be {BLOCK_SIZE} (OCP MX v1.0), got {block_size!r}")
        _check_elem(elem_dtype, "elem_dtype", ELEM_DTYPES, name)
        _check_elem(act_dtype, "act_dtype", (None,) + ELEM_DTYPES, name)
        k = weight.shape[-1]
        if k % 2 and FP4 in (elem_dtype, act_dtype):
            raise AOQError(f"{name}: MXFP4 (e2m1, two per byte) needs an even input dimension, got shape "
                           f"{tuple(weight.shape)}")
        check_finite(weight, name)
        rows = weight.reshape(-1, k)
        qdata, scale = by_row_chunks(rows, lambda w: mx_quantize(w, elem_dtype))
        lead = tuple(weight.shape[:-1])
        out = cls(
            qdata.reshape(*lead, qdata.shape[-1]), scale.reshape(*lead, scale.shape[-1]), elem_dtype,
            (1,) * (weight.ndim - 1) + (BLOCK_SIZE,), weight.shape, weight.dtype, act_dtype=act_dtype,
        )
        return check_built(out, weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        shape, block, dtype = tuple(fields["shape"]), fields["block_size"], fields["dtype"]
        if len(shape) not in (2, 3) or 0 in shape:
            raise AOQError(f"attribute 'shape': MXTensor is a non-empty [N, K] or [E, N, K] weight, got {shape}")
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise AOQError(f"attribute 'dtype': {dtype} is not a float dtype of 16 bits or more")
        elem, act = fields["elem_dtype"], fields.get("act_dtype")
        if elem not in ELEM_DTYPES:
            raise AOQError(f"attribute 'elem_dtype': {elem!r}, expected one of {list(ELEM_NAMES)}")
        if act is not None and act not in ELEM_DTYPES:
            raise AOQError(f"attribute 'act_dtype': {act!r}, expected None or one of {list(ELEM_NAMES)}")
        want_block = (1,) * (len(shape) - 1) + (BLOCK_SIZE,)
        if block != want_block:
            raise AOQError(f"attribute 'block_size': {block!r}, expected {want_block} for shape {shape}")
        k = shape[-1]
        per = 2 if elem == FP4 else 1
        if k % 2 and FP4 in (elem, act):
            raise AOQError(f"attribute 'shape': MXFP4 needs an even last dimension, got {shape}")
        expected = {
            "qdata": (shape[:-1] + (k // per,), torch.uint8 if elem == FP4 else elem),
            "scale": (shape[:-1] + (-(-k // BLOCK_SIZE),), torch.uint8),
        }
        for field, (want_shape, want_dtype) in expected.items():
            t = fields[field]
            if t.dtype != want_dtype or tuple(t.shape) != want_shape:
                raise AOQError(
                    f"field {field!r}: {t.dtype} {tuple(t.shape)}, expected {want_dtype} {want_shape} for shape "
                    f"{shape} and elem_dtype {_name(elem)}"
                )
        # No MX encoder writes inf or NaN element codes for a weight (a NaN block is scale code 255).
        check_float8_codes_finite(fields["qdata"], codes="element codes",
                                  why=f"MX weights are finite, a NaN block is scale code {E8M0_NAN} (docs/format.md)")


    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return mx_dequantize(self.qdata, self.scale, self.elem_dtype, dtype or self.dtype)

    def simulate_input_quantization(self, x: torch.Tensor) -> torch.Tensor:
        """The activation as the kernels see it: quantized in MX blocks of 32 along K (as
        `act_dtype`) and decoded, in x's dtype; x itself for a weight-only tensor."""
        if self.act_dtype is None:
            return x
        qdata, scale = mx_quantize(x, self.act_dtype)
        return mx_dequantize(qdata, scale, self.act_dtype, x.dtype)
