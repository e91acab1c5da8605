"""IntxDQTensor: 2- or 3-bit codes in small groups whose scale and centre are Int4DQ's 4-bit indices.

Int4DQTensor's double-quantized group parameters (a 4-bit scale index and a 4-bit centre index per
group into a per-row grid, docs/format.md) with `bits`-bit codes: bits + 8/g + 32/K bits per
weight, so groups of 32 cost 3.25 + 32/K bits at 3 bits, where IntxTensor's asymmetric int3 with
bf16 parameters costs 4.0 at groups of 32 and 3.5 at 64. Small groups follow weights that come
from a grid of 32 (SmolLM2's Q4_1) far better than large ones; this is the sub-4-bit format for
mixed precision (docs/sensitivity.md has the measurements). Weight-only; on CPU its forward runs
IntxTensor's C++ kernels, whose bit streams these codes are (kernels/cpu_intx.py); elsewhere, and
for 3-D experts, the reference kernel (dequantize, then the float matmul).

Canonical layout (what is saved; 3-D fused experts [E, N, K] put E in front of every field,
tparams included: [E, 2]), weight [N, K], b = `bits`, L = 2^b - 1, groups of g along K (the last
may be partial), G = ceil(K / g):
    qdata    uint8 [N, ceil(K * b / 8)]   codes q in [0, L], IntxTensor's little-endian bit stream
    gparams  uint8 [N, G]     per group: low nibble a (scale index), high nibble b (centre index)
    rparams  uint8 [N, 4]     per row: kd_lo, kd_hi, kc_lo, kc_hi, Int4DQ's 8-bit log codes
    tparams  float32 [2]      per tensor: T_d, T_c

The CPU packing ("cpu_intxdq", kernels/cpu_intx.py) keeps these fields and appends to tparams the
decoded per-row table the C++ kernels read (float32 [2 + 4N]: T_d, T_c, then dlo, dstep, clo, cstep
per row), so that no call decodes it, eager or compiled; `to_canonical()` undoes it.

Decoding, in float32, exactly as Int4DQTensor's but for the codes' centre:
    (dlo, dstep, clo, cstep) per row as Int4DQTensor decodes them (steps (hi - lo) / 15)
    per group:  d = dlo + a * dstep;  c = clo + b * cstep
    per weight: w = (q - L / 2) * d + c, then cast to the weight's dtype
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError
from ..core.primitives import by_row_chunks, check_finite
from ..core.registry import register_tensor_type
from ..kernels.search import group_codes
from .common import BlockGridTensor, DevicePacked, check_built, check_layout, check_weight
from .experts import dequantize_experts, quantize_experts
from .int4dq import (GROUP_SIZES, _group_minmax, _padded_groups, _quantize_rows, check_grid_fields, group_grid,
                     select_grid_rows, slice_grid_fields, tensor_params)
from .intx import pack_intx, packed_width, unpack_intx

BITS = (2, 3)
# Each group's range is shrunk about its centre by the one of these factors that rounds it with
# the least squared error: with 4 or 8 codes clipping the ends pays (on a Gaussian 64 x 512
# weight the relative error went 0.172 -> 0.122 at 2 bits, 0.0309 -> 0.0298 at 3).
CLIP_RATIOS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)


def levels(bits: int) -> int:
    """The largest code of `bits`-bit codes."""
    return (1 << bits) - 1


def group_ranges(w: torch.Tensor, g: int, top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's scale and centre before the grids, float32 [N, G]: the min/max ones
    (Int4DQ's), the scale then shrunk by the CLIP_RATIOS factor of least squared error on codes
    in [0, top]."""
    d0, c0 = _group_minmax(w, g, top)
    x, mask = _padded_groups(w, g)
    c = c0[..., None]
    best_d, best_err = d0, None
    for ratio in CLIP_RATIOS:
        d = d0 * ratio
        q = group_codes(x, d[..., None], c, top)
        err = ((q - top / 2) * d[..., None] + c - x).square_()
        if mask is not None:
            err = err * mask
        err = err.sum(-1)
        if best_err is None:
            best_err = err
        else:
            better = err < best_err
            best_d, best_err = torch.where(better, d, best_d), torch.where(better, err, best_err)
    return best_d, c0


