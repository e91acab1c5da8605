"""Float8SemiSparseTensor: 2:4 semi-structured sparse float8 weights (two of every four
consecutive elements along K kept, as e4m3 values with a per-row scale, and their positions in
2-bit fields), with activations quantized to float8 per token at run time.

Its own type, not a packing of Float8Tensor: a packing is a device layout that `to_canonical`
undoes into the saved layout, and the point of this format is that the saved layout itself is the
compressed one (half the values, plus 4 bits of positions per group of 4). Its fields differ
from Float8Tensor's (qdata holds K/2 values per row, `positions` is new), so no Float8Tensor
kernel could read it; sharing the class would make every Float8Tensor row of the kernel table
one that must refuse it.

Canonical layout (what is saved), weight [..., N, K] (2-D [N, K] or 3-D experts [E, N, K]),
K a multiple of 4, G = K / 4 groups per row:
    qdata      float8_e4m3fn [..., N, K/2]  the two kept values of each group, group by group,
                                            the one at the lower position first
    positions  uint8 [..., N, ceil(K/8)]    the kept positions (0..3 within the group), 2 bits
                                            each, in the order of qdata: value j's position is
                                            bits 2(j % 4) .. 2(j % 4) + 1 of byte j // 4 (so a
                                            group is one nibble, the lower position in its low two
                                            bits; the even group in the low nibble). Each group's
                                            two positions are increasing (i0 < i1); when G is odd
                                            the last byte's high nibble is zero.
    scale      float32 [..., N, 1]           w = value * scale, the row's abs-max / 448
    act_quant  None (weight-only) or "per_row" (activations quantized per token at run time to
               `act_dtype`, e4m3 by default, as Float8Tensor's dynamic path does)
    w[..., n, 4g + positions(2g)] = qdata[..., n, 2g] * scale[..., n], likewise 2g + 1; the other
    two elements of group g are zero.

Pruning (from_float): in each group the two elements of largest magnitude are kept; of equal
magnitudes the lower position wins (so the rule is a total order and the result deterministic).
The row's largest element is always kept, so the scale is Float8Tensor's per-row scale and the
kept values are exactly Float8Tensor's codes of the pruned weight. A kept value may still be zero
(a group with three zeros, or a value below e4m3's smallest subnormal): at most two non-zeros per
group, never more. K % 4 != 0 is refused: a padded last group would hold positions of columns that
do not exist, and no real model's linear has such an input size.
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError
from ..core.primitives import FLOAT8_DTYPES, by_row_chunks, check_float8_codes_finite, choose_scale_float8, quantize_float8
from ..core.registry import register_tensor_type
from .common import BlockGridTensor, check_built, check_weight
from .experts import quantize_experts
from .float8 import quantize_input_float8
from .sharding import CUT_RULES

GROUP = 4  # elements per group along K
KEPT = 2  # kept per group
WEIGHT_DTYPE = torch.float8_e4m3fn  # the only value format (torchao's semi-sparse float8 is e4m3 too)
ACT_QUANTS = (None, "per_row")


# ---------------------------------------------------------------------- pruning and packing
def prune_2_4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept values in w's dtype [..., K/2], their positions 0..3 as uint8 [..., K/2]) of `w`
    [..., K] (K % 4 == 0): per group of 4 along the last dim, the two of largest magnitude, ties
    to the lower position, in increasing position order."""
    g = w.reshape(*w.shape[:-1], -1, GROUP)
    a = g.abs()
    j = torch.arange(GROUP, device=w.device)
    # rank[i] = how many elements of the group come before element i in (magnitude desc, position asc).
    ahead = (a[..., None, :] > a[..., :, None]) | ((a[..., None, :] == a[..., :, None]) & (j[None, :] < j[:, None]))
    keep = ahead.sum(-1) < KEPT
    # The kept positions in increasing order: a stable sort puts the kept (key 0) first, in order.
    pos = torch.sort((~keep).to(torch.int8), dim=-1, stable=True).indices[..., :KEPT]
    values = torch.gather(g, -1, pos)
    return values.reshape(*w.shape[:-1], -1), pos.to(torch.uint8).reshape(*w.shape[:-1], -1)


def pack_positions(pos: torch.Tensor) -> torch.Tensor:
    """uint8 [..., ceil(K/8)] from positions uint8 [..., K/2] (values 0..3): four 2-bit fields
    per byte, value 4b + t in bits 2t, 2t + 1 of byte b; zero fields pad the last byte."""
    pad = -pos.shape[-1] % 4
    p = torch.nn.functional.pad(pos, (0, pad)) if pad else pos
    p = p.reshape(*p.shape[:-1], -1, 4).to(torch.uint8)
    return p[..., 0] | (p[..., 1] << 2) | (p[..., 2] << 4) | (p[..., 3] << 6)


