"""Quantization primitives: choose scale/zero, quantize, dequantize, for integers and float8.

Integer quantization here is *midpoint-centred affine*::

    x  ~=  (q - mid) * scale + zero          mid = (qmin + qmax + 1) // 2

`zero` is a value in the weight's own domain (the value that code `mid` stands for), or None
for symmetric quantization where it is 0. This is the form the fast int4 kernels (tinygemm
and its CPU twin) consume directly, it stays accurate when a group sits far from zero, and
GGUF's Q4_1 (`q * d + m`) maps onto it exactly (`scale = d`, `zero = m + mid * d`).

Scales and zeros are chosen in float32, cast to the storage dtype, and the codes are then
computed from the *stored* values, so rounding the scale never adds a second error.

A `block_size` says which elements share one scale: per tensor is the full shape, per row
`(1, K)`, per group `(1, g)`. Scale and zero have shape `ceil(shape[i] / block_size[i])`.
Every dimension but the last must be a multiple of its block size; along the last one the final
block may be partial (K = 576 in groups of 128 has four whole groups and one of 64), which the
integer functions handle by treating that block on its own.
"""
from __future__ import annotations

import torch

from .errors import AOQError

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# The float8 codes that are not finite numbers, as (bits, what): a code c is one where c | bits is
# 0xFF. e4m3fn has no infinities and one NaN magnitude (S.1111.111); e5m2's all-ones exponent is
# inf (mantissa 0) or NaN (S.11111.xx).
FLOAT8_SPECIAL_CODES = {torch.float8_e4m3fn: (0x80, "NaN"), torch.float8_e5m2: (0x83, "inf or NaN")}
# Bytes a loader scans at a time for them (one uint8 buffer of this size).
_CODE_SCAN_CHUNK = 1 << 24


def check_float8_codes_finite(qdata: torch.Tensor, field: str = "qdata", codes: str = "codes", why: str = "") -> None:
    """Refuse a stored float8 weight holding inf or NaN codes: an AOQError naming `field`, the
    count of such `codes` and the first position (`why` ends the message). No hf_aoq encoder writes them
    for a weight, and the CPU kernels read float8 codes with a bit trick that has no special
    values, so such a file would compute finite numbers where the reference computes NaN or inf.
    One pass over the bytes in chunks (about 0.1 s a GB on two cores); meta tensors are skipped."""
    if qdata.dtype not in FLOAT8_SPECIAL_CODES or qdata.device.type == "meta" or qdata.numel() == 0:
        return
    bits, what = FLOAT8_SPECIAL_CODES[qdata.dtype]
    flat = qdata.reshape(-1).view(torch.uint8)
    buf = torch.empty(min(_CODE_SCAN_CHUNK, flat.numel()), dtype=torch.uint8, device=flat.device)
    bad, first = 0, None
    for start in range(0, flat.numel(), _CODE_SCAN_CHUNK):
        part = flat[start:start + _CODE_SCAN_CHUNK]
        hit = torch.bitwise_or(part, bits, out=buf[: part.numel()]).eq_(0xFF)
        if bool(hit.any()):
            bad += int(hit.sum())
            first = start + int(hit.nonzero()[0]) if first is None else first
    if bad:
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(qdata.shape)))
        raise AOQError(f"field {field!r}: {bad} {str(qdata.dtype).replace('torch.', '')} {codes} are {what} "
                       f"(the first at {where}); {why or 'a stored float8 weight is finite (docs/format.md)'}")


# Quantizing a weight makes a few float32 temporaries of what it works on (about ten for the
# "mse" search); taking the rows in chunks of about this many elements bounds them, which is
# quantize-on-load's peak memory on CPU. Every scheme here is independent from row to row, so
# the result is the same. Accelerators get bigger chunks: fewer, larger kernel launches.
ROW_CHUNK_ELEMENTS = 1 << 18
ROW_CHUNK_ELEMENTS_ACCELERATOR = 1 << 22


