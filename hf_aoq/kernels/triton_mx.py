"""Triton kernels for MXTensor (MXFP4, MXFP8) and NVFP4Tensor weights in their canonical layouts
(imported only where triton is installed; triton_kernels.py has their rows): a GEMV for few rows
that decodes the weight in registers and accumulates in float32, and a one-pass dequantization
to x's dtype for cuBLAS at large M. No FP4 tensor cores (Blackwell only): on an H200 both are
decode + float arithmetic.

Every weight is decoded from its bits, as the type's dequantize(x.dtype) gives it, bit for bit:
the element's float32 value (e2m1 from its sign, exponent and mantissa bits; e4m3 and e5m2 from
theirs, NaN codes to NaN) times its block's float32 scale (MX: e8m0 2^(code - 127) as exponent
bits, code 0 the subnormal 2^-127, 255 NaN; NVFP4: per_tensor_scale * e4m3 scale), rounded to
x's dtype to nearest even. The codes are read as bytes (float8 fields viewed as uint8).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_jit import BLOCK_K, WIDE_BLOCK_N, WIDE_NUM_WARPS, _ROUND, e4m3_value, round_to
from .triton_gemm import DEQUANT_BLOCK_K, DEQUANT_BLOCK_N

# The element formats, by the FORMAT constexpr.
MXFP4, MX_E4M3, MX_E5M2, NVFP4 = 0, 1, 2, 3
PACKED = (MXFP4, NVFP4)  # two e2m1 codes a byte, the even element in the low nibble


def e2m1_value_body(c):
    """The float32 value of e2m1 codes c (int32, 0..15; bit 3 the sign), from the bits:
    exponent field e, mantissa bit m: e = 0 is 0 or 0.5, else (1 + m / 2) * 2^(e - 1)."""
    e = (c >> 1) & 3
    m = c & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((c >> 3) << 31)).to(tl.float32, bitcast=True)


e2m1_value = triton.jit(e2m1_value_body)


def e4m3_any_body(c):
    """The float32 value of e4m3fn codes c (int32, 0..255), NaN for 0x7F and 0xFF."""
    bits = e4m3_value(c).to(tl.int32, bitcast=True)
    return tl.where((c & 0x7F) == 0x7F, 0x7FC00000, bits).to(tl.float32, bitcast=True)


e4m3_any = triton.jit(e4m3_any_body)


def e5m2_value_body(c):
    """The float32 value of e5m2 codes c (int32, 0..255): the high byte of a float16."""
    return (c << 8).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


e5m2_value = triton.jit(e5m2_value_body)


def e8m0_value_body(c):
    """float32 2^(c - 127) of e8m0 codes c (int32): exponent bits; 0 is 2^-127, 255 NaN."""
    bits = tl.where(c == 0, 0x00400000, c << 23)
    return tl.where(c == 255, 0x7FC00000, bits).to(tl.float32, bitcast=True)


e8m0_value = triton.jit(e8m0_value_body)


def mx_decode_body(c, sc, p, FORMAT: tl.constexpr):
    """float32 weights of element codes c times their blocks' scale codes sc (int32); p: NVFP4's
    per-tensor scale (float32)."""
    if FORMAT == 3:
        w = e2m1_value(c) * (p * e4m3_any(sc))
    elif FORMAT == 0:
        w = e2m1_value(c) * e8m0_value(sc)
    elif FORMAT == 1:
        w = e4m3_any(c) * e8m0_value(sc)
    else:
        w = e5m2_value(c) * e8m0_value(sc)
    return w


mx_decode = triton.jit(mx_decode_body)


def mx_pair_tile_body(q_ptr, s_ptr, p_ptr, offs_n, offs_j, n_mask, K, stride_qn, stride_sn,
                      FORMAT: tl.constexpr, BLOCK: tl.constexpr, ROUND: tl.constexpr):
    """Weights at k = 2j and 2j + 1 of rows offs_n (float32, rounded to x's dtype), and their
    masks. Packed formats: byte j; float8 elements: bytes 2j and 2j + 1 (K may be odd)."""
    lo_mask = n_mask[:, None] & (offs_j * 2 < K)[None, :]
    hi_mask = n_mask[:, None] & (offs_j * 2 + 1 < K)[None, :]
    row = q_ptr + offs_n[:, None] * stride_qn
    if FORMAT == 0 or FORMAT == 3:
        b = tl.load(row + offs_j[None, :], mask=lo_mask, other=0).to(tl.int32)
        c_lo = b & 15
        c_hi = (b >> 4) & 15
    else:
        c_lo = tl.load(row + offs_j[None, :] * 2, mask=lo_mask, other=0).to(tl.int32)
        c_hi = tl.load(row + offs_j[None, :] * 2 + 1, mask=hi_mask, other=0).to(tl.int32)
    # BLOCK is even: both elements of a pair share their block's scale.
    sc = tl.load(s_ptr + offs_n[:, None] * stride_sn + (offs_j[None, :] * 2) // BLOCK, mask=lo_mask,
                 other=0).to(tl.int32)
    p = 1.0
    if FORMAT == 3:
        p = tl.load(p_ptr)
    w_lo = round_to(mx_decode(c_lo, sc, p, FORMAT), ROUND)
    w_hi = round_to(mx_decode(c_hi, sc, p, FORMAT), ROUND)
    return w_lo, w_hi, lo_mask, hi_mask


mx_pair_tile = triton.jit(mx_pair_tile_body)


def mx_gemv_body(x_ptr, q_ptr, s_ptr, p_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
                 FORMAT: tl.constexpr, BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row m times BLOCK_N rows of an MX / NVFP4 weight [N, K]."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        w_lo, w_hi, lo_mask, hi_mask = mx_pair_tile(q_ptr, s_ptr, p_ptr, offs_n, offs_j, n_mask, K, stride_qn,
                                                    stride_sn, FORMAT, BLOCK, ROUND)
        xe = tl.load(x_ptr + m * stride_xm + offs_j * 2, mask=offs_j * 2 < K, other=0).to(tl.float32)
        xo = tl.load(x_ptr + m * stride_xm + offs_j * 2 + 1, mask=offs_j * 2 + 1 < K, other=0).to(tl.float32)
        # Masked-off weights are decoded from code 0 (finite zero): they add nothing.
        w_lo = tl.where(lo_mask, w_lo, 0.0)
        w_hi = tl.where(hi_mask, w_hi, 0.0)
        acc += tl.sum(w_lo * xe[None, :] + w_hi * xo[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


mx_gemv_kernel = triton.jit(mx_gemv_body)


def as_out_body(w, w_ptr, ROUND: tl.constexpr):
    """float32 w (already rounded to w's dtype) as w's dtype; bfloat16 by its high 16 bits (the
    interpreter's cast loses float32 subnormals' bits)."""
    if ROUND == 2:
        out = (w.to(tl.uint32, bitcast=True) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = w.to(w_ptr.dtype.element_ty)
    return out


as_out = triton.jit(as_out_body)


def mx_dequantize_body(q_ptr, s_ptr, p_ptr, w_ptr, N, K, stride_qn, stride_sn, FORMAT: tl.constexpr,
                       BLOCK: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] tile of the weight [N, K] in w's dtype, as dequantize(w's dtype)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    w_lo, w_hi, lo_mask, hi_mask = mx_pair_tile(q_ptr, s_ptr, p_ptr, offs_n, offs_j, offs_n < N, K, stride_qn,
                                                stride_sn, FORMAT, BLOCK, ROUND)
    w_at = w_ptr + offs_n[:, None] * K + offs_j[None, :] * 2
    tl.store(w_at, as_out(w_lo, w_ptr, ROUND), mask=lo_mask)
    tl.store(w_at + 1, as_out(w_hi, w_ptr, ROUND), mask=hi_mask)


mx_dequantize_kernel = triton.jit(mx_dequantize_body)


def fields(qdata: torch.Tensor, scale: torch.Tensor, fmt: int):
    """The codes and scale codes as bytes (float8 fields viewed as uint8)."""
    q = qdata if fmt in PACKED else qdata.view(torch.uint8)
    return q, scale.view(torch.uint8)


def block_of(fmt: int) -> int:
    return 16 if fmt == NVFP4 else 32


def mx_gemv(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, per_tensor_scale: torch.Tensor | None,
            bias: torch.Tensor | None, fmt: int, n: int, k: int) -> torch.Tensor:
    """[M, K] activations (unit stride along K) times a canonical 2-D MX (fmt MXFP4, MX_E4M3,
    MX_E5M2) or NVFP4 weight: [M, N] in x's dtype."""
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    q, s = fields(qdata, scale, fmt)
    p = per_tensor_scale if per_tensor_scale is not None else s
    mx_gemv_kernel[(triton.cdiv(n, WIDE_BLOCK_N), m)](
        x2, q, s, p, bias if bias is not None else y, y, n, k, x2.stride(0), y.stride(0), q.stride(0), s.stride(0),
        FORMAT=fmt, BLOCK=block_of(fmt), HAS_BIAS=bias is not None, ROUND=_ROUND[x2.dtype], BLOCK_N=WIDE_BLOCK_N,
        BLOCK_K=BLOCK_K, num_warps=WIDE_NUM_WARPS, enable_fp_fusion=False,
    )
    return y


def mx_dequantize(qdata: torch.Tensor, scale: torch.Tensor, per_tensor_scale: torch.Tensor | None, fmt: int,
                  n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A canonical 2-D MX / NVFP4 weight [N, K] in `dtype`, in one pass (the type's dequantize)."""
    w = torch.empty(n, k, dtype=dtype, device=qdata.device)
    if w.numel():
        q, s = fields(qdata, scale, fmt)
        grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k, DEQUANT_BLOCK_K))
        mx_dequantize_kernel[grid](
            q, s, per_tensor_scale if per_tensor_scale is not None else s, w, n, k, q.stride(0), s.stride(0),
            FORMAT=fmt, BLOCK=block_of(fmt), ROUND=_ROUND[dtype], BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K,
            enable_fp_fusion=False,
        )
    return w
