"""Triton kernels (imported only where triton is installed; see triton_kernels.py for their rows).

Each `*_body` is a plain function made into a kernel by `triton.jit` here; tests run the kernels
under TRITON_INTERPRET=1 (CPU tensors) and compile them for sm90 without a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N, BLOCK_K, NUM_WARPS = 64, 128, 4
# The int8 / float8 and Int4DQ GEMVs hold more a weight: at 64 x 128 and 4 warps ptxas spills
# 816-1184 bytes a thread on sm90; at 16 warps (128 registers, the block's register file) the
# Int4DQ one still spills with float32 activations. At 32 x 128 and 8 warps: 137-165 registers,
# no spills, and twice the programs along N (128 for N = 4096 on the H200's 132 SMs).
WIDE_BLOCK_N, WIDE_NUM_WARPS = 32, 8


def int4_gemv_body(x_ptr, q_ptr, s_ptr, z_ptr, b_ptr, y_ptr, N, K, stride_xm, stride_ym, stride_qn, stride_sn,
                   GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, HAS_BIAS: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row m (program axis 1) times BLOCK_N rows of an Int4Tensor in its canonical
    layout: qdata uint8 [N, K/2] (low nibble = even k), scale and zero [N, ceil(K/g)];
    w = (q - 8) * scale + zero, in float32, accumulated in float32."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte j holds k = 2j (low) and 2j + 1 (high)
        j_mask = offs_j < K // 2
        mask = n_mask[:, None] & j_mask[None, :]
        b = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_j[None, :], mask=mask, other=0).to(tl.int32)
        lo = (b & 15).to(tl.float32) - 8.0
        hi = ((b >> 4) & 15).to(tl.float32) - 8.0
        grid = offs_n[:, None] * stride_sn + (offs_j[None, :] * 2) // GROUP
        s = tl.load(s_ptr + grid, mask=mask, other=0).to(tl.float32)
        w_lo = lo * s
        w_hi = hi * s
        if HAS_ZERO:
            z = tl.load(z_ptr + grid, mask=mask, other=0).to(tl.float32)
            w_lo = w_lo + z
            w_hi = w_hi + z
        xe = tl.load(x_ptr + m * stride_xm + offs_j * 2, mask=j_mask, other=0).to(tl.float32)
        xo = tl.load(x_ptr + m * stride_xm + offs_j * 2 + 1, mask=j_mask, other=0).to(tl.float32)
        acc += tl.sum(w_lo * xe[None, :] + w_hi * xo[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


int4_gemv_kernel = triton.jit(int4_gemv_body)


def int4_gemv(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
              bias: torch.Tensor | None, group_size: int, n: int, k: int, kernel=None) -> torch.Tensor:
    """[M, K] activations (any float dtype, unit stride along K) times the canonical int4 weight:
    [M, N] in x's dtype. `kernel` overrides the jitted kernel (tests: the interpreter's)."""
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    grid = (triton.cdiv(n, BLOCK_N), m)
    (kernel or int4_gemv_kernel)[grid](
        x2, qdata, scale, zero if zero is not None else scale, bias if bias is not None else scale, y,
        n, k, x2.stride(0), y.stride(0), qdata.stride(0), scale.stride(0),
        GROUP=group_size, HAS_ZERO=zero is not None, HAS_BIAS=bias is not None,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=NUM_WARPS,
    )
    return y


def int4dq_gemv_body(x_ptr, q_ptr, g_ptr, r_ptr, t_ptr, lut_ptr, b_ptr, y_ptr, w_ptr, N, K, stride_xm, stride_ym,
                     stride_qn, stride_gn, stride_rn, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
                     WRITE_W: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row m times BLOCK_N rows of an Int4DQTensor in its canonical layout (qdata
    uint8 [N, K/2], gparams uint8 [N, G], rparams uint8 [N, 4], tparams float32 [2]; lut_ptr: the
    format's 32 float32 mantissas). Each weight is decoded as Int4DQTensor.dequantize does, one
    float32 operation at a time in the same order (launch with enable_fp_fusion=False so that no
    multiply and add become one FMA), rounded to x's dtype as the reference's dequantize(x.dtype)
    is (ROUND: 1 float16, 2 bfloat16, 0 float32), then multiplied and accumulated in float32.
    WRITE_W (tests): also store the decoded weights, in x's dtype, into w_ptr [N, K]."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    dlo, dstep, clo, cstep = int4dq_row_params(r_ptr, t_ptr, lut_ptr, offs_n, n_mask, stride_rn)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte j holds k = 2j (low) and 2j + 1 (high)
        j_mask = offs_j < K // 2
        mask = n_mask[:, None] & j_mask[None, :]
        b = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_j[None, :], mask=mask, other=0).to(tl.int32)
        gp = tl.load(g_ptr + offs_n[:, None] * stride_gn + (offs_j[None, :] * 2) // GROUP, mask=mask,
                     other=0).to(tl.int32)
        w_lo, w_hi = int4dq_decode(b, gp, dlo[:, None], dstep[:, None], clo[:, None], cstep[:, None], ROUND)
        if WRITE_W:
            w_at = w_ptr + offs_n[:, None] * K + offs_j[None, :] * 2
            tl.store(w_at, w_lo.to(w_ptr.dtype.element_ty), mask=mask)  # exact: already rounded
            tl.store(w_at + 1, w_hi.to(w_ptr.dtype.element_ty), mask=mask)
        xe = tl.load(x_ptr + m * stride_xm + offs_j * 2, mask=j_mask, other=0).to(tl.float32)
        xo = tl.load(x_ptr + m * stride_xm + offs_j * 2 + 1, mask=j_mask, other=0).to(tl.float32)
        acc += tl.sum(w_lo * xe[None, :] + w_hi * xo[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


int4dq_gemv_kernel = triton.jit(int4dq_gemv_body)


def int4dq_row_params_body(r_ptr, t_ptr, lut_ptr, offs_n, n_mask, stride_rn):
    """Rows offs_n of an Int4DQTensor: (dlo, dstep, clo, cstep), float32 [BLOCK_N], as
    Int4DQTensor.group_grid computes them, one float32 operation at a time."""
    t_d = tl.load(t_ptr)
    t_c = tl.load(t_ptr + 1)
    # Row parameters: code k is the mantissa LUT[k % 32] (LUT[2 * (m % 16)] for a centre) times
    # 2^-e, e = k // 32 (m // 16) <= 7; that power of two is built from its bits, exactly.
    kd_lo = tl.load(r_ptr + offs_n * stride_rn, mask=n_mask, other=0).to(tl.int32)
    kd_hi = tl.load(r_ptr + offs_n * stride_rn + 1, mask=n_mask, other=0).to(tl.int32)
    kc_lo = tl.load(r_ptr + offs_n * stride_rn + 2, mask=n_mask, other=0).to(tl.int32)
    kc_hi = tl.load(r_ptr + offs_n * stride_rn + 3, mask=n_mask, other=0).to(tl.int32)
    dlo = (t_d * tl.load(lut_ptr + kd_lo % 32)) * ((127 - kd_lo // 32) << 23).to(tl.float32, bitcast=True)
    dlo = tl.where(kd_lo == 255, 0.0, dlo)
    dhi = (t_d * tl.load(lut_ptr + kd_hi % 32)) * ((127 - kd_hi // 32) << 23).to(tl.float32, bitcast=True)
    dhi = tl.where(kd_hi == 255, 0.0, dhi)
    mc_lo = kc_lo & 127
    clo = (t_c * tl.load(lut_ptr + 2 * (mc_lo % 16))) * ((127 - mc_lo // 16) << 23).to(tl.float32, bitcast=True)
    clo = tl.where(mc_lo == 127, 0.0, tl.where((kc_lo >> 7) == 1, -clo, clo))
    mc_hi = kc_hi & 127
    chi = (t_c * tl.load(lut_ptr + 2 * (mc_hi % 16))) * ((127 - mc_hi // 16) << 23).to(tl.float32, bitcast=True)
    chi = tl.where(mc_hi == 127, 0.0, tl.where((kc_hi >> 7) == 1, -chi, chi))
    # div_rn: correctly rounded division (as torch's); Triton's `/` may be approximate on GPUs.
    dstep = tl.math.div_rn(dhi - dlo, 15.0)
    cstep = tl.math.div_rn(chi - clo, 15.0)
    return dlo, dstep, clo, cstep


int4dq_row_params = triton.jit(int4dq_row_params_body)


def int4dq_decode_body(b, gp, dlo, dstep, clo, cstep, ROUND: tl.constexpr):
    """Int4DQ weights (float32, rounded to x's dtype as `round_to` does) of code bytes b (int32:
    low nibble = even k) in groups with parameter bytes gp, the row parameters broadcast to them:
    (w at even k, w at odd k). (q - 7.5) * d + c: launch with enable_fp_fusion=False."""
    d = dlo + (gp & 15).to(tl.float32) * dstep
    c = clo + ((gp >> 4) & 15).to(tl.float32) * cstep
    w_lo = round_to(((b & 15).to(tl.float32) - 7.5) * d + c, ROUND)
    w_hi = round_to((((b >> 4) & 15).to(tl.float32) - 7.5) * d + c, ROUND)
    return w_lo, w_hi


int4dq_decode = triton.jit(int4dq_decode_body)


def round_to_body(w, ROUND: tl.constexpr):
    """float32 w rounded to x's dtype (ROUND: 1 float16, 2 bfloat16, 0 float32: unchanged), to
    nearest even, as float32."""
    if ROUND == 1:
        w = w.to(tl.float16).to(tl.float32)
    if ROUND == 2:
        w = bf16_rne(w)
    return w


round_to = triton.jit(round_to_body)
_ROUND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def int4dq_gemv(x2: torch.Tensor, qdata: torch.Tensor, gparams: torch.Tensor, rparams: torch.Tensor,
                tparams: torch.Tensor, lut: torch.Tensor, bias: torch.Tensor | None, group_size: int, n: int,
                k: int, kernel=None, decoded: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] activations (unit stride along K) times a canonical Int4DQ weight (`lut`: the
    format's LUT on x's device): [M, N] in x's dtype. `kernel` overrides the jitted kernel;
    `decoded` (tests), a contiguous [N, K] tensor in x's dtype, receives the decoded weights."""
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    (kernel or int4dq_gemv_kernel)[(triton.cdiv(n, WIDE_BLOCK_N), m)](
        x2, qdata, gparams, rparams, tparams, lut, bias if bias is not None else y, y,
        decoded if decoded is not None else y, n, k, x2.stride(0), y.stride(0), qdata.stride(0), gparams.stride(0),
        rparams.stride(0), GROUP=group_size, HAS_BIAS=bias is not None, WRITE_W=decoded is not None,
        ROUND=_ROUND[x2.dtype], BLOCK_N=WIDE_BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=WIDE_NUM_WARPS, enable_fp_fusion=False,
    )
    return y


