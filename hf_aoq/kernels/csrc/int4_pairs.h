// The int4 kernels on hf_aoq's CPU "pairs" layout, shared by Int4Tensor (int4.cpp) and
// Int4DQTensor (int4dq.cpp): templates over a parameter provider P (below), so that each format
// supplies only its per-group scale and zero.
//
// aten's kernels for these formats are built for bf16 activations and are compute-bound:
// `_weight_int4pack_mm_for_cpu` takes about 3x the time the weight bytes need at batch 1, and
// both it and `_weight_int8pack_mm` are 10-30x slower again with float32 activations, or at a
// few hundred rows (prefill), than a float32 GEMM. Here:
//   int4 weights, half-precision (bf16, fp16) activations, any number of rows: the activations
//              become int16 codes per row and group (quantize_rows16) and meet the int4 codes in
//              integer multiply-adds (vpmaddwd: 16 products per instruction, no conversion of
//              the codes to float), streaming the weight once per one or two activation rows.
//              1.8x the float32 GEMV's speed in decode, and faster than dequantize + float32
//              GEMM up to at least 1024 rows (1.3-1.5x). Each activation is off by at most
//              1/65534 of its group's largest |x|, 128x below the rounding of each weight to the
//              activation dtype that the reference (dequantize, then F.linear in that dtype)
//              does. The integer sums are exact, so a row's result does not depend on the rows
//              computed with it.
//   few rows otherwise (float32 activations): each weight row block is read once and dotted
//              with every activation row in float32 (a GEMV that streams the weight).
//   many rows otherwise: chunks of the weight are dequantized exactly as the reference does it
//              and multiplied by float32 GEMM (dequant_gemm.h); nothing is cached.
//
// Int4 weights are read in hf_aoq's CPU "pairs" layout (int4_repack_pairs), made for the
// integer multiply-add over column pairs. Per block of 32 output rows n0..n0+31 and per column
// pair (2j, 2j+1): 32 bytes, read as 16-bit words; word 2i (column 2j) and word 2i+1 (column
// 2j+1), i = 0..7, hold in nibble t (bits 4t..4t+3) the code of row n0 + 8t + i. So one 32-bit
// lane holds one row's two codes, and shifting and masking the words yields rows 8t..8t+7 of
// both columns at once. A last block of 16 rows holds 16 bytes per column pair: words 2i, 2i+1
// for i = 0..3, nibble t: row n0 + 4t + i. int4_repack_pairs (int4.cpp) makes the layout.
//
// Internal linkage (an anonymous namespace), as in every header here: each translation unit
// gets its own copy, compiled with that unit's instruction-set flags.
#pragma once
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "dequant_gemm.h"
#include "int16_rows.h"  // Int16Rows, quantize_rows16: the activations as int16 codes
#include "int4_pairs512.h"  // the AVX-512 build's 64-row step of int4_linear_codes

namespace {

constexpr int64_t BLOCK_N = 32;

// Per-(group, row-block) parameters of the int4 kernels: a provider fills s[r] and z[r] for rows
// [n0, n0 + rows) of group g, and the weight is (q - P::offset) * s + z. The GEMV folds the
// offset into zc = z - offset * s.

// Code of row r (0..rows-1) at column k inside a block whose bytes start at `blk`.
inline int code_at(const uint8_t* blk, int64_t rows, int64_t k, int64_t r) {
  const int64_t lanes = rows / 4, i = r % lanes, t = r / lanes;
  const uint8_t b = blk[(k >> 1) * rows + 2 * (2 * i + (k & 1)) + (t >> 1)];
  return (t & 1) ? (b >> 4) : (b & 15);
}

#if defined(__AVX2__)
// The 64 codes of one column pair of a full block as float32: e[t] rows 8t..8t+7 of the even
// column, o[t] of the odd one.
inline void codes64(const uint8_t* p, __m256* e, __m256* o) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i mask = _mm256_set1_epi32(15);
  e[0] = _mm256_cvtepi32_ps(_mm256_and_si256(b, mask));
  e[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 4), mask));
  e[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 8), mask));
  e[3] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 12), mask));
  o[0] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 16), mask));
  o[1] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 20), mask));
  o[2] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(b, 24), mask));
  o[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 28));
}

