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
`(1, K)`, per group `(1, g)`. Scale and zero have shape `shape[i] // block_size[i]`.
"""
from __future__ import annotations

import torch

from .errors import AOQError

FLOAT8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def check_finite(x: torch.Tensor, name: str) -> None:
    """Raise a clear error if `x` holds inf or nan (they would poison every scale)."""
    if x.is_floating_point() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise AOQError(f"{name}: cannot quantize a tensor with inf or nan ({bad} such elements)")


def _check_block_size(shape: torch.Size, block_size: tuple[int, ...], name: str) -> None:
    if len(block_size) != len(shape):
        raise AOQError(f"{name}: block_size {tuple(block_size)} has {len(block_size)} dims, tensor has {len(shape)}")
    for dim, (d, b) in enumerate(zip(shape, block_size)):
        if b <= 0 or d % b != 0:
            raise AOQError(
                f"{name}: block size {b} does not divide dimension {dim} (size {d}) of shape {tuple(shape)}"
            )


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
    return tuple(d // b for d, b in zip(shape, block_size))


def midpoint(qmin: int, qmax: int) -> int:
    return (qmin + qmax + 1) // 2


def choose_qparams_affine(
    x: torch.Tensor,
    block_size: tuple[int, ...],
    qmin: int,
    qmax: int,
    *,
    symmetric: bool,
    param_dtype: torch.dtype,
    name: str = "tensor",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Min/max (asymmetric) or symmetric scale and zero for each block; neither clips.

    Returns `(scale, zero)` in `param_dtype`, each of shape `block_shape(x.shape, block_size)`;
    `zero` is None when symmetric. All-zero or constant blocks get a finite, non-zero scale.
    """
    check_finite(x, name)
    _check_block_size(x.shape, block_size, name)
    xb = _blocked(x.float(), block_size)
    dims = _block_dims(x.ndim)
    tiny = torch.finfo(param_dtype).tiny
    lo = xb.amin(dim=dims)
    hi = xb.amax(dim=dims)
    if symmetric:
        # The tightest scale that clips nothing: int4 has 7 codes above the midpoint and 8
        # below, so the side that holds the block's extreme decides.
        mid = midpoint(qmin, qmax)
        scale = torch.maximum(hi.clamp(min=0) / (qmax - mid), (-lo).clamp(min=0) / (mid - qmin))
        return scale.clamp(min=tiny).to(param_dtype), None
    levels = qmax - qmin
    span = hi - lo
    # A constant block has no span; scale by its magnitude so zero stays representable.
    scale = torch.where(span > 0, span / levels, torch.maximum(lo.abs(), hi.abs()) / levels)
    scale = scale.clamp(min=tiny).to(param_dtype)
    zero = (lo + (midpoint(qmin, qmax) - qmin) * scale.float()).to(param_dtype)
    return scale, zero


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
    xb = _blocked(x.float(), block_size)
    s = _expand(scale.float(), x.ndim)
    if zero is not None:
        xb = xb - _expand(zero.float(), x.ndim)
    q = torch.round(xb / s) + midpoint(qmin, qmax)
    return q.clamp_(qmin, qmax).reshape(x.shape).to(out_dtype)


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
    qb = _blocked(q.to(torch.float32) - midpoint(qmin, qmax), block_size)
    xb = qb * _expand(scale.float(), q.ndim)
    if zero is not None:
        xb = xb + _expand(zero.float(), q.ndim)
    return xb.reshape(q.shape).to(out_dtype)


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
