"""Triton small-M GEMMs and one-pass dequantizations of int4 and Int4DQ weights in their canonical
layouts (imported only where triton is installed; triton_kernels.py has their rows).

The GEMMs tile M, N and K: each K step decodes a [BLOCK_N, BLOCK_K] tile of weights to x's dtype
(rounded to nearest even, as the reference's dequantize(x.dtype)), then two tensor-core dots (even
and odd k) accumulate in float32. BLOCK_K divides the group size, so a tile has one scale (one
group parameter byte) per row; a partial last group is a masked tile. The dequantizations write
the whole weight in x's dtype, for cuBLAS at large M.

Under TRITON_INTERPRET=1 the dots run on float32 operands (DOT_F32): the interpreter multiplies
bfloat16 operands as their raw 16-bit integers (triton 3.9). The operands hold the same values,
so only the accumulation order differs from the GPU's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .triton_jit import _ROUND, int4dq_decode, int4dq_row_params, round_to

# (BLOCK_M, BLOCK_N, BLOCK_K at most, num_warps, num_stages) by the largest M each serves. Chosen
# without a GPU: every entry compiles for sm90 without spills (bf16: 124, 128, 170 and 224
# registers a thread for int4 in groups of 128; 157, 152, 187 and 238 for Int4DQ in groups of
# 64); BLOCK_K 128, or 4 warps at BLOCK_M >= 32, reach the 255 cap. scripts/gpu_bench.py
# --crossover times them.
GEMM_TILES = ((16, 32, 64, 4, 3), (32, 64, 64, 8, 3), (64, 64, 64, 8, 3), (128, 64, 64, 8, 3))
GEMM_TILE_ROWS = (16, 32, 64, None)  # None: any M
DEQUANT_BLOCK_N, DEQUANT_BLOCK_K = 32, 64


def gemm_tile(m: int, group_size: int, dtype: torch.dtype = torch.bfloat16) -> tuple[int, int, int, int, int]:
    """The tile for M rows: BLOCK_K is cut to divide the group size. float32 activations (no
    row's choice: dequantization + cuBLAS serves them) take the smallest tile at BLOCK_K 32 at
    every M: float32 dot operands spill at BLOCK_K 64, or at BLOCK_M 64."""
    if dtype == torch.float32:
        bm, bn, bk, warps, stages = GEMM_TILES[0]
        return bm, bn, min(32, group_size), warps, stages
    for rows, (bm, bn, bk, warps, stages) in zip(GEMM_TILE_ROWS, GEMM_TILES):
        if rows is None or m <= rows:
            return bm, bn, min(bk, group_size), warps, stages
    raise AssertionError("unreachable")


def int4_decode_body(b, s, z, HAS_ZERO: tl.constexpr, ROUND: tl.constexpr):
    """Int4Tensor weights (q - 8) * s + z of code bytes b (int32, low nibble = even k) in float32,
    rounded as round_to does: (w at even k, w at odd k). Launch with enable_fp_fusion=False."""
    w_lo = ((b & 15).to(tl.float32) - 8.0) * s
    w_hi = (((b >> 4) & 15).to(tl.float32) - 8.0) * s
    if HAS_ZERO:
        w_lo = w_lo + z
        w_hi = w_hi + z
    return round_to(w_lo, ROUND), round_to(w_hi, ROUND)


int4_decode = triton.jit(int4_decode_body)


def dot_acc_body(acc, xe, xo, w_lo, w_hi, DOT_F32: tl.constexpr):
    """acc + xe @ w_lo^T + xo @ w_hi^T (x [BLOCK_M, BLOCK_K/2] in its dtype, w float32 holding
    values of x's dtype [BLOCK_N, BLOCK_K/2]), on x's dtype's tensor cores or in float32."""
    if DOT_F32:
        acc = tl.dot(xe.to(tl.float32), tl.trans(w_lo), acc, input_precision="ieee")
        acc = tl.dot(xo.to(tl.float32), tl.trans(w_hi), acc, input_precision="ieee")
    else:
        acc = tl.dot(xe, tl.trans(w_lo.to(xe.dtype)), acc)
        acc = tl.dot(xo, tl.trans(w_hi.to(xo.dtype)), acc)
    return acc


dot_acc = triton.jit(dot_acc_body)


def store_out_body(y_ptr, b_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS: tl.constexpr):
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


store_out = triton.jit(store_out_body)


def int4_gemm_body(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
                   GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr, ROUND: tl.constexpr,
                   DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x [M, K] times a canonical Int4Tensor (qdata uint8 [N, K/2], scale and zero [N, ceil(K/g)]):
    one [BLOCK_M, BLOCK_N] tile of y per program (axis 0 along N, axis 1 along M)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte j holds k = 2j (low) and 2j + 1 (high)
        j_mask = offs_j < K // 2
        b = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_j[None, :], mask=n_mask[:, None] & j_mask[None, :],
                    other=0).to(tl.int32)
        s = tl.load(s_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_mask, other=0).to(tl.float32)[:, None]
        z = s
        if HAS_ZERO:
            z = tl.load(z_ptr + offs_n * stride_sn + k0 // GROUP, mask=n_mask, other=0).to(tl.float32)[:, None]
        w_lo, w_hi = int4_decode(b, s, z, HAS_ZERO, ROUND)
        x_at = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_j[None, :]
        x_mask = m_mask[:, None] & j_mask[None, :]
        acc = dot_acc(acc, tl.load(x_at, mask=x_mask, other=0), tl.load(x_at + 1, mask=x_mask, other=0),
                      w_lo, w_hi, DOT_F32)
    store_out(y_ptr, b_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)


int4_gemm_kernel = triton.jit(int4_gemm_body)


def int4dq_gemm_body(x_ptr, q_ptr, g_ptr, r_ptr, t_ptr, lut_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                     stride_qn, stride_gn, stride_rn, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     ROUND: tl.constexpr, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    """x [M, K] times a canonical Int4DQTensor (see triton_jit.int4dq_gemv_body), tiled as
    int4_gemm_body; the weights decoded as Int4DQTensor.dequantize(x.dtype) does, bit for bit."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    n_mask = offs_n < N
    m_mask = offs_m < M
    dlo, dstep, clo, cstep = int4dq_row_params(r_ptr, t_ptr, lut_ptr, offs_n, n_mask, stride_rn)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        j_mask = offs_j < K // 2
        b = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_j[None, :], mask=n_mask[:, None] & j_mask[None, :],
                    other=0).to(tl.int32)
        gp = tl.load(g_ptr + offs_n * stride_gn + k0 // GROUP, mask=n_mask, other=0).to(tl.int32)[:, None]
        w_lo, w_hi = int4dq_decode(b, gp, dlo[:, None], dstep[:, None], clo[:, None], cstep[:, None], ROUND)
        x_at = x_ptr + offs_m[:, None] * stride_xm + 2 * offs_j[None, :]
        x_mask = m_mask[:, None] & j_mask[None, :]
        acc = dot_acc(acc, tl.load(x_at, mask=x_mask, other=0), tl.load(x_at + 1, mask=x_mask, other=0),
                      w_lo, w_hi, DOT_F32)
    store_out(y_ptr, b_ptr, acc, offs_m, offs_n, m_mask, n_mask, stride_ym, HAS_BIAS)


int4dq_gemm_kernel = triton.jit(int4dq_gemm_body)


INTERPRETED = isinstance(int4_gemm_kernel, InterpretedFunction)


def _dot_f32(x2: torch.Tensor) -> bool:
    return x2.dtype == torch.float32 or INTERPRETED


def _gemm_launch(x2: torch.Tensor, n: int, group_size: int, bias, tile):
    """The output, grid and common launch options of a GEMM of x2 [M, K] to N columns."""
    m = x2.shape[0]
    bm, bn, bk, warps, stages = tile or gemm_tile(m, group_size, x2.dtype)
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    options = dict(HAS_BIAS=bias is not None, ROUND=_ROUND[x2.dtype], DOT_F32=_dot_f32(x2), BLOCK_M=bm,
                   BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return y, (triton.cdiv(n, bn), triton.cdiv(m, bm)), options


def int4_gemm(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              bias: torch.Tensor | None, group_size: int, n: int, k: int, tile=None) -> torch.Tensor:
    """[M, K] activations (unit stride along K; bf16 and fp16 on tensor cores, fp32 in float32)
    times a canonical Int4Tensor: [M, N] in x's dtype. `tile` overrides gemm_tile."""
    y, grid, options = _gemm_launch(x2, n, group_size, bias, tile)
    if y.shape[0]:
        int4_gemm_kernel[grid](
            x2, qdata, scale, zero if zero is not None else scale, bias if bias is not None else y, y,
            y.shape[0], n, k, x2.stride(0), y.stride(0), qdata.stride(0), scale.stride(0),
            GROUP=group_size, HAS_ZERO=zero is not None, **options,
        )
    return y


def int4dq_gemm(x2: torch.Tensor, qdata: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor,
                tparams: torch.Tensor, lut: torch.Tensor, bias: torch.Tensor | None, group_size: int, n: int,
                k: int, tile=None) -> torch.Tensor:
    """[M, K] activations (unit stride along K) times a canonical Int4DQ weight (`lut`: the
    format's LUT on x's device): [M, N] in x's dtype. `tile` overrides gemm_tile."""
    y, grid, options = _gemm_launch(x2, n, group_size, bias, tile)
    if y.shape[0]:
        int4dq_gemm_kernel[grid](
            x2, qdata, gparams, rparams, tparams, lut, bias if bias is not None else y, y, y.shape[0], n, k,
            x2.stride(0), y.stride(0), qdata.stride(0), gparams.stride(0), rparams.stride(0),
            GROUP=group_size, **options,
        )
    return y


# ---------------------------------------------------------------------- dequantization (large M)
def store_weights_body(w_ptr, w_lo, w_hi, offs_n, offs_j, mask, K):
    """Decoded weights [BLOCK_N, BLOCK_K/2] at even and odd k into w [N, K] (values of w's dtype)."""
    w_at = w_ptr + offs_n[:, None] * K + offs_j[None, :] * 2
    tl.store(w_at, w_lo.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(w_at + 1, w_hi.to(w_ptr.dtype.element_ty), mask=mask)


store_weights = triton.jit(store_weights_body)


def int4_dequantize_body(q_ptr, s_ptr, z_ptr, w_ptr, N, K, stride_qn, stride_sn, GROUP: tl.constexpr,
                         HAS_ZERO: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A canonical Int4Tensor's [BLOCK_N, BLOCK_K] tile (axis 0 along N, axis 1 along K) as
    Int4Tensor.dequantize(w's dtype) gives it, bit for bit."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_j < K // 2)[None, :]
    b = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_j[None, :], mask=mask, other=0).to(tl.int32)
    grid = offs_n[:, None] * stride_sn + (offs_j[None, :] * 2) // GROUP
    s = tl.load(s_ptr + grid, mask=mask, other=0).to(tl.float32)
    z = s
    if HAS_ZERO:
        z = tl.load(z_ptr + grid, mask=mask, other=0).to(tl.float32)
    w_lo, w_hi = int4_decode(b, s, z, HAS_ZERO, ROUND)
    store_weights(w_ptr, w_lo, w_hi, offs_n, offs_j, mask, K)


int4_dequantize_kernel = triton.jit(int4_dequantize_body)


def int4dq_dequantize_body(q_ptr, g_ptr, r_ptr, t_ptr, lut_ptr, w_ptr, N, K, stride_qn, stride_gn, stride_rn,
                           GROUP: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A canonical Int4DQTensor's [BLOCK_N, BLOCK_K] tile as Int4DQTensor.dequantize(w's dtype)
    gives it, bit for bit."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_j = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    n_mask = offs_n < N
    mask = n_mask[:, None] & (offs_j < K // 2)[None, :]
    dlo, dstep, clo, cstep = int4dq_row_params(r_ptr, t_ptr, lut_ptr, offs_n, n_mask, stride_rn)
    b = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_j[None, :], mask=mask, other=0).to(tl.int32)
    gp = tl.load(g_ptr + offs_n[:, None] * stride_gn + (offs_j[None, :] * 2) // GROUP, mask=mask,
                 other=0).to(tl.int32)
    w_lo, w_hi = int4dq_decode(b, gp, dlo[:, None], dstep[:, None], clo[:, None], cstep[:, None], ROUND)
    store_weights(w_ptr, w_lo, w_hi, offs_n, offs_j, mask, K)


int4dq_dequantize_kernel = triton.jit(int4dq_dequantize_body)


def _dequantize_launch(n: int, k: int, dtype: torch.dtype, device):
    w = torch.empty(n, k, dtype=dtype, device=device)
    grid = (triton.cdiv(n, DEQUANT_BLOCK_N), triton.cdiv(k, DEQUANT_BLOCK_K))
    return w, grid, dict(ROUND=_ROUND[dtype], BLOCK_N=DEQUANT_BLOCK_N, BLOCK_K=DEQUANT_BLOCK_K, enable_fp_fusion=False)


def int4_dequantize(qdata, scale, zero, group_size: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A canonical Int4Tensor's weight [N, K] in `dtype`, in one pass (Int4Tensor.dequantize's)."""
    w, grid, options = _dequantize_launch(n, k, dtype, qdata.device)
    if w.numel():
        int4_dequantize_kernel[grid](qdata, scale, zero if zero is not None else scale, w, n, k, qdata.stride(0),
                                     scale.stride(0), GROUP=group_size, HAS_ZERO=zero is not None, **options)
    return w


def int4dq_dequantize(qdata, gparams, rparams, tparams, lut, group_size: int, n: int, k: int,
                      dtype: torch.dtype) -> torch.Tensor:
    """A canonical Int4DQTensor's weight [N, K] in `dtype`, in one pass (Int4DQTensor.dequantize's)."""
    w, grid, options = _dequantize_launch(n, k, dtype, qdata.device)
    if w.numel():
        int4dq_dequantize_kernel[grid](qdata, gparams, rparams, tparams, lut, w, n, k, qdata.stride(0),
                                       gparams.stride(0), rparams.stride(0), GROUP=group_size, **options)
    return w