// out[i][0..31] += sum over the group of x[i][k] * code(k), for MB activation rows.
template <int MB>
inline void int4_group_dot(const uint8_t* blk, const float* const* xs, int64_t k0, int64_t k1, float (*acc_out)[BLOCK_N]) {
  __m256 acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2) {
    __m256 e[4], o[4];
    codes64(blk + k * 16, e, o);
    for (int i = 0; i < MB; ++i) {
      const __m256 xa = _mm256_broadcast_ss(xs[i] + k), xb = _mm256_broadcast_ss(xs[i] + k + 1);
      for (int j = 0; j < 4; ++j) acc[i][j] = _mm256_fmadd_ps(xb, o[j], _mm256_fmadd_ps(xa, e[j], acc[i][j]));
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc_out[i] + 8 * j, acc[i][j]);
}

// One activation row: even and odd k accumulate separately, so that eight independent FMA
// chains hide the FMA latency (four would leave the loop latency-bound). sums[j]: rows 8j..8j+7.
// Always inlined: int4_block_gemv1 needs `sums` in registers (not inlined there, Int4DQ's GEMV
// took 1.5x the time).
__attribute__((always_inline)) inline void int4_group_sums1(const uint8_t* blk, const float* x, int64_t k0, int64_t k1, __m256* sums) {
  __m256 a[4], b[4];
  for (int j = 0; j < 4; ++j) a[j] = b[j] = _mm256_setzero_ps();
  for (int64_t k = k0; k < k1; k += 2) {
    __m256 e[4], o[4];
    codes64(blk + k * 16, e, o);
    const __m256 xa = _mm256_broadcast_ss(x + k), xb = _mm256_broadcast_ss(x + k + 1);
    for (int j = 0; j < 4; ++j) {
      a[j] = _mm256_fmadd_ps(xa, e[j], a[j]);
      b[j] = _mm256_fmadd_ps(xb, o[j], b[j]);
    }
  }
  for (int j = 0; j < 4; ++j) sums[j] = _mm256_add_ps(a[j], b[j]);
}

inline void int4_group_dot1(const uint8_t* blk, const float* x, int64_t k0, int64_t k1, float* acc_out) {
  __m256 sums[4];
  int4_group_sums1(blk, x, k0, k1, sums);
  for (int j = 0; j < 4; ++j) _mm256_storeu_ps(acc_out + 8 * j, sums[j]);
}
#endif

#if defined(__AVX2__)
// One activation row, one full block of 32 rows: int4_group_sums1 per group with the group's
// epilogue (out += s * acc + (z - offset * s) * xsum, the same operations as the general loop
// in int4_gemv) kept in registers: no accumulator, offset or output round trips through memory,
// which cost a quarter of the time at groups of 32.
template <class P>
inline void int4_block_gemv1(const uint8_t* blk, const float* x, const float* xsum, const P& params, int64_t G,
                             int64_t gs, int64_t n0, float* y) {
  __m256 o[4];
  for (int j = 0; j < 4; ++j) o[j] = _mm256_setzero_ps();
  alignas(32) float s[BLOCK_N], z[BLOCK_N];
  const __m256 off = _mm256_set1_ps(P::offset);
  for (int64_t g = 0; g < G; ++g) {
    __m256 sums[4];
    int4_group_sums1(blk, x, g * gs, (g + 1) * gs, sums);
    params(g, n0, BLOCK_N, s, z);
    const __m256 xv = _mm256_set1_ps(xsum[g]);
    for (int j = 0; j < 4; ++j) {
      const __m256 sv = _mm256_load_ps(s + 8 * j);
      const __m256 zc = _mm256_sub_ps(_mm256_load_ps(z + 8 * j), _mm256_mul_ps(off, sv));
      const __m256 t = _mm256_add_ps(_mm256_mul_ps(sv, sums[j]), _mm256_mul_ps(zc, xv));
      o[j] = _mm256_add_ps(o[j], t);
    }
  }
  for (int j = 0; j < 4; ++j) _mm256_storeu_ps(y + 8 * j, o[j]);
}
#endif

template <class P>
void int4_gemv(const float* x, const uint8_t* w, const P& params, float* y, int64_t M, int64_t N, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  // Per activation row and group, the sum of x: it carries the (z - offset * s) term.
  std::vector<float> xsum(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k) s += x[m * K + k];
      xsum[m * G + g] = s;
    }
  const int64_t NB = (N + BLOCK_N - 1) / BLOCK_N;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> out(M * BLOCK_N);
    float s[BLOCK_N], zc[BLOCK_N], acc[2][BLOCK_N];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK_N, rows = std::min(BLOCK_N, N - n0);
      const uint8_t* blk = w + n0 * K / 2;