@register_tensor_type
class IntxDQTensor(DevicePacked, BlockGridTensor):
    tensor_data_names = ("qdata", "gparams", "rparams", "tparams")
    tensor_attribute_names = ("bits", "block_size", "shape", "dtype")
    # Never saved (checkpoints hold the canonical layout): no file changes.
    optional_tensor_attribute_names = ("packing",)
    schema_version = 1

    @classmethod
    def from_float(cls, weight: torch.Tensor, bits: int = 3, group_size: int = 32, *, name: str = "weight"):
        """Quantize a float [N, K] weight as Int4DQTensor.from_float does (each group's range,
        the rows' grids of scales and centres, then each group's best indices among the nearest
        ones and their neighbours), with codes of `bits` bits; a group's range is its min/max
        shrunk by the best of CLIP_RATIOS (group_ranges). A 3-D [E, N, K] weight
        (fused experts) is quantized expert by expert."""
        if getattr(weight, "ndim", 0) == 3:
            return quantize_experts(cls.from_float, weight, name, bits=bits, group_size=group_size)
        check_weight(weight, name)
        check_finite(weight, name)
        if bits not in BITS:
            raise AOQError(f"{name}: IntxDQTensor bits must be one of {BITS}, got {bits!r}")
        if group_size not in GROUP_SIZES:
            raise AOQError(f"{name}: IntxDQTensor group_size must be one of {GROUP_SIZES}, got {group_size!r}")
        top = levels(bits)
        d0, c0 = by_row_chunks(weight, lambda w: group_ranges(w, group_size, top))
        tparams = tensor_params(d0, c0)
        codes, gparams, rparams = by_row_chunks(
            weight, lambda w, d, c: _quantize_rows(w, group_size, tparams, d, c, top), d0, c0
        )
        out = cls(pack_intx(codes, bits), gparams, rparams, tparams, bits, (1, group_size), weight.shape, weight.dtype)
        return check_built(out, weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        bits = fields["bits"]
        if type(bits) is not int or bits not in BITS:
            raise AOQError(f"attribute 'bits': {bits!r}, expected one of {BITS}")
        check_layout(fields, "IntxDQTensor", f"(1, g) with g in {GROUP_SIZES}",
                     lambda block, _: block[0] == 1 and block[1] in GROUP_SIZES)
        shape = tuple(fields["shape"])
        if not fields["dtype"].is_floating_point or fields["dtype"].itemsize < 2:
            raise AOQError(f"attribute 'dtype': {fields['dtype']} is not a float dtype of 16 bits or more")
        check_grid_fields(fields, packed_width(shape[-1], bits))

    @property
    def group_size(self) -> int:
        return self.block_size[-1]

    def codes(self) -> torch.Tensor:
        """The uint8 codes in [0, 2^bits - 1], shape [N, K]."""
        return unpack_intx(self.qdata, self.bits, self.shape[-1])

    def group_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale d and centre c, float32 [N, G]."""
        return group_grid(self)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if len(self.shape) == 3:
            return dequantize_experts(self, dtype)
        n, k = self.shape
        g = self.group_size
        d, c = self.group_grid()
        q = self.codes().float()
        groups = d.shape[1]
        pad = groups * g - k
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
        w = (q.reshape(n, groups, g) - levels(self.bits) / 2) * d[..., None] + c[..., None]
        return w.reshape(n, groups * g)[:, :k].to(dtype or self.dtype).contiguous()

    # Rows carry their own row parameters; a slice along K must start on a group and end on one
    # or at K (the codes are unpacked, cut and packed again: a group need not start on a byte).
    def select_rows(self, rows: torch.Tensor) -> "IntxDQTensor":
        return select_grid_rows(self.to_canonical(), rows)

    def slice_fields(self, dim: int, start: int, end: int) -> "IntxDQTensor":
        """[start:end] of `dim`: of the experts (each with its own T_d and T_c), of the rows
        (each with its row parameters) or of K (on group boundaries)."""
        def columns(c, start, end):
            return {"qdata": pack_intx(unpack_intx(c.qdata, c.bits, c.shape[-1])[..., start:end], c.bits)}

        return slice_grid_fields(self.to_canonical(), dim, start, end, columns)


def from_codes(codes: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor, tparams: torch.Tensor, bits: int,
               group_size: int, weight: torch.Tensor, name: str = "weight") -> IntxDQTensor:
    """The IntxDQTensor of codes chosen elsewhere (GPTQ) on grids chosen as from_float does."""
    out = IntxDQTensor(pack_intx(codes, bits), gparams, rparams, tparams, bits, (1, group_size),
                       tuple(weight.shape), weight.dtype)
    return check_built(out, weight, name)

