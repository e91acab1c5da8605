"""Int4DQTensor: 4-bit codes in small groups whose scale and centre are 4-bit codes themselves.

Int4Tensor spends 32 bits per group on a bf16 scale and zero, so small groups (which follow the
weights closely) cost a lot: 5 bits per weight at groups of 32. Here each group's scale `d` and
centre `c` are 4-bit indices into a per-row grid, whose ends are 8-bit log codes relative to two
per-tensor floats: 4 + 8/32 + 32/K bits per weight, about the size of Int4Tensor at groups of
128, with the accuracy of groups of 32 (docs/format.md has the measurements).

Canonical layout (what is saved; 3-D fused experts [E, N, K] put E in front of every field,
tparams included: [E, 2]), weight [N, K], K even, groups of g along K (the last may be
partial), G = ceil(K / g):
    qdata    uint8 [N, K/2]   codes q in [0, 15], two per byte, low nibble = even k
    gparams  uint8 [N, G]     per group: low nibble a (scale index), high nibble b (centre index)
    rparams  uint8 [N, 4]     per row: kd_lo, kd_hi, kc_lo, kc_hi, 8-bit log codes
    tparams  float32 [2]      per tensor: T_d, T_c

Decoding, in float32 (every `x * y + z` a multiply, then an add):
    LUT[j] = float32(2 ** (-j / 32)), j = 0..31
    dval(k) = 0 if k == 255 else (T_d * LUT[k % 32]) * 2 ** -(k // 32)
    cval(k) = 0 if k & 127 == 127 else (-1) ** (k >> 7) * ((T_c * LUT[2 * (m % 16)]) * 2 ** -(m // 16)),
              m = k & 127
    dlo, dhi, clo, chi = dval(kd_lo), dval(kd_hi), cval(kc_lo), cval(kc_hi)
    dstep = (dhi - dlo) / 15;  cstep = (chi - clo) / 15
    per group:  d = dlo + a * dstep;  c = clo + b * cstep
    per weight: w = (q - 7.5) * d + c, then cast to the weight's dtype
    input_scale float32 [K], optional: as Int4Tensor's (w / s before the cast; x / s in the forward)

The CPU packing ("cpu_int4dq") holds qdata in hf_aoq's CPU int4 "pairs" layout (as
Int4Tensor's), gparams as one flat run of bytes in chunks of 64 rows, each chunk [G, rows]
(kernels/cpu.py `int4dq_cpu_gparams`), and tparams as float32 [2 + 8N]: T_d, T_c, then the
decoded per-row table the kernels read (`pack_int4dq_for_cpu`); `to_canonical()` undoes it.
"""
from __future__ import annotations

import torch

from ..core.errors import AOQError
from ..core.primitives import by_row_chunks, check_finite, pack_int4, unpack_int4
from ..core.registry import register_tensor_type
from ..kernels.search import int4dq_search
from .common import BlockGridTensor, DevicePacked, check_built, check_input_scale, check_weight, unscale_input_columns
from .experts import dequantize_experts, quantize_experts

GROUP_SIZES = (32, 64)
# float32(2^(-j/32)): the mantissas of the 8-bit log codes. Computed in float64 and rounded once,
# so every implementation of the format (and the C++ kernels) has the same 32 numbers.
LUT = torch.tensor([2.0 ** (-j / 32) for j in range(32)], dtype=torch.float32)
D_ZERO, C_ZERO = 255, 127  # the codes of 0 (C_ZERO: in the low 7 bits, either sign)