#if defined(__AVX2__)
      if (M == 1 && rows == BLOCK_N) {
        int4_block_gemv1(blk, x, xsum.data(), params, G, gs, n0, y + n0);
        continue;
      }
#endif
      std::fill(out.begin(), out.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        params(g, n0, rows, s, zc);
        for (int64_t r = 0; r < rows; ++r) zc[r] = zc[r] - P::offset * s[r];  // vectorized by the compiler
        const int64_t k0 = g * gs, k1 = k0 + gs;
        for (int64_t m0 = 0; m0 < M; m0 += 2) {
          const int mb = static_cast<int>(std::min<int64_t>(2, M - m0));
          const float* xs[2] = {x + m0 * K, x + std::min(m0 + 1, M - 1) * K};
#if defined(__AVX2__)
          if (rows == BLOCK_N) {
            if (mb == 2) int4_group_dot<2>(blk, xs, k0, k1, acc);
            else int4_group_dot1(blk, xs[0], k0, k1, acc[0]);
          } else
#endif
          {
            for (int i = 0; i < mb; ++i)
              for (int64_t r = 0; r < rows; ++r) {
                float a = 0.f;
                for (int64_t k = k0; k < k1; ++k) a += xs[i][k] * float(code_at(blk, rows, k, r));
                acc[i][r] = a;
              }
          }
          for (int i = 0; i < mb; ++i) {
            const float xsg = xsum[(m0 + i) * G + g];
            float* o = out.data() + (m0 + i) * BLOCK_N;
#if defined(__AVX2__)
            if (rows == BLOCK_N) {  // the same operations as below, eight rows at a time
              const __m256 xv = _mm256_set1_ps(xsg);
              for (int j = 0; j < 4; ++j) {
                const __m256 t = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(s + 8 * j), _mm256_loadu_ps(acc[i] + 8 * j)),
                                               _mm256_mul_ps(_mm256_loadu_ps(zc + 8 * j), xv));
                _mm256_storeu_ps(o + 8 * j, _mm256_add_ps(_mm256_loadu_ps(o + 8 * j), t));
              }
              continue;
            }
#endif
            for (int64_t r = 0; r < rows; ++r) o[r] += s[r] * acc[i][r] + zc[r] * xsg;
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, out.data() + m * BLOCK_N, rows * sizeof(float));
    }
  });
}

// acc + the pairwise products of int16 lanes (vpmaddwd, then vpaddd): one AVX-512 VNNI vpdpwssd
// where the build has it. The same int32 sums either way (neither saturates, and the products of
// int4 codes and int16 activation codes never reach the one pair, -32768 * -32768 twice, where
// vpmaddwd wraps), so both builds give the same outputs bit for bit.
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HF_AOQ_VNNI 1
#else
#define HF_AOQ_VNNI 0
#endif
#if defined(__AVX2__)
inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if HF_AOQ_VNNI
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}
#endif

// Groups of up to this many columns keep an int32 sum of code products exact: each 32-bit lane
// of vpmaddwd adds two products of at most 15 * 32767, and gs / 2 of those stay below 2^31.
constexpr int64_t kMaxInt16Group = 4096;

