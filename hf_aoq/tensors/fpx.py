"""FPxTensor: sub-byte floating-point weights (torchao's FPx, the FP6-LLM formats): 1 sign bit,
`ebits` exponent bits and `mbits` mantissa bits per weight, one scale per output row, the codes
bit-packed per row. Weight-only.

Canonical layout (what is saved), weight [N, K], b = 1 + ebits + mbits:
    qdata   uint8 [N, ceil(K * b / 8)]   per row IntxTensor's little-endian bit stream of b-bit codes
                                         (tensors/intx.py: column k at stream bits [k*b, (k+1)*b))
    scale   [N, 1]                       per row, in the weight's dtype (any 16/32-bit float loads)
    ebits, mbits                         one of FORMATS
    w[n, k] = value(code[n, k]) * scale[n], in float32, then rounded to the tensor's dtype
Fused experts [E, N, K] (tensors/experts.py): each expert quantized as a 2-D weight, every field
with E in front (qdata [E, N, ceil(K * b / 8)], scale [E, N, 1]) and block_size (1, 1, K).

A code is S E..E M..M (sign in bit b-1, the exponent field E above the mantissa field M), bias
2^(ebits-1) - 1, and every code is finite (no inf or NaN encodings, as torchao's):
    E > 0:  (-1)^S * 2^(E - bias) * (1 + M / 2^mbits)
    E = 0:  (-1)^S * 2^(1 - bias) * (M / 2^mbits)        (zero and the subnormals)
so the largest value is MAX = 2^(2^ebits - 1 - bias) * (2 - 2^-mbits) (28 for e3m2, 7.5 e2m3).

Encoding a row w (hf_aoq's quantizer; docs/format.md "FPxTensor"): scale = max(|w|) clamped below
at 1e-12, divided by MAX, in float32 (torchao's choice), rounded to the weight's dtype and raised
to that dtype's smallest positive value if it rounded to zero (float16 only can); each element is
w / scale (float32 division by the stored scale) rounded to the nearest value, ties to the even
code, saturating at +-MAX, keeping w's sign (a negative value that rounds to zero is -0).
Weights holding inf or NaN are refused.
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError
from ..core.primitives import by_row_chunks, check_finite
from ..core.registry import register_tensor_type
from .common import BlockGridTensor, check_built, check_grid_fields, check_layout, check_weight, slice_grid
from .experts import quantize_experts
from .intx import pack_intx, unpack_intx

# (ebits, mbits): the formats torchao's Quant-LLM documentation gives figures for (fp6 e3m2, its
# default, and e2m3; fp5 e2m2 and e3m1, which its kernel also runs; fp4 e3m0 and e2m1), less fp3
# e2m0, whose perplexity there (74625) says it is not a weight format.
FORMATS = ((3, 2), (2, 3), (2, 2), (3, 1), (3, 0), (2, 1))
DEFAULT_FORMAT = (3, 2)
MIN_ROW_AMAX = 1e-12  # torchao's clamp: an all-zero row still gets a positive scale


def check_format(ebits, mbits, where: str) -> None:
    if type(ebits) is not int or type(mbits) is not int or (ebits, mbits) not in FORMATS:
        allowed = ", ".join(f"e{e}m{m}" for e, m in FORMATS)
        raise AOQError(f"{where}: (ebits, mbits) must be one of {FORMATS} ({allowed}), got ({ebits!r}, {mbits!r})")


def format_name(ebits: int, mbits: int) -> str:
    return f"fp{1 + ebits + mbits} e{ebits}m{mbits}"


def magnitudes(ebits: int, mbits: int) -> list[float]:
    """The 2^(ebits+mbits) non-negative values, by magnitude code (increasing: the code order is
    the value order), as Python floats (exact)."""
    bias = (1 << (ebits - 1)) - 1
    out = []
    for code in range(1 << (ebits + mbits)):
        e, m = code >> mbits, code & ((1 << mbits) - 1)
        out.append(2.0 ** (1 - bias) * m / 2 ** mbits if e == 0 else 2.0 ** (e - bias) * (1 + m / 2 ** mbits))
    return out


def max_value(ebits: int, mbits: int) -> float:
    return magnitudes(ebits, mbits)[-1]


def values(ebits: int, mbits: int) -> list[float]:
    """The 2^(1+ebits+mbits) values by code: the magnitudes, then their negatives (the sign bit)."""
    mags = magnitudes(ebits, mbits)
    return mags + [-v for v in mags]


def encode_fpx(q: torch.Tensor, ebits: int, mbits: int) -> torch.Tensor:
    """uint8 codes of finite float32 `q`: the nearest value, ties to the even code, saturating at
    the largest magnitude, with q's sign bit (module docstring)."""
    mags = magnitudes(ebits, mbits)
    # Midpoints of neighbouring magnitudes are exact in float32 (at most mbits + 2 significant bits).
    mids = torch.tensor([(a + b) / 2 for a, b in zip(mags, mags[1:])], dtype=torch.float32, device=q.device)
    a = q.abs()
    lower = torch.bucketize(a, mids, right=False)  # a tie takes the smaller magnitude...
    upper = torch.bucketize(a, mids, right=True)  # ...or the larger one
    index = torch.where(lower % 2 == 0, lower, upper)  # equal unless a tie: the even code wins
    sign = torch.signbit(q).to(index.dtype) << (ebits + mbits)
    return (index | sign).to(torch.uint8)