@register_tensor_type
class Int4DQTensor(DevicePacked, BlockGridTensor):
    tensor_data_names = ("qdata", "gparams", "rparams", "tparams")
    tensor_attribute_names = ("block_size", "shape", "dtype")
    optional_tensor_data_names = ("input_scale",)
    optional_tensor_attribute_names = ("packing",)
    schema_version = 1
    codes_per_byte = 2

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = 32, *, name: str = "weight"):
        """Quantize a float [N, K] weight. Per group: min/max give the group's scale and centre;
        per row, the range of those is coded in 8 bits at each end; each group then takes the
        4-bit scale and centre indices, among the nearest ones and their neighbours, that
        reconstruct it with the least squared error, and its codes are rounded on that grid.
        A 3-D [E, N, K] weight (fused experts) is quantized expert by expert (T_d, T_c per expert)."""
        if getattr(weight, "ndim", 0) == 3:
            return quantize_experts(cls.from_float, weight, name, group_size=group_size)
        check_weight(weight, name)
        check_finite(weight, name)
        if group_size not in GROUP_SIZES:
            raise AOQError(f"{name}: Int4DQTensor group_size must be one of {GROUP_SIZES}, got {group_size}")
        if weight.shape[1] % 2 or weight.numel() == 0:
            raise AOQError(f"{name}: int4 needs an even, non-empty input dimension, got shape {tuple(weight.shape)}")
        d0, c0 = by_row_chunks(weight, lambda w: _group_minmax(w, group_size))
        tparams = tensor_params(d0, c0)
        # Rows are independent once T_d and T_c are fixed: quantized in chunks of rows.
        codes, gparams, rparams = by_row_chunks(
            weight, lambda w, d, c: _quantize_rows(w, group_size, tparams, d, c), d0, c0
        )
        return check_built(cls(pack_int4(codes), gparams, rparams, tparams, (1, group_size), weight.shape, weight.dtype), weight, name)

    @classmethod
    def check_fields(cls, fields) -> None:
        super().check_fields(fields)
        shape, block = tuple(fields["shape"]), fields["block_size"]
        if len(shape) not in (2, 3) or 0 in shape:
            raise AOQError(f"attribute 'shape': Int4DQTensor is a non-empty 2-D [N, K] weight or 3-D [E, N, K] "
                           f"experts, got {shape}")
        lead, k = shape[:-2], shape[-1]
        if not fields["dtype"].is_floating_point or fields["dtype"].itemsize < 2:
            raise AOQError(f"attribute 'dtype': {fields['dtype']} is not a float dtype of 16 bits or more")
        ones = (1,) * (len(shape) - 1)
        if type(block) is not tuple or block[:-1] != ones or len(block) != len(shape) or block[-1] not in GROUP_SIZES:
            want = "(1, 1, g)" if lead else "(1, g)"
            raise AOQError(f"attribute 'block_size': {block!r}, expected {want} with g in {GROUP_SIZES}")
        if k % 2:
            raise AOQError(f"attribute 'shape': last dimension of {shape} is not even")
        check_grid_fields(fields, k // 2)
        check_input_scale(fields)

    @property
    def group_size(self) -> int:
        return self.block_size[-1]

    def codes(self) -> torch.Tensor:
        """The uint8 codes in [0, 15], shape [N, K]."""
        return unpack_int4(self.to_canonical().qdata)

    def group_grid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each group's scale d and centre c, float32 [N, G]."""
        return group_grid(self.to_canonical())

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        if len(self.shape) == 3:
            return dequantize_experts(self.to_canonical(), dtype)
        n, k = self.shape
        g = self.group_size
        d, c = self.group_grid()
        q = self.codes().float()
        groups = d.shape[1]
        pad = groups * g - k
        if pad:
            q = torch.nn.functional.pad(q, (0, pad))
        w = (q.reshape(n, groups, g) - 7.5) * d[..., None] + c[..., None]
        w = w.reshape(n, groups * g)[:, :k]
        if self.input_scale is not None:
            return unscale_input_columns(w, self.input_scale, dtype or self.dtype)
        return w.to(dtype or self.dtype).contiguous()

    # Slicing and row gathers (F.embedding) work on the canonical fields: rows carry their own
    # row parameters; a slice along K must start on a group and end on one or at K.
    def select_rows(self, rows: torch.Tensor) -> "Int4DQTensor":
        return select_grid_rows(self.to_canonical(), rows)

    def slice_fields(self, dim: int, start: int, end: int) -> "Int4DQTensor":
        """[start:end] of `dim`: of the experts (a 3-D tensor's dim 0, each with its own T_d and
        T_c), of the rows (each with its row parameters) or of K (on group boundaries)."""
        def columns(c, start, end):
            if end % 2:  # two codes a byte
                raise AOQError(f"Int4DQTensor: slice [{start}:{end}] of dim {dim} must align with its groups of "
                               f"{c.group_size}")
            return {"qdata": c.qdata[..., start // 2 : end // 2],
                    "input_scale": None if c.input_scale is None else c.input_scale[start:end]}

        return slice_grid_fields(self.to_canonical(), dim, start, end, columns)


# What the double-quantized types (Int4DQTensor, IntxDQTensor) share, on their canonical fields:
# qdata, gparams and rparams hold a row each, tparams an expert each.
def check_grid_fields(fields, qdata_width: int) -> None:
    """The fields' shapes and dtypes for the `shape` attribute (qdata [..., N, qdata_width] uint8,
    gparams [..., N, G] and rparams [..., N, 4] uint8, tparams [..., 2] float32) and tparams' values
    (finite, positive); AOQError naming the field otherwise."""
    shape = tuple(fields["shape"])
    lead, n, k = shape[:-2], shape[-2], shape[-1]
    expected = {
        "qdata": (lead + (n, qdata_width), torch.uint8),
        "gparams": (lead + (n, -(-k // fields["block_size"][-1])), torch.uint8),
        "rparams": (lead + (n, 4), torch.uint8),
        "tparams": (lead + (2,), torch.float32),
    }
    for field, (want_shape, want_dtype) in expected.items():
        t = fields[field]
        if t.dtype != want_dtype or tuple(t.shape) != want_shape:
            raise AOQError(
                f"field {field!r}: {t.dtype} {tuple(t.shape)}, expected {want_dtype} {want_shape} for shape {shape}"
            )
    tp = fields["tparams"]
    if tp.device.type != "meta" and not bool((torch.isfinite(tp) & (tp > 0)).all()):
        raise AOQError(f"field 'tparams': {tp.tolist()}, expected two finite positive numbers")


def group_grid(c) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's scale d and centre c of a 2-D canonical tensor, float32 [N, G]."""
    dlo, dstep, clo, cstep = decode_row_params(c.rparams, c.tparams).unbind(1)
    a = (c.gparams & 15).float()
    b = (c.gparams >> 4).float()
    return dlo[:, None] + a * dstep[:, None], clo[:, None] + b * cstep[:, None]


def select_grid_rows(c, rows: torch.Tensor):
    """The rows `rows` of a 2-D canonical tensor (F.embedding's gather)."""
    return c.replace(
        qdata=c.qdata.index_select(0, rows),
        gparams=c.gparams.index_select(0, rows),
        rparams=c.rparams.index_select(0, rows),
        shape=(rows.numel(), c.shape[1]),
    )


def slice_grid_fields(c, dim: int, start: int, end: int, columns):
    """[start:end] of `dim` of a canonical tensor: of the experts (their tparams too), of the rows,
    or of K on group boundaries, where `columns(c, start, end)` gives the code fields' cut (and
    may refuse it) and gparams are cut here."""
    ndim = len(c.shape)
    dim %= ndim
    shape = list(c.shape)
    shape[dim] = end - start
    cut = (slice(None),) * dim + (slice(start, end),)
    if dim < ndim - 1:
        fields = {"qdata": c.qdata[cut], "gparams": c.gparams[cut], "rparams": c.rparams[cut]}
        if dim < ndim - 2:  # experts: their per-tensor parameters too
            fields["tparams"] = c.tparams[cut]
        return c.replace(**fields, shape=tuple(shape))
    g, k = c.group_size, c.shape[-1]
    if start % g or (end % g and end != k):
        raise AOQError(f"{type(c).__name__}: slice [{start}:{end}] of dim {dim} must align with its groups of {g}")
    return c.replace(**columns(c, start, end), gparams=c.gparams[..., start // g : -(-end // g)], shape=tuple(shape))


def _dmag(k: torch.Tensor, t_d: torch.Tensor) -> torch.Tensor:
    """T_d * 2^(-k/32) for int64 codes k, as the format computes it."""
    return torch.ldexp(t_d * LUT.to(k.device)[k % 32], -(k // 32).float())


def _cmag(m: torch.Tensor, t_c: torch.Tensor) -> torch.Tensor:
    """T_c * 2^(-m/16) for int64 magnitude codes m, as the format computes it."""
    return torch.ldexp(t_c * LUT.to(m.device)[2 * (m % 16)], -(m // 16).float())


def tensor_params(d0: torch.Tensor, c0: torch.Tensor) -> torch.Tensor:
    """float32 [2]: (T_d, T_c), the largest group scale and centre magnitude (1 where that is
    0: an all-zero weight, for which any T works)."""
    tparams = torch.stack([d0.max(), c0.abs().max()]).to(torch.float32)
    return torch.where(tparams > 0, tparams, torch.ones_like(tparams))


def decode_row_params(rparams: torch.Tensor, tparams: torch.Tensor) -> torch.Tensor:
    """float32 [N, 4]: each row's (dlo, dstep, clo, cstep), as the format defines them."""
    k = rparams.to(torch.int64)
    t_d, t_c = tparams[0], tparams[1]

    def dval(code):
        v = _dmag(code, t_d)
        return torch.where(code == D_ZERO, torch.zeros_like(v), v)

    def cval(code):
        m = code & 127
        v = _cmag(m, t_c)
        v = torch.where(code >> 7 == 1, -v, v)
        return torch.where(m == C_ZERO, torch.zeros_like(v), v)

    dlo, dhi, clo, chi = dval(k[:, 0]), dval(k[:, 1]), cval(k[:, 2]), cval(k[:, 3])
    return torch.stack([dlo, (dhi - dlo) / 15, clo, (chi - clo) / 15], dim=1)


def _padded_groups(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 [N, G, g]; a partial last group is padded by repeating its last column (which
    changes neither its min nor its max), and the mask [G * g] of real columns is returned."""
    n, k = w.shape
    groups = -(-k // g)
    x = w.float()
    if groups * g == k:
        return x.reshape(n, groups, g), None
    x = torch.cat([x, x[:, -1:].expand(n, groups * g - k)], dim=1)
    mask = torch.arange(groups * g, device=w.device) < k
    return x.reshape(n, groups, g), mask.reshape(groups, g)


def _group_minmax(w: torch.Tensor, g: int, levels: int = 15) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's min/max scale (range / levels: 15 for 4-bit codes) and centre
    ((max + min) / 2), float32 [N, G]."""
    x, _ = _padded_groups(w, g)
    lo, hi = x.amin(-1), x.amax(-1)
    return (hi - lo) / levels, (hi + lo) / 2


def _nearest_code(x: torch.Tensor, t: torch.Tensor, steps: int, kmax: int, decode) -> torch.Tensor:
    """The code in [0, kmax] of `decode` (value = t * 2^(-k/steps)) nearest to x > 0: the
    log-domain estimate and its neighbours, judged with the exact decoding."""
    est = torch.round(torch.log2(t.double() / x.double().clamp(min=1e-300)) * steps).clamp(0, kmax).to(torch.int64)
    best, best_err = est, None
    for k in (est - 1, est, est + 1):
        k = k.clamp(0, kmax)
        err = (decode(k) - x).abs()
        if best_err is None:
            best, best_err = k, err
        else:
            better = err < best_err
            best, best_err = torch.where(better, k, best), torch.where(better, err, best_err)
    return best


def _encode_row_params(dlo, dhi, clo, chi, tparams) -> torch.Tensor:
    """uint8 [N, 4] codes nearest to the rows' grid ends (0 for non-positive scales, 0 for a
    zero centre)."""
    t_d, t_c = tparams[0], tparams[1]

    def dmag(k):
        return _dmag(k, t_d)

    def cmag(k):
        return _cmag(k, t_c)

    def dcode(x):
        k = _nearest_code(x, t_d, 32, D_ZERO - 1, dmag)
        # Zero when that is nearer than the smallest code (or x is not positive).
        return torch.where((x <= 0) | (x < dmag(k) - x), torch.full_like(k, D_ZERO), k)

    def ccode(x):
        a = x.abs()
        m = _nearest_code(a, t_c, 16, C_ZERO - 1, cmag)
        m = torch.where((a == 0) | (a < cmag(m) - a), torch.full_like(m, C_ZERO), m)
        return torch.where(x < 0, m | 128, m)

    return torch.stack([dcode(dlo), dcode(dhi), ccode(clo), ccode(chi)], dim=1).to(torch.uint8)


def _quantize_rows(w, g, tparams, d0, c0, levels: int = 15):
    """(codes uint8 [N, K] in [0, levels], gparams, rparams) of the rows `w` given their groups'
    min/max scale and centre; codes of `levels` + 1 values (15: Int4DQ's 4-bit ones)."""
    n, k = w.shape
    rparams = _encode_row_params(d0.amin(1), d0.amax(1), c0.amin(1), c0.amax(1), tparams)
    dlo, dstep, clo, cstep = decode_row_params(rparams, tparams).unbind(1)
    dlo, dstep, clo, cstep = dlo[:, None], dstep[:, None], clo[:, None], cstep[:, None]

    def nearest_index(value, lo, step):
        safe = torch.where(step > 0, step, torch.ones_like(step))
        return torch.where(step > 0, torch.round((value - lo) / safe), torch.zeros_like(value)).clamp(0, 15)

    a0, b0 = nearest_index(d0, dlo, dstep), nearest_index(c0, clo, cstep)
    x, mask = _padded_groups(w, g)
    a, b, q = int4dq_search(x, mask, a0, b0, dlo, dstep, clo, cstep, k, levels=levels)
    codes = q.reshape(n, -1)[:, :k].to(torch.uint8)
    gparams = (a.to(torch.uint8) | (b.to(torch.uint8) << 4))
    return codes, gparams, rparams