#if defined(__AVX2__)
// acc[i][t] (int32, rows 8t..8t+7) = sum over column pairs [j0, j1) of a full block of the
// int4 codes times activation row ms[i]'s int16 codes. One row: two column pairs per iteration,
// their products added before the accumulator (5-11% faster than accumulating each); two rows:
// one pair. pf: prefetch the codes ahead (int4_pairs512.h's kInt4Prefetch; the first of the
// activation rows that read these codes).
template <int MB>
__attribute__((always_inline)) inline void int4_group_isums(const uint8_t* blk, const Int16Rows& xq, const int64_t* ms,
                                                            int64_t K, int64_t j0, int64_t j1, __m256i (*acc)[4],
                                                            bool pf) {
  const __m256i m4 = _mm256_set1_epi16(15);
  __m256i a[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int t = 0; t < 4; ++t) a[i][t] = _mm256_setzero_si256();
  auto codes = [&](const uint8_t* p, __m256i* q) {  // rows 8t..8t+7 of the pair as int16 pairs
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    q[0] = _mm256_and_si256(b, m4);
    q[1] = _mm256_and_si256(_mm256_srli_epi16(b, 4), m4);
    q[2] = _mm256_and_si256(_mm256_srli_epi16(b, 8), m4);
    q[3] = _mm256_srli_epi16(b, 12);
  };
  int64_t j = j0;
  if (MB == 1) {
#if HF_AOQ_VNNI
    __m256i b[4];  // the second pair's chains: two dependent vpdpwssd per chain were latency-bound
    for (int t = 0; t < 4; ++t) b[t] = _mm256_setzero_si256();
#endif
    for (; j + 2 <= j1; j += 2) {
      int4_prefetch(blk + j * 32 + kInt4Prefetch);
      __m256i q[4], r[4];
      codes(blk + j * 32, q);
      codes(blk + j * 32 + 32, r);
      const __m256i xa = _mm256_set1_epi32(xq.pair(ms[0], K, 2 * j));
      const __m256i xb = _mm256_set1_epi32(xq.pair(ms[0], K, 2 * j + 2));
      for (int t = 0; t < 4; ++t) {
#if HF_AOQ_VNNI
        a[0][t] = _mm256_dpwssd_epi32(a[0][t], q[t], xa);
        b[t] = _mm256_dpwssd_epi32(b[t], r[t], xb);
#else
        a[0][t] = _mm256_add_epi32(a[0][t], _mm256_add_epi32(_mm256_madd_epi16(q[t], xa), _mm256_madd_epi16(r[t], xb)));
#endif
      }
    }
#if HF_AOQ_VNNI
    for (int t = 0; t < 4; ++t) a[0][t] = _mm256_add_epi32(a[0][t], b[t]);
#endif
  }
  for (; j < j1; ++j) {
    if (pf && (j & 1) == 0) int4_prefetch(blk + j * 32 + kInt4Prefetch);  // a 64-byte line per two pairs
    __m256i q[4];
    codes(blk + j * 32, q);
    for (int i = 0; i < MB; ++i) {
      const __m256i xa = _mm256_set1_epi32(xq.pair(ms[i], K, 2 * j));
      for (int t = 0; t < 4; ++t) a[i][t] = madd_acc(a[i][t], q[t], xa);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int t = 0; t < 4; ++t) acc[i][t] = a[i][t];
}

// out[t] += (s * sx) * acc[t] + (z - offset * s) * xs for rows 8t..8t+7: one group's share.
template <class P>
__attribute__((always_inline)) inline void int4_epilogue16(const float* s, const float* z, float sx, float xs,
                                                           const __m256i* acc, __m256* out) {
  const __m256 off = _mm256_set1_ps(P::offset), sxv = _mm256_set1_ps(sx), xsv = _mm256_set1_ps(xs);
  for (int t = 0; t < 4; ++t) {
    const __m256 sv = _mm256_load_ps(s + 8 * t);
    const __m256 zc = _mm256_sub_ps(_mm256_load_ps(z + 8 * t), _mm256_mul_ps(off, sv));
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(sv, sxv), _mm256_cvtepi32_ps(acc[t])), _mm256_mul_ps(zc, xsv));
    out[t] = _mm256_add_ps(out[t], v);
  }
}
#endif

// The epilogue of the affine providers (P::kAffine: Int4DQ, whose group scale and centre are
// d = dlo + a * dstep and c = clo + b * cstep, a and b the group's 4-bit indices, dlo, dstep,
// clo and cstep per row). Over a row's groups the integer GEMV sums, per output,
//   u = sx * acc - offset * xs (one fused multiply-add), U += u, AU += a * u, BX += b * xs
// (both fused), and ends with y = dlo * U + dstep * AU + clo * XS + cstep * BX (a multiply, then
// three fused multiply-adds in that order), XS the activation row's xs summed over its groups in
// order: the sum over groups of d * (sx * acc) + (c - offset * d) * xs, with each row's
// parameters applied once instead of making d and c per group (a quarter of the batch-1 GEMV's
// instructions at groups of 32). Every step (64-row, 32-row, the 16-row tail's scalar code) does
// these operations in this order, so an output's bits depend neither on the step nor on the build.
inline float int4_row_xsum(const Int16Rows& xq, int64_t m, int64_t G) {
  float s = 0.f;
  for (int64_t g = 0; g < G; ++g) s += xq.xs[m * G + g];
  return s;
}

// One output's group (scalar).
inline void int4_affine_group1(float a, float b, float sx, float xs, float offset, int32_t acc, float* sums, int64_t ld) {
  const float u = std::fma(sx, static_cast<float>(acc), -(offset * xs));
  sums[0] = sums[0] + u;
  sums[ld] = std::fma(a, u, sums[ld]);
  sums[2 * ld] = std::fma(b, xs, sums[2 * ld]);
}