def by_row_chunks(x: torch.Tensor, fn, *aligned: torch.Tensor, rows_multiple: int = 1):
    """`fn(rows, *aligned_rows)` over chunks of `x`'s rows (a multiple of `rows_multiple` each)
    and the same rows of each `aligned` tensor; its results (a tuple of tensors with rows along
    dim 0, or None) concatenated as if it ran on all of `x`."""
    n, k = x.shape
    budget = ROW_CHUNK_ELEMENTS if x.device.type == "cpu" else ROW_CHUNK_ELEMENTS_ACCELERATOR
    step = max(rows_multiple, budget // max(k, 1) // rows_multiple * rows_multiple)
    if step >= n:
        return fn(x, *aligned)
    parts = [fn(x[i : i + step], *(a[i : i + step] for a in aligned)) for i in range(0, n, step)]
    return tuple(None if p[0] is None else torch.cat(p) for p in zip(*parts))


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise a clear error if `x` holds inf or nan (they would poison every scale)."""
    if not x.is_floating_point() or x.numel() == 0:
        return
    # min and max propagate nan and hold any inf: one fast reduction (30x isfinite().all() on
    # bf16) says whether there is anything to count.
    lo, hi = torch.aminmax(x)
    if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
        bad = int((~torch.isfinite(x)).sum())
        raise AOQError(f"{name}: cannot quantize a tensor with inf or nan ({bad} such elements)")


def _check_block_size(
    shape: torch.Size, block_size: tuple[int, ...], name: str, *, partial_last: bool = False
) -> None:
    if len(block_size) != len(shape):
        raise AOQError(f"{name}: block_size {tuple(block_size)} has {len(block_size)} dims, tensor has {len(shape)}")
    for dim, (d, b) in enumerate(zip(shape, block_size)):
        last = dim == len(shape) - 1
        if b <= 0 or (d % b != 0 and not (partial_last and last)):
            raise AOQError(
                f"{name}: block size {b} does not divide dimension {dim} (size {d}) of shape {tuple(shape)}"
            )


def _split_last_block(k: int, block_size: tuple[int, ...]) -> list[tuple[slice, slice, tuple[int, ...]]]:
    """Split the last dim into the part made of whole blocks and a partial final block: for each
    part, the slice of the data, the slice of the parameter grid and the part's block size."""
    b = block_size[-1]
    whole = k - k % b
    parts = []
    if whole:
        parts.append((slice(0, whole), slice(0, whole // b), tuple(block_size)))
    if k % b:
        parts.append((slice(whole, k), slice(whole // b, whole // b + 1), tuple(block_size[:-1]) + (k % b,)))
    return parts


def _blocked(x: torch.Tensor, block_size: tuple[int, ...]) -> torch.Tensor:
    """View `x` as (n0, b0, n1, b1, ...) so that reducing the odd dims reduces each block."""
    shape = []
    for d, b in zip(x.shape, block_size):
        shape += [d // b, b]
    return x.reshape(shape)


def _block_dims(ndim: int) -> tuple[int, ...]:
    return tuple(range(1, 2 * ndim, 2))


def _expand(p: torch.Tensor, ndim: int) -> torch.Tensor:
    """A per-block parameter of shape (n0, n1, ...) viewed to broadcast against `_blocked`."""
    shape = []
    for n in p.shape:
        shape += [n, 1]
    return p.reshape(shape)


def block_shape(shape: torch.Size, block_size: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of the parameter grid: one entry per block, a partial last block included."""
    return tuple(-(-d // b) for d, b in zip(shape, block_size))


def midpoint(qmin: int, qmax: int) -> int:
    return (qmin + qmax + 1) // 2


QPARAM_METHODS = ("minmax", "mse")


def choose_qparams_affine(
    x: torch.Tensor,
    block_size: tuple[int, ...],
    qmin: int,
    qmax: int,
    *,
    symmetric: bool,
    param_dtype: torch.dtype,
    name: str = "tensor",
    method: str = "minmax",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero for each block.

    `method="minmax"`: the block's range maps onto the code range (asymmetric) or its larger
    side does (symmetric); nothing clips. `method="mse"`: the scale and zero that minimise the
    block's squared reconstruction error, found by `_mse_qparams` (row blocks only); it may clip
    outliers when that lowers the error.

    Returns `(scale, zero)` in `param_dtype`, each of shape `block_shape(x.shape, block_size)`;
    `zero` is None when symmetric. All-zero or constant blocks get a finite, non-zero scale.
    """
    check_finite(x, name)
    _check_block_size(x.shape, block_size, name, partial_last=True)
    if method not in QPARAM_METHODS:
        raise AOQError(f"{name}: unknown method {method!r} for choosing scales; expected one of {QPARAM_METHODS}")
    if method == "mse" and any(b != 1 for b in block_size[:-1]):
        raise AOQError(f"{name}: method 'mse' needs blocks within one row, got block_size {tuple(block_size)}")
    choose = _minmax_qparams if method == "minmax" else _mse_qparams
    scales, zeros = [], []
    for data, _, block in _split_last_block(x.shape[-1], block_size):
        scale, zero = choose(x[..., data], block, qmin, qmax, symmetric, param_dtype)
        scales.append(scale)
        zeros.append(zero)
    if len(scales) == 1:
        return scales[0], zeros[0]
    return torch.cat(scales, dim=-1), None if symmetric else torch.cat(zeros, dim=-1)


def range_limit(*dtypes: torch.dtype) -> float:
    """The largest magnitude a block's range may reach when its scale and zero are stored in,
    and it is dequantized to, these dtypes (float32 arithmetic in between): a little inside the
    smallest of their maxima, so that rounding the scale and zero cannot overflow. Only values
    within 0.4% of a dtype's maximum are affected; they are clipped that much (less than one
    quantization step of any scheme here)."""
    return min(torch.finfo(d).max for d in (torch.float32, *dtypes)) * (1 - 2**-8)


def _minmax_qparams(x, block_size, qmin, qmax, symmetric, param_dtype):
    xb = _blocked(x.float(), block_size)
    dims = _block_dims(x.ndim)
    tiny = torch.finfo(param_dtype).tiny
    limit = range_limit(x.dtype, param_dtype)
    lo = xb.amin(dim=dims).clamp_(-limit, limit)
    hi = xb.amax(dim=dims).clamp_(-limit, limit)
    if symmetric:
        # The tightest scale that clips nothing: int4 has 7 codes above the midpoint and 8
        # below, so the side that holds the block's extreme decides.
        mid = midpoint(qmin, qmax)
        scale = torch.maximum(hi.clamp(min=0) / (qmax - mid), (-lo).clamp(min=0) / (mid - qmin))
        return scale.clamp(min=tiny).to(param_dtype), None
    levels = qmax - qmin
    # A constant block has no span: its range is widened to reach 0, so that its value is a
    # code's (the lowest if negative, the highest if positive) and zero stays inside the range
    # (lo + 8 * scale past the block's value could overflow the storage dtype).
    constant = hi == lo
    lo = torch.where(constant, lo.clamp(max=0), lo)
    hi = torch.where(constant, hi.clamp(min=0), hi)
    scale = ((hi - lo) / levels).clamp(min=tiny).to(param_dtype)
    zero = (lo + (midpoint(qmin, qmax) - qmin) * scale.float()).to(param_dtype)
    return scale, zero


# Candidate code ranges for the MSE search: the block's range is mapped onto `levels + d` steps
# for each d, so d > 0 tries scales smaller than min/max's (clipping the extremes). Each
# candidate is then refined by rounding and a least-squares fit of scale and zero. Measured on
# SmolLM2-135M, int4 g128 (perplexity, scripts/eval_quality.py): min/max 52.0; these settings
# 45.2; a wider search that lowers the weights' squared error further (d up to 4, 4 fits) 48.9,
# so the weight error is only a proxy and more search is not better.
_MSE_EXTRA_STEPS = (0.0, 1.0, 2.0)
_MSE_REFINEMENTS = 1
_MSE_ROWS_PER_CHUNK = 16384  # blocks processed at once: bounds the search's memory


def _mse_qparams(x, block_size, qmin, qmax, symmetric, param_dtype):
    """Per block, the (scale, zero) among several candidates that reconstructs the block with
    the least squared error, each candidate refined `_MSE_REFINEMENTS` times by: round to codes,
    then the least-squares scale (and zero) for those codes. Never worse than min/max, which is
    the first candidate. Blocks are rows of `block_size[-1]` elements."""
    b = block_size[-1]
    rows = x.reshape(-1, b)
    limit = range_limit(x.dtype, param_dtype)
    scales, zeros = [], []
    for chunk in rows.split(_MSE_ROWS_PER_CHUNK):
        s, z = _mse_search_rows(chunk.float(), qmin, qmax, symmetric, param_dtype, limit)
        scales.append(s)
        zeros.append(z)
    grid = x.shape[:-1] + (x.shape[-1] // b,)
    scale = torch.cat(scales).reshape(grid)
    return scale, None if symmetric else torch.cat(zeros).reshape(grid)


def _mse_search_rows(w, qmin, qmax, symmetric, param_dtype, limit):
    mid = midpoint(qmin, qmax)
    tiny = torch.finfo(param_dtype).tiny
    s0, z0 = _minmax_qparams(w, (1, w.shape[1]), qmin, qmax, symmetric, param_dtype)
    best_s, best_z = s0.float(), (z0.float() if z0 is not None else None)
    best_err = _sq_error(w, best_s, best_z, qmin, qmax, mid)
    lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    for extra in _MSE_EXTRA_STEPS[1:]:
        if symmetric:
            s = s0.float() * (qmax - qmin) / (qmax - qmin + extra)
            z = None
        else:
            s = ((hi - lo) / (qmax - qmin + extra)).clamp(min=tiny)
            z = (lo + hi) / 2 + (mid - (qmin + qmax) / 2) * s  # the candidate grid centred on the block
        for _ in range(_MSE_REFINEMENTS):
            s, z = _least_squares_fit(w, s, z, qmin, qmax, mid, tiny)
        s = s.to(param_dtype).float()
        z = z.to(param_dtype).float() if z is not None else None
        err = _sq_error(w, s, z, qmin, qmax, mid)
        # A candidate whose lowest or highest code would dequantize past `limit` is not one.
        ends = torch.cat([(qmin - mid) * s, (qmax - mid) * s], 1) + (0 if z is None else z)
        better = (err < best_err) & (ends.abs() <= limit).all(1, keepdim=True)
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        if z is not None:
            best_z = torch.where(better, z, best_z)
    return best_s.to(param_dtype), (best_z.to(param_dtype) if best_z is not None else None)


def _codes(w, s, z, qmin, qmax, mid):
    shifted = w if z is None else w - z
    return (torch.round(shifted / s) + mid).clamp_(qmin, qmax) - mid


def _sq_error(w, s, z, qmin, qmax, mid):
    q = _codes(w, s, z, qmin, qmax, mid)
    rec = q * s if z is None else q * s + z
    return (rec - w).square_().sum(1, keepdim=True)


def _least_squares_fit(w, s, z, qmin, qmax, mid, tiny):
    """Round with (s, z), then the (s, z) that best reconstruct `w` from those codes."""
    q = _codes(w, s, z, qmin, qmax, mid)
    if z is None:
        qq = (q * q).sum(1, keepdim=True)
        fit = (q * w).sum(1, keepdim=True) / qq.clamp(min=1e-30)
        return torch.where(qq > 0, fit, s).clamp(min=tiny), None
    n = w.shape[1]
    sq, sw = q.sum(1, keepdim=True), w.sum(1, keepdim=True)
    sqq, sqw = (q * q).sum(1, keepdim=True), (q * w).sum(1, keepdim=True)
    det = n * sqq - sq * sq
    ok = det > 0
    fit_s = (n * sqw - sq * sw) / torch.where(ok, det, torch.ones_like(det))
    ok = ok & (fit_s > 0)
    s_new = torch.where(ok, fit_s, s).clamp(min=tiny)
    z_new = torch.where(ok, (sw - s_new * sq) / n, z)
    return s_new, z_new


def quantize_affine(
    x: torch.Tensor,
    block_size: tuple[int, ...],
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    qmin: int,
    qmax: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Codes `q = clamp(round((x - zero) / scale) + mid, qmin, qmax)` as `out_dtype`."""
    parts = []
    for data, grid, block in _split_last_block(x.shape[-1], block_size):
        # One float32 copy, worked on in place (the same operations in the same order).
        xb = _blocked(x[..., data].to(torch.float32, copy=True), block)
        s = _expand(scale[..., grid].float(), x.ndim)
        if zero is not None:
            xb.sub_(_expand(zero[..., grid].float(), x.ndim))
        q = xb.div_(s).round_().add_(midpoint(qmin, qmax))
        parts.append(q.clamp_(qmin, qmax).reshape(*x.shape[:-1], data.stop - data.start).to(out_dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def dequantize_affine(
    q: torch.Tensor,
    block_size: tuple[int, ...],
    scale: torch.Tensor,
    zero: torch.Tensor | None,
    qmin: int,
    qmax: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """`(q - mid) * scale + zero`, computed in float32 and returned as `out_dtype`."""
    parts = []
    for data, grid, block in _split_last_block(q.shape[-1], block_size):
        qb = _blocked(q[..., data].to(torch.float32) - midpoint(qmin, qmax), block)
        xb = qb * _expand(scale[..., grid].float(), q.ndim)
        if zero is not None:
            xb = xb + _expand(zero[..., grid].float(), q.ndim)
        parts.append(xb.reshape(*q.shape[:-1], data.stop - data.start).to(out_dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def choose_scale_float8(
    x: torch.Tensor,
    block_size: tuple[int, ...],
    float8_dtype: torch.dtype,
    *,
    name: str = "tensor",
) -> torch.Tensor:
    """Float32 scale per block so that the block's abs-max maps to the float8 maximum."""
    if float8_dtype not in FLOAT8_DTYPES:
        raise AOQError(f"{name}: unsupported float8 dtype {float8_dtype}; expected one of {FLOAT8_DTYPES}")
    check_finite(x, name)
    _check_block_size(x.shape, block_size, name)
    amax = _blocked(x.float(), block_size).abs().amax(dim=_block_dims(x.ndim))
    # 1e-12 keeps an all-zero block finite without touching any realistic weight scale.
    return (amax / torch.finfo(float8_dtype).max).clamp(min=1e-12)


def quantize_float8(
    x: torch.Tensor, block_size: tuple[int, ...], scale: torch.Tensor, float8_dtype: torch.dtype
) -> torch.Tensor:
    fmax = torch.finfo(float8_dtype).max
    xb = _blocked(x.float(), block_size) / _expand(scale.float(), x.ndim)
    return xb.clamp_(-fmax, fmax).reshape(x.shape).to(float8_dtype)


def dequantize_float8(
    q: torch.Tensor, block_size: tuple[int, ...], scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    xb = _blocked(q.to(torch.float32), block_size) * _expand(scale.float(), q.ndim)
    return xb.reshape(q.shape).to(out_dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in [0, 15] of shape (..., K) into (..., K/2): low nibble = even k."""
    if q.shape[-1] % 2:
        raise AOQError(f"cannot pack int4 codes with an odd last dimension {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of `pack_int4`: (..., K/2) uint8 -> (..., K) uint8 codes."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