def unpack_positions(packed: torch.Tensor, values: int) -> torch.Tensor:
    """Inverse of `pack_positions`: int64 [..., values] positions 0..3."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.int32, device=packed.device)
    fields = (packed.to(torch.int32)[..., None] >> shifts) & 3
    return fields.reshape(*packed.shape[:-1], -1)[..., :values].to(torch.int64)


def sparse_columns(packed: torch.Tensor, values: int) -> torch.Tensor:
    """The column (0..K-1) of each kept value: 4 * group + position, int64 [..., values]."""
    group = torch.arange(values, device=packed.device) // KEPT
    return unpack_positions(packed, values) + GROUP * group


def scatter_dense(values: torch.Tensor, packed: torch.Tensor, k: int) -> torch.Tensor:
    """The dense [..., k] tensor holding `values` [..., k/2] at their columns, zero elsewhere."""
    dense = values.new_zeros(*values.shape[:-1], k)
    return dense.scatter_(-1, sparse_columns(packed, values.shape[-1]), values)


def check_positions(packed: torch.Tensor, k: int, where: str = "field 'positions'") -> None:
    """Refuse position bytes that no 2:4 encoder writes: a group whose two positions are not
    increasing (i0 < i1), or a non-zero pad nibble (an odd number of groups)."""
    if packed.device.type == "meta" or packed.numel() == 0:
        return
    groups = k // GROUP
    rows = packed.reshape(-1, packed.shape[-1]).to(torch.int32)
    nibbles = torch.stack([rows & 15, rows >> 4], dim=-1).reshape(rows.shape[0], -1)
    real, pad = nibbles[:, :groups], nibbles[:, groups:]
    bad = (real & 3) >= (real >> 2)
    if bool(bad.any()):
        r, g = (int(v) for v in bad.nonzero()[0])
        nib = int(real[r, g])
        raise AOQError(f"{where}: row {r}, group {g} (columns {4 * g}..{4 * g + 3}) keeps positions "
                       f"({nib & 3}, {nib >> 2}); each group's two kept positions must be increasing, "
                       f"0 <= i0 < i1 <= 3 (docs/format.md, Float8SemiSparseTensor)")
    if pad.numel() and bool((pad != 0).any()):
        r = int((pad != 0).any(-1).nonzero()[0])
        raise AOQError(f"{where}: row {r}: the last byte's high nibble pads {groups} groups (an odd number) and "
                       f"must be zero, got {int(pad[r, 0])}")


# ---------------------------------------------------------------------- the tensor type
def _check_sparse_weight(weight, name: str) -> None:
    check_weight(weight, name, shapes="a 2-D [N, K] (or 3-D experts [E, N, K], through their own path)")
    if weight.shape[-1] % GROUP:
        raise AOQError(f"{name}: 2:4 sparsity needs an input dimension that is a multiple of 4, got shape "
                       f"{tuple(weight.shape)}; leave this layer unquantized or use another scheme")


@register_tensor_type
class Float8SemiSparseTensor(BlockGridTensor):
    tensor_data_names = ("qdata", "positions", "scale")
    tensor_attribute_names = ("block_size", "shape", "dtype")
    optional_tensor_attribute_names = ("act_quant", "act_dtype")
    schema_version = 1

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        act_quant: str | None = "per_row",
        act_dtype: torch.dtype | None = None,
        weight_dtype: torch.dtype = WEIGHT_DTYPE,
        *,
        name: str = "weight",
    ):
        """Prune a float [N, K] (or [E, N, K]) weight 2:4 along K and quantize the kept values to
        e4m3 with a per-row scale; activations quantized per token (`act_quant` "per_row", to
        `act_dtype`, e4m3 by default) or not at all (None)."""
        if getattr(weight, "ndim", 0) == 3:
            return quantize_experts(cls.from_float, weight, name, act_quant=act_quant, act_dtype=act_dtype,
                                    weight_dtype=weight_dtype)
        _check_sparse_weight(weight, name)
        if weight_dtype != WEIGHT_DTYPE:
            raise AOQError(f"{name}: Float8SemiSparseTensor stores float8_e4m3fn values only, got {weight_dtype}")
        if act_quant not in ACT_QUANTS:
            raise AOQError(f"{name}: Float8SemiSparseTensor act_quant must be one of {ACT_QUANTS}, got {act_quant!r}")
        if act_dtype is not None and (act_quant is None or act_dtype not in FLOAT8_DTYPES):
            raise AOQError(f"{name}: act_dtype {act_dtype} needs act_quant 'per_row' and one of {FLOAT8_DTYPES}")
        k = weight.shape[1]

        def rows(w):
            values, pos = prune_2_4(w)
            # The row's largest element is always kept: this is the abs-max of the kept values.
            scale = choose_scale_float8(w, (1, k), WEIGHT_DTYPE, name=name)
            return quantize_float8(values, (1, k // 2), scale, WEIGHT_DTYPE), pack_positions(pos), scale

        qdata, positions, scale = by_row_chunks(weight, rows)
        out = cls(qdata, positions, scale, (1, k), weight.shape, weight.dtype, act_quant=act_quant,
                  act_dtype=act_dtype)
        return check_built(out, weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        shape, block, dtype = tuple(fields["shape"]), fields["block_size"], fields["dtype"]
        if len(shape) not in (2, 3) or 0 in shape or shape[-1] % GROUP:
            raise AOQError(f"attribute 'shape': Float8SemiSparseTensor is a non-empty [N, K] or [E, N, K] weight "
                           f"with K a multiple of 4, got {shape}")
        if not dtype.is_floating_point or dtype.itemsize < 2:
            raise AOQError(f"attribute 'dtype': {dtype} is not a float dtype of 16 bits or more")
        want_block = (1,) * (len(shape) - 1) + (shape[-1],)
        if block != want_block:
            raise AOQError(f"attribute 'block_size': {block!r}, expected {want_block} (one scale per row) for "
                           f"shape {shape}")
        act, act_dtype = fields.get("act_quant"), fields.get("act_dtype")
        if act not in ACT_QUANTS:
            raise AOQError(f"attribute 'act_quant': {act!r}, expected one of {ACT_QUANTS}")
        if act_dtype is not None and (act is None or act_dtype not in FLOAT8_DTYPES):
            raise AOQError(f"attribute 'act_dtype': {act_dtype}, expected None or (with act_quant 'per_row') one of "
                           f"{FLOAT8_DTYPES}")
        lead, k = shape[:-1], shape[-1]
        expected = {
            "qdata": (lead + (k // 2,), WEIGHT_DTYPE),
            "positions": (lead + (-(-k // 8),), torch.uint8),
            "scale": (lead + (1,), torch.float32),
        }
        for field, (want_shape, want_dtype) in expected.items():
            t = fields[field]
            if t.dtype != want_dtype or tuple(t.shape) != want_shape:
                raise AOQError(f"field {field!r}: {t.dtype} {tuple(t.shape)}, expected {want_dtype} {want_shape} "
                               f"for shape {shape}")
        scale = fields["scale"]
        if scale.device.type != "meta" and not bool(((scale > 0) & torch.isfinite(scale)).all()):
            raise AOQError("field 'scale': every row's scale must be positive and finite")
        check_positions(fields["positions"], k)
        check_float8_codes_finite(fields["qdata"])  # quantize_float8 saturates: never inf or NaN

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        values = self.qdata.to(torch.float32) * self.scale
        return scatter_dense(values, self.positions, self.shape[-1]).to(dtype or self.dtype)

    def quantize_input(self, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Float8 codes and float32 per-token scales, exactly Float8Tensor's "per_row" path."""
        return quantize_input_float8(x2, self.act_quant, self.act_dtype or WEIGHT_DTYPE)

    # Rows carry their own scale; a slice along K must keep whole bytes of positions (8 columns).
    def select_rows(self, rows: torch.Tensor) -> "Float8SemiSparseTensor":
        return self.replace(**{n: t.index_select(0, rows) for n, t in self.tensor_fields().items()},
                            shape=(rows.numel(), *self.shape[1:]))

    def slice_fields(self, dim: int, start: int, end: int) -> "Float8SemiSparseTensor":
        dim = dim % self.ndim
        shape = list(self.shape)
        shape[dim] = end - start
        if dim < self.ndim - 1:
            return self.replace(**{n: t.narrow(dim, start, end - start) for n, t in self.tensor_fields().items()},
                                shape=tuple(shape))
        k = self.shape[-1]
        if start % 8 or (end % 8 and end != k):
            raise AOQError(f"Float8SemiSparseTensor: slice [{start}:{end}] of dim {dim} must align with its bytes "
                           f"of positions (8 columns, 2 groups of 4), or end at {k}")
        block = (*self.block_size[:-1], end - start)
        return self.replace(qdata=self.qdata[..., start // 2:end // 2], positions=self.positions[..., start // 8:-(-end // 8)],
                            shape=tuple(shape), block_size=block)


def _cuts(t: Float8SemiSparseTensor, dim: int):
    if dim < t.ndim - 1:
        return {"qdata": (dim, 1), "positions": (dim, 1), "scale": (dim, 1)}
    return {"qdata": (dim, 2), "positions": (dim, 8), "scale": None}


CUT_RULES[Float8SemiSparseTensor] = _cuts