template <class P>
inline float int4_affine_out(const P& p, int64_t n, float XS, float U, float AU, float BX) {
  return std::fma(p.cstep[n], BX, std::fma(p.clo[n], XS, std::fma(p.dstep[n], AU, p.dlo[n] * U)));
}

#if defined(__AVX2__)
// A group of rows 8t..8t+7 of a full block into the sums (a, b: the rows' indices as float32).
__attribute__((always_inline)) inline void int4_affine_group16(const float* a, const float* b, float sx, float xs,
                                                               float offset, const __m256i* acc, __m256* U, __m256* AU,
                                                               __m256* BX) {
  const __m256 sxv = _mm256_set1_ps(sx), xsv = _mm256_set1_ps(xs), nxo = _mm256_set1_ps(-(offset * xs));
  for (int t = 0; t < 4; ++t) {
    const __m256 u = _mm256_fmadd_ps(sxv, _mm256_cvtepi32_ps(acc[t]), nxo);
    U[t] = _mm256_add_ps(U[t], u);
    AU[t] = _mm256_fmadd_ps(_mm256_load_ps(a + 8 * t), u, AU[t]);
    BX[t] = _mm256_fmadd_ps(_mm256_load_ps(b + 8 * t), xsv, BX[t]);
  }
}

template <class P>
inline void int4_affine_store16(const P& p, int64_t n0, float XS, const __m256* U, const __m256* AU, const __m256* BX,
                                float* y) {
  const __m256 xsv = _mm256_set1_ps(XS);
  for (int t = 0; t < 4; ++t) {
    const int64_t n = n0 + 8 * t;
    __m256 v = _mm256_mul_ps(_mm256_loadu_ps(p.dlo + n), U[t]);
    v = _mm256_fmadd_ps(_mm256_loadu_ps(p.dstep + n), AU[t], v);
    v = _mm256_fmadd_ps(_mm256_loadu_ps(p.clo + n), xsv, v);
    _mm256_storeu_ps(y + 8 * t, _mm256_fmadd_ps(_mm256_loadu_ps(p.cstep + n), BX[t], v));
  }
}
#endif