def scaled_gemv_body(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, N, K, GROUP, stride_xm, stride_ym, stride_qn, stride_sn,
                     HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One activation row m times BLOCK_N rows of int8 or float8 codes q [N, K] with
    w = q * scale[n, k // GROUP] (GROUP = K and stride_sn = 0: one scale for the tensor)."""
    pid_n = tl.program_id(0)
    m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = n_mask[:, None] & k_mask[None, :]
        q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :], mask=mask).to(tl.float32)
        q = tl.where(mask, q, 0.0)  # no `other`: float8 has no literal zero in every Triton backend
        s = tl.load(s_ptr + offs_n[:, None] * stride_sn + offs_k[None, :] // GROUP, mask=mask, other=0).to(tl.float32)
        x = tl.load(x_ptr + m * stride_xm + offs_k, mask=k_mask, other=0).to(tl.float32)
        acc += tl.sum(q * s * x[None, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0).to(tl.float32)
    tl.store(y_ptr + m * stride_ym + offs_n, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


scaled_gemv_kernel = triton.jit(scaled_gemv_body)


def scaled_gemv(x2: torch.Tensor, qdata: torch.Tensor, scale: torch.Tensor, group_size: int,
                bias: torch.Tensor | None) -> torch.Tensor:
    """[M, K] activations times int8 / float8 codes [N, K] (unit stride along K) scaled per row,
    per group of `group_size` along K, or per tensor (a [1, 1] scale): [M, N] in x's dtype."""
    m, k = x2.shape
    n = qdata.shape[0]
    y = torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0:
        return y
    per_tensor = scale.numel() == 1
    scaled_gemv_kernel[(triton.cdiv(n, WIDE_BLOCK_N), m)](
        x2, qdata, scale, bias if bias is not None else scale, y, n, k, k if per_tensor else group_size,
        x2.stride(0), y.stride(0), qdata.stride(0), 0 if per_tensor else scale.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=WIDE_BLOCK_N, BLOCK_K=BLOCK_K, num_warps=WIDE_NUM_WARPS,
    )
    return y


def quantize_rows_int8_body(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr):
    """One row m of x: scale = max(amax / 127, 1e-12) and codes round(x / scale) clamped to
    [-127, 127], rounding half to even, in float32: common.quantize_int8_per_token, bit for bit."""
    m = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    # div_rn: correctly rounded division (as torch's); Triton's `/` may be approximate on GPUs.
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), 127.0), 1e-12)
    tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        v = tl.math.div_rn(tl.load(x_ptr + m * stride_xm + offs, mask=mask, other=0).to(tl.float32), scale)
        v = (v + 12582912.0) - 12582912.0  # 1.5 * 2^23: rounds |v| < 2^22 to the nearest even integer
        v = tl.minimum(tl.maximum(v, -127.0), 127.0)
        tl.store(q_ptr + m * stride_qm + offs, v.to(tl.int8), mask=mask)