def decode_fpx(codes: torch.Tensor, ebits: int, mbits: int) -> torch.Tensor:
    """float32 values of uint8 codes (a table lookup)."""
    table = torch.tensor(values(ebits, mbits), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def choose_row_scale(w: torch.Tensor, ebits: int, mbits: int) -> torch.Tensor:
    """The stored scale [N, 1] of rows w [N, K], in w's dtype (module docstring)."""
    amax = w.detach().float().abs().amax(1, keepdim=True).clamp(min=MIN_ROW_AMAX)
    scale = (amax / max_value(ebits, mbits)).to(w.dtype)
    info = torch.finfo(w.dtype)
    return scale.clamp(min=info.tiny * info.eps)  # the smallest positive value (a subnormal)


def fpx_quantize(w: torch.Tensor, ebits: int, mbits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed codes, scale [N, 1]) of finite rows w [N, K]."""
    scale = choose_row_scale(w, ebits, mbits)
    codes = encode_fpx(w.float() / scale.float(), ebits, mbits)
    return pack_intx(codes, 1 + ebits + mbits), scale


def fpx_dequantize(qdata, scale, ebits: int, mbits: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    codes = unpack_intx(qdata, 1 + ebits + mbits, k)
    return (decode_fpx(codes, ebits, mbits) * scale.float()).to(dtype)


@register_tensor_type
class FPxTensor(BlockGridTensor):
    tensor_data_names = ("qdata", "scale")
    tensor_attribute_names = ("ebits", "mbits", "block_size", "shape", "dtype")
    schema_version = 1

    @classmethod
    def from_float(cls, weight: torch.Tensor, ebits: int = 3, mbits: int = 2, *, name: str = "weight"):
        """Quantize a float [N, K] weight to 1 + ebits + mbits bit floats with a scale per row; a
        3-D [E, N, K] weight (fused experts) expert by expert."""
        check_weight(weight, name, ndims=(2, 3), shapes="a 2-D [N, K] or 3-D [E, N, K] (fused experts)")
        check_format(ebits, mbits, f"{name}: FPxTensor")
        if weight.ndim == 3:
            return quantize_experts(cls.from_float, weight, name, ebits=ebits, mbits=mbits)
        check_finite(weight, name)
        qdata, scale = by_row_chunks(weight, lambda w: fpx_quantize(w, ebits, mbits))
        out = cls(qdata, scale, ebits, mbits, (1, weight.shape[1]), weight.shape, weight.dtype)
        return check_built(out, weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        ebits, mbits = fields.get("ebits"), fields.get("mbits")
        check_format(ebits, mbits, "attributes 'ebits', 'mbits'")
        shape = tuple(fields["shape"])
        check_layout(fields, cls.__name__, "(1, K): one scale per row", lambda b, s: tuple(b) == (1, s[1]))
        check_grid_fields(fields, (torch.uint8,), qdata_last_dim=-(-shape[-1] * (1 + ebits + mbits) // 8))

    @property
    def bits(self) -> int:
        return 1 + self.ebits + self.mbits

    def codes(self) -> torch.Tensor:
        """The uint8 codes, of the tensor's shape ([N, K] or [E, N, K])."""
        return unpack_intx(self.qdata, self.bits, self.shape[-1])

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return fpx_dequantize(self.qdata, self.scale, self.ebits, self.mbits, self.shape[-1], dtype or self.dtype)

    def slice_fields(self, dim: int, start: int, end: int) -> "FPxTensor":
        last = self.ndim - 1
        if dim % self.ndim != last:  # rows, or the experts of a 3-D tensor
            return slice_grid(self, dim % self.ndim, start, end)
        # Along K a slice need not start on a byte: cut the codes, then pack them again.
        cut = slice_grid(self.replace(qdata=self.codes()), last, start, end)
        return cut.replace(qdata=pack_intx(cut.qdata, self.bits))