// y = x W^T for activations given as int16 codes (xq: from quantize_rows16, or an
// activation-quantized weight's int8 codes, int8_int4.cpp). Per block of 32 weight rows, group
// and activation row: an exact int32 sum of code products, then the group's float32 epilogue as
// the vector code computes it (the scalar code for a 16-row tail block does the same operations).
template <class P>
void int4_linear_codes(const Int16Rows& xq, const uint8_t* w, const P& params, float* y, int64_t M, int64_t N,
                       int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  const int64_t NB = (N + BLOCK_N - 1) / BLOCK_N;
  // Blocks per unit of work: two full ones at a time in the AVX-512 build (int4_pairs512.h).
  constexpr int64_t step = HF_AOQ_INT4_512 ? 2 : 1;
  // P::kAffine: the activation rows' xs summed over their groups, and per output three sums
  // (U, AU, BX: `out` holds them [M][3][rows]) instead of one.
  constexpr int64_t R = P::kAffine ? 3 : 1;
  std::vector<float> XS(P::kAffine ? M : 0);  // no allocation per call for the other providers
  for (int64_t m = 0; m < int64_t(XS.size()); ++m) XS[m] = int4_row_xsum(xq, m, G);
  at::parallel_for(0, (NB + step - 1) / step, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> out(M * R * BLOCK_N), out64;
    alignas(32) float s[BLOCK_N], z[BLOCK_N];
    for (int64_t b = u0 * step; b < std::min(NB, u1 * step); ++b) {
      const int64_t n0 = b * BLOCK_N, rows = std::min(BLOCK_N, N - n0);
#if HF_AOQ_INT4_512
      if (b % 2 == 0 && N - n0 >= 2 * BLOCK_N) {
        int4_step64(xq, w, params, XS.data(), y, M, N, K, gs, n0, out64);
        ++b;
        continue;
      }
#endif
      const uint8_t* blk = w + n0 * K / 2;
#if defined(__AVX2__)
      if (rows == BLOCK_N) {
        if (M == 1) {  // the outputs stay in registers over the groups
          const int64_t ms[1] = {0};
          __m256 o[4], AU[4], BX[4];
          for (int t = 0; t < 4; ++t) o[t] = AU[t] = BX[t] = _mm256_setzero_ps();
          for (int64_t g = 0; g < G; ++g) {
            int4_prefetch_params(params, G, g, n0, BLOCK_N);
            __m256i acc[1][4];
            int4_group_isums<1>(blk, xq, ms, K, g * gs / 2, (g + 1) * gs / 2, acc, true);
            if constexpr (P::kAffine) {
              params.indices(g, n0, BLOCK_N, s, z);
              int4_affine_group16(s, z, xq.sx[g], xq.xs[g], P::offset, acc[0], o, AU, BX);
            } else {
              params(g, n0, BLOCK_N, s, z);
              int4_epilogue16<P>(s, z, xq.sx[g], xq.xs[g], acc[0], o);
            }
          }
          if constexpr (P::kAffine) {
            int4_affine_store16(params, n0, XS[0], o, AU, BX, y + n0);
          } else {
            for (int t = 0; t < 4; ++t) _mm256_storeu_ps(y + n0 + 8 * t, o[t]);
          }
          continue;
        }
        std::fill(out.begin(), out.end(), 0.f);
        for (int64_t g = 0; g < G; ++g) {
          int4_prefetch_params(params, G, g, n0, BLOCK_N);
          if constexpr (P::kAffine) params.indices(g, n0, BLOCK_N, s, z);
          else params(g, n0, BLOCK_N, s, z);
          for (int64_t m0 = 0; m0 < M; m0 += 2) {
            const int mb = static_cast<int>(std::min<int64_t>(2, M - m0));
            const int64_t ms[2] = {m0, m0 + mb - 1};
            __m256i acc[2][4];
            if (mb == 2) int4_group_isums<2>(blk, xq, ms, K, g * gs / 2, (g + 1) * gs / 2, acc, m0 == 0);
            else int4_group_isums<1>(blk, xq, ms, K, g * gs / 2, (g + 1) * gs / 2, acc, m0 == 0);
            for (int i = 0; i < mb; ++i) {
              float* op = out.data() + (m0 + i) * R * BLOCK_N;
              __m256 o[R][4];
              for (int q = 0; q < R; ++q)
                for (int t = 0; t < 4; ++t) o[q][t] = _mm256_loadu_ps(op + q * BLOCK_N + 8 * t);
              const float sx = xq.sx[(m0 + i) * G + g], xs = xq.xs[(m0 + i) * G + g];
              if constexpr (P::kAffine) int4_affine_group16(s, z, sx, xs, P::offset, acc[i], o[0], o[1], o[2]);
              else int4_epilogue16<P>(s, z, sx, xs, acc[i], o[0]);
              for (int q = 0; q < R; ++q)
                for (int t = 0; t < 4; ++t) _mm256_storeu_ps(op + q * BLOCK_N + 8 * t, o[q][t]);
            }
          }
        }
        for (int64_t m = 0; m < M; ++m) {
          const float* op = out.data() + m * R * BLOCK_N;
          if constexpr (P::kAffine) {
            __m256 o[3][4];
            for (int q = 0; q < 3; ++q)
              for (int t = 0; t < 4; ++t) o[q][t] = _mm256_loadu_ps(op + q * BLOCK_N + 8 * t);
            int4_affine_store16(params, n0, XS[m], o[0], o[1], o[2], y + m * N + n0);
          } else {
            std::memcpy(y + m * N + n0, op, BLOCK_N * sizeof(float));
          }
        }
        continue;
      }
#endif
      std::fill(out.begin(), out.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        if constexpr (P::kAffine) params.indices(g, n0, rows, s, z);
        else params(g, n0, rows, s, z);
        for (int64_t m = 0; m < M; ++m) {
          const float sx = xq.sx[m * G + g], xs = xq.xs[m * G + g];
          for (int64_t r = 0; r < rows; ++r) {
            int32_t a = 0;
            for (int64_t k = g * gs; k < (g + 1) * gs; ++k) a += code_at(blk, rows, k, r) * int32_t(xq.codes[m * K + k]);
            float* o = out.data() + m * R * BLOCK_N + r;
            if constexpr (P::kAffine) {
              int4_affine_group1(s[r], z[r], sx, xs, P::offset, a, o, BLOCK_N);
            } else {
              const float zc = z[r] - P::offset * s[r];
              *o += (s[r] * sx) * float(a) + zc * xs;
            }
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* o = out.data() + m * R * BLOCK_N;
        for (int64_t r = 0; r < rows; ++r) {
          if constexpr (P::kAffine)
            y[m * N + n0 + r] = int4_affine_out(params, n0 + r, XS[m], o[r], o[BLOCK_N + r], o[2 * BLOCK_N + r]);
          else
            y[m * N + n0 + r] = o[r];
        }
      }
    }
  });
}

// y = x W^T for half-precision activations, through int16 activation codes (see
// quantize_rows16 and the top of this file).
template <class P>
void int4_linear16(const float* x, const uint8_t* w, const P& params, float* y, int64_t M, int64_t N, int64_t K, int64_t gs) {
  int4_linear_codes(quantize_rows16(x, M, K, gs), w, params, y, M, N, K, gs);
}

// W^T for rows [n0, n1) (block aligned) as float32 [K, n1 - n0]: (q - offset) * s + z (for
// Int4Tensor (q - 8) * scale + zero), with a separate multiply and add (built with
// -ffp-contract=off), as the reference computes it.
template <class P>
void int4_dequant_t(const uint8_t* w, const P& params, float* out, int64_t N, int64_t K, int64_t gs, int64_t n0, int64_t n1) {
  const int64_t C = n1 - n0, G = K / gs;
  const int64_t b0 = n0 / BLOCK_N, b1 = (n1 + BLOCK_N - 1) / BLOCK_N;
  float s[BLOCK_N], z[BLOCK_N];
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t bn0 = b * BLOCK_N, rows = std::min(BLOCK_N, N - bn0);
    const uint8_t* blk = w + bn0 * K / 2;
    float* o = out + (bn0 - n0);
    for (int64_t g = 0; g < G; ++g) {
      params(g, bn0, rows, s, z);
#if defined(__AVX2__)
      if (rows == BLOCK_N) {  // a column pair at a time, eight rows per vector
        const __m256 off = _mm256_set1_ps(P::offset);
        for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
          __m256 q[2][4];
          codes64(blk + k * 16, q[0], q[1]);
          for (int p = 0; p < 2; ++p)
            for (int j = 0; j < 4; ++j) {
              const __m256 v = _mm256_mul_ps(_mm256_sub_ps(q[p][j], off), _mm256_loadu_ps(s + 8 * j));
              _mm256_storeu_ps(o + (k + p) * C + 8 * j, _mm256_add_ps(v, _mm256_loadu_ps(z + 8 * j)));
            }
        }
        continue;
      }
#endif
      for (int64_t k = g * gs; k < (g + 1) * gs; ++k)
        for (int64_t r = 0; r < rows; ++r) {
          const float v = (float(code_at(blk, rows, k, r)) - P::offset) * s[r];
          o[k * C + r] = v + z[r];
        }
    }
  }
}