quantize_rows_int8_kernel = triton.jit(quantize_rows_int8_body)
QUANT_BLOCK_K = 1024


def quantize_rows_int8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes [M, K] and float32 scales [M, 1] of a 2-D activation with unit stride along K,
    in one kernel (the torch version is eight)."""
    m, k = x2.shape
    codes = torch.empty(m, k, dtype=torch.int8, device=x2.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x2.device)
    if m:
        quantize_rows_int8_kernel[(m,)](x2, codes, scale, k, x2.stride(0), codes.stride(0), BLOCK_K=QUANT_BLOCK_K)
    return codes, scale


# ---------------------------------------------------------------------- float8 (e4m3) activations
E4M3_MAX = tl.constexpr(448.0)  # the largest e4m3fn value


def e4m3_code_body(v):
    """float32 -> the e4m3fn code (int32 in [0, 255]) torch's `v.clamp(-448, 448).to(float8_e4m3fn)`
    gives, from the bits: round to nearest even, saturation at +-448, NaN -> 0x7F with its sign,
    -0 -> 0x80. Neither the interpreter's cast nor every GPU's is trusted (see tests)."""
    u = v.to(tl.int32, bitcast=True)
    sign = (u >> 31) & 1
    a = u & 0x7FFFFFFF
    # Normal results (|v| >= 2^-6): rebias the exponent (127 -> 7), keep 3 mantissa bits, and
    # round on the 20 dropped ones, ties to the even code; a carry moves into the exponent.
    normal = (a - (120 << 23) + 0x7FFFF + ((a >> 20) & 1)) >> 20
    # Subnormal results: |v| / 2^-9 = mant * 2^(e - 141) (e <= 120), rounded to nearest even.
    e = a >> 23
    mant = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = tl.minimum(141 - e, 31)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)
    code = tl.where(a >= 0x3C800000, normal, sub)
    code = tl.where(a >= 0x43E00000, 0x7E, code)  # 448 and beyond (inf too): saturate
    code = tl.where(a > 0x7F800000, 0x7F, code)  # NaN
    return code | (sign << 7)


e4m3_code = triton.jit(e4m3_code_body)


def e4m3_value_body(code):
    """The float32 value of an e4m3fn code (int32; not NaN), exactly."""
    e = (code >> 3) & 15
    mm = code & 7
    normal = (((code >> 7) << 31) | ((e + 120) << 23) | (mm << 20)).to(tl.float32, bitcast=True)
    sub = mm.to(tl.float32) * 0.001953125  # 2^-9
    sub = tl.where((code >> 7) == 1, -sub, sub)
    return tl.where(e == 0, sub, normal)


e4m3_value = triton.jit(e4m3_value_body)


def bf16_rne_body(v):
    """float32 rounded to the nearest bfloat16 (ties to even), as float32; finite v. The
    interpreter's cast to bfloat16 truncates."""
    u = v.to(tl.uint32, bitcast=True)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)