template <class P>
void int4_gemm(const torch::Tensor& x, const uint8_t* w, const P& params, torch::Tensor& y, int64_t N, int64_t K, int64_t gs) {
  dequant_gemm(x, y, N, K, BLOCK_N, /*transposed=*/true,
               [&](int64_t n0, int64_t n1, float* buf) { int4_dequant_t(w, params, buf, N, K, gs, n0, n1); });
}

#if defined(__AVX2__)
// Rows [n0, n0 + 32) (one full block, `blk`) of the weight's first k columns as bf16, row r at
// out + r * ld: the same float32 operations as int4_dequant_t and the same rounding as
// narrow_floats, without their float32 buffers. Eight columns at a time: four column pairs of
// codes, and each 8x8 tile of (columns, rows) transposed in registers into eight rows' runs of 8.
// Groups of a multiple of 8 columns (a run never crosses a group).
template <class P>
void int4_dequant_block_bf16(const uint8_t* blk, const P& params, uint16_t* out, int64_t ld, int64_t n0, int64_t K,
                             int64_t gs, int64_t k) {
  float s[BLOCK_N], z[BLOCK_N];
  const __m256 off = _mm256_set1_ps(P::offset);
  for (int64_t g = 0; g < K / gs && g * gs < k; ++g) {
    params(g, n0, BLOCK_N, s, z);
    const int64_t end = std::min((g + 1) * gs, k);
    for (int64_t c0 = g * gs; c0 < end; c0 += 8) {
      __m256 t[4][8];  // [rows 8j..8j+7][column c0 + c]
      for (int c = 0; c < 8; c += 2) {
        __m256 q[2][4];
        codes64(blk + (c0 + c) * 16, q[0], q[1]);
        for (int p = 0; p < 2; ++p)
          for (int j = 0; j < 4; ++j) {
            const __m256 v = _mm256_mul_ps(_mm256_sub_ps(q[p][j], off), _mm256_loadu_ps(s + 8 * j));
            t[j][c + p] = _mm256_add_ps(v, _mm256_loadu_ps(z + 8 * j));
          }
      }
      const int64_t cols = std::min<int64_t>(8, end - c0);  // fewer only in the last run of k
      for (int j = 0; j < 4; ++j) {
        transpose8x8(t[j]);  // t[j][b]: row 8j + b, columns c0..c0 + 7
        for (int b = 0; b < 8; ++b) {
          uint16_t* d = out + (8 * j + b) * ld + c0;
          const __m128i h = bf16_round8(t[j][b]);
          if (cols == 8) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(d), h);
          } else {
            alignas(16) uint16_t tmp[8];
            _mm_store_si128(reinterpret_cast<__m128i*>(tmp), h);
            std::memcpy(d, tmp, cols * sizeof(uint16_t));
          }
        }
      }
    }
  }
}
#endif

// The weight's first k columns as [N, k] in dtype (bfloat16 or float16), equal to the reference's
// dequantize(dtype) (dequant_weight in dequant_gemm.h). bf16 with groups of a multiple of 8 on
// AVX2: each full block into an L2-resident bf16 stage, then copied row by row (written straight
// into the output, the 32 rows 4 KB apart for k = 2048 fell into one L1 set and took 2.2x the time
// of the float32 buffers' path; the stage's rows are padded by 64 bytes); a last part block
// through the float32 buffers.
template <class P>
torch::Tensor int4_dequant_weight(const uint8_t* w, const P& params, int64_t N, int64_t K, int64_t gs, int64_t k,
                                  torch::ScalarType dtype) {
  auto through_buffers = [&](int64_t n0, int64_t n1, float* buf) { int4_dequant_t(w, params, buf, N, K, gs, n0, n1); };
#if defined(__AVX2__)
  if (dtype == torch::kBFloat16 && gs % 8 == 0 && K % gs == 0 && k <= K) {
    auto out = torch::empty({N, k}, torch::TensorOptions().dtype(dtype));
    c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
    const int64_t full = N / BLOCK_N;
    const int64_t ld = (k + 7) / 8 * 8 + 32;  // 16-byte runs, rows 64 bytes past a 4 KB stride
    at::parallel_for(0, full, 1, [&](int64_t b0, int64_t b1) {
      std::vector<uint16_t> stage(BLOCK_N * ld);
      for (int64_t b = b0; b < b1; ++b) {
        int4_dequant_block_bf16(w + b * BLOCK_N * K / 2, params, stage.data(), ld, b * BLOCK_N, K, gs, k);
        for (int64_t r = 0; r < BLOCK_N; ++r)
          std::memcpy(o + (b * BLOCK_N + r) * k, stage.data() + r * ld, k * sizeof(uint16_t));
      }
    });
    if (const int64_t n0 = full * BLOCK_N; n0 < N) {
      const int64_t rows = N - n0;
      std::vector<float> buf(K * rows);
      int4_dequant_t(w, params, buf.data(), N, K, gs, n0, N);  // [K, rows]
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < k; ++i) o[(n0 + r) * k + i] = static_cast<c10::BFloat16>(buf[i * rows + r]);
    }
    return out;
  }
#endif
  return dequant_weight(N, K, k, BLOCK_N, /*transposed=*/true, dtype, through_buffers);
}

// The int4 path for x (float32 [M, K]): int16 activation codes when the caller's activations
// were half precision (any number of rows), else the float32 GEMV at up to gemv_max_rows rows and
// dequantize + float32 GEMM above.
template <class P>
void int4_linear(const torch::Tensor& x, const uint8_t* w, const P& params, torch::Tensor& y, int64_t N, int64_t gs,
                 int64_t gemv_max_rows, bool int16_activations) {
  const int64_t M = x.size(0), K = x.size(1);
  if (int16_activations && gs <= kMaxInt16Group)
    int4_linear16(x.data_ptr<float>(), w, params, y.data_ptr<float>(), M, N, K, gs);
  else if (M <= gemv_max_rows)
    int4_gemv(x.data_ptr<float>(), w, params, y.data_ptr<float>(), M, N, K, gs);
  else
    int4_gemm(x, w, params, y, N, K, gs);
}

}  // namespace