bf16_rne = triton.jit(bf16_rne_body)


def quantize_rows_fp8_body(x_ptr, q_ptr, s_ptr, f_ptr, K, stride_xm, stride_qm, stride_fm,
                           CODES: tl.constexpr, FAKE: tl.constexpr, ROUND: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row m of x: scale = max(amax / 448, 1e-12) and codes e4m3(clamp(x / scale, +-448)) in
    float32, as Float8Tensor's per-row path (tensors/float8.quantize_input_float8), bit for bit.
    CODES: store the codes (uint8) into q_ptr and the scale into s_ptr. FAKE: store
    code * scale rounded to x's dtype (ROUND as int4dq's: 1 float16, 2 bfloat16) into f_ptr, as
    simulate_input_quantization does."""
    m = tl.program_id(0)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < K, other=0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), E4M3_MAX), 1e-12)
    if CODES:
        tl.store(s_ptr + m, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        v = tl.math.div_rn(tl.load(x_ptr + m * stride_xm + offs, mask=mask, other=0).to(tl.float32), scale)
        code = e4m3_code(v)
        if CODES:
            tl.store(q_ptr + m * stride_qm + offs, code.to(tl.uint8), mask=mask)
        if FAKE:
            f = round_to(e4m3_value(code) * scale, ROUND)
            tl.store(f_ptr + m * stride_fm + offs, f.to(f_ptr.dtype.element_ty), mask=mask)


quantize_rows_fp8_kernel = triton.jit(quantize_rows_fp8_body)


def quantize_rows_fp8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn codes [M, K] and float32 scales [M, 1] of a 2-D activation with unit stride
    along K, in one kernel: quantize_input_float8(x2, "per_row", float8_e4m3fn), bit for bit."""
    m, k = x2.shape
    codes = torch.empty(m, k, dtype=torch.uint8, device=x2.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x2.device)
    if m:
        quantize_rows_fp8_kernel[(m,)](x2, codes, scale, codes, k, x2.stride(0), codes.stride(0), 0,
                                       CODES=True, FAKE=False, ROUND=0, BLOCK_K=QUANT_BLOCK_K)
    return codes.view(torch.float8_e4m3fn), scale


def fake_quantize_rows_fp8(x2: torch.Tensor) -> torch.Tensor:
    """x2 quantized to e4m3 per row and back, in x2's dtype: (codes.float() * scale).to(x2.dtype)
    of quantize_rows_fp8, bit for bit, without writing the codes."""
    m, k = x2.shape
    out = torch.empty(m, k, dtype=x2.dtype, device=x2.device)
    if m:
        quantize_rows_fp8_kernel[(m,)](x2, out, out, out, k, x2.stride(0), 0, out.stride(0),
                                       CODES=False, FAKE=True, ROUND=_ROUND[x2.dtype], BLOCK_K=QUANT_BLOCK_K)
    return out
