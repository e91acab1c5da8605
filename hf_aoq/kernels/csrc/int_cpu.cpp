// Int4 and int8 weight x float activation on CPU.
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
//   few rows otherwise (float32 activations, int8 weights): each weight row block is read once
//              and dotted with every activation row in float32 (a GEMV that streams the weight).
//              (The int8 GEMV already reads its weight at about the machine's bandwidth: int16
//              codes gain nothing there.)
//   many rows otherwise: chunks of the weight are dequantized exactly as the reference does it
//              and multiplied by float32 GEMM (dequant_gemm.cpp); nothing is cached.
//
// Int4 weights are read in hf_aoq's CPU "pairs" layout (int4_repack_pairs), made for the
// integer multiply-add over column pairs. Per block of 32 output rows n0..n0+31 and per column
// pair (2j, 2j+1): 32 bytes, read as 16-bit words; word 2i (column 2j) and word 2i+1 (column
// 2j+1), i = 0..7, hold in nibble t (bits 4t..4t+3) the code of row n0 + 8t + i. So one 32-bit
// lane holds one row's two codes, and shifting and masking the words yields rows 8t..8t+7 of
// both columns at once. A last block of 16 rows holds 16 bytes per column pair: words 2i, 2i+1
// for i = 0..3, nibble t: row n0 + 4t + i. Scale and zero: [groups, N, 2]. The weight is
// (q - 8) * scale + zero. Int4DQTensor (at the end) reads the same code layout with its own
// per-group parameters.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK_N = 32;

template <typename T>
inline float as_float(T v) { return static_cast<float>(v); }

// Per-(group, row-block) parameters of the int4 kernels: a provider fills s[r] and z[r] for rows
// [n0, n0 + rows) of group g, and the weight is (q - P::offset) * s + z. The GEMV folds the
// offset into zc = z - offset * s.
// Int4Tensor: scale and zero from scale_zero [groups, N, 2], offset 8.
template <typename T>
struct ScaleZeroParams {
  static constexpr float offset = 8.f;
  const T* sz;
  int64_t N;
  void operator()(int64_t g, int64_t n0, int64_t rows, float* s, float* z) const {
    const T* p = sz + (g * N + n0) * 2;
    for (int64_t r = 0; r < rows; ++r) {
      s[r] = as_float(p[2 * r]);
      z[r] = as_float(p[2 * r + 1]);
    }
  }
};

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

// Half-precision activation rows as int16 codes for the integer GEMV: per row m and group g of
// gs columns (K a multiple of gs), sx = max|x| / 32767 and code = round(x / sx) (0
// when the group is all zero), so that x = code * sx to within sx / 2. xs = sx * (sum of the
// group's codes): the sum of the activations the codes stand for, which carries an int4
// weight's zero term. A group holding inf or NaN gets sx = NaN: its row's outputs are NaN, as the
// reference's would be non-finite.
struct Int16Rows {
  std::vector<int16_t> codes;  // [M, K]
  std::vector<float> sx, xs;   // [M, G]
  // The codes of columns k, k + 1 of row m as one 32-bit lane (k low), as vpmaddwd pairs them.
  int32_t pair(int64_t m, int64_t K, int64_t k) const {
    int32_t v;
    std::memcpy(&v, codes.data() + m * K + k, sizeof v);
    return v;
  }
};

Int16Rows quantize_rows16(const float* x, int64_t M, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  Int16Rows q{std::vector<int16_t>(M * K), std::vector<float>(M * G), std::vector<float>(M * G)};
  at::parallel_for(0, M * G, 64, [&](int64_t i0, int64_t i1) {  // many rows (prefill): threads share them
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / G, g = i % G;
      const float* xg = x + m * K + g * gs;
      int16_t* cg = q.codes.data() + m * K + g * gs;
      float mx = 0.f;
      bool nan = false;
      int64_t k = 0;
#if defined(__AVX2__)
      {
        const __m256 sign = _mm256_set1_ps(-0.f);
        __m256 vm = _mm256_setzero_ps(), vn = _mm256_setzero_ps();
        for (; k + 8 <= gs; k += 8) {
          const __m256 v = _mm256_loadu_ps(xg + k);
          vm = _mm256_max_ps(vm, _mm256_andnot_ps(sign, v));
          vn = _mm256_or_ps(vn, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        alignas(32) float t[8];
        _mm256_store_ps(t, vm);
        for (int i = 0; i < 8; ++i) mx = std::max(mx, t[i]);
        nan = _mm256_movemask_ps(vn) != 0;
      }
#endif
      for (; k < gs; ++k) {
        mx = std::max(mx, std::fabs(xg[k]));
        nan = nan || std::isnan(xg[k]);
      }
      const bool finite = std::isfinite(mx) && !nan;
      const float inv = 32767.f / mx;
      int32_t total = 0;
      auto code = [&](int64_t k, float v) {  // v: x * 32767 / mx, rounded and clamped
        cg[k] = static_cast<int16_t>(std::min(std::max(std::nearbyint(v), -32767.f), 32767.f));
        total += cg[k];
      };
      k = 0;
      // An all-zero or non-finite group keeps the codes' zero initialization.
      if (finite && mx > 0.f && std::isfinite(inv)) {
#if defined(__AVX2__)
        // round(x * inv): |x * inv| <= 32767 (to within rounding: clamped), then to int16.
        const __m256 iv = _mm256_set1_ps(inv), hi = _mm256_set1_ps(32767.f), lo = _mm256_set1_ps(-32767.f);
        __m256i acc = _mm256_setzero_si256();
        for (; k + 8 <= gs; k += 8) {
          __m256 v = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xg + k), iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
          const __m256i c = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
          acc = _mm256_add_epi32(acc, c);
          const __m128i c16 = _mm_packs_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(cg + k), c16);
        }
        alignas(32) int32_t t[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(t), acc);
        for (int i = 0; i < 8; ++i) total += t[i];
#endif
        for (; k < gs; ++k) code(k, xg[k] * inv);
      } else if (finite && mx > 0.f) {  // mx so small (subnormal) that 32767 / mx is inf: divide
        for (; k < gs; ++k) code(k, xg[k] / mx * 32767.f);
      }
      const float sx = finite ? mx / 32767.f : std::numeric_limits<float>::quiet_NaN();
      q.sx[m * G + g] = sx;
      q.xs[m * G + g] = float(total) * sx;
    }
  });
  return q;
}

// Groups of up to this many columns keep an int32 sum of code products exact: each 32-bit lane
// of vpmaddwd adds two products of at most 15 * 32767, and gs / 2 of those stay below 2^31.
constexpr int64_t kMaxInt16Group = 4096;

#if defined(__AVX2__)
// acc[i][t] (int32, rows 8t..8t+7) = sum over column pairs [j0, j1) of a full block of the
// int4 codes times activation row ms[i]'s int16 codes. One row: two column pairs per iteration,
// their products added before the accumulator (5-11% faster than accumulating each); two rows:
// one pair.
template <int MB>
__attribute__((always_inline)) inline void int4_group_isums(const uint8_t* blk, const Int16Rows& xq, const int64_t* ms,
                                                            int64_t K, int64_t j0, int64_t j1, __m256i (*acc)[4]) {
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
    for (; j + 2 <= j1; j += 2) {
      __m256i q[4], r[4];
      codes(blk + j * 32, q);
      codes(blk + j * 32 + 32, r);
      const __m256i xa = _mm256_set1_epi32(xq.pair(ms[0], K, 2 * j));
      const __m256i xb = _mm256_set1_epi32(xq.pair(ms[0], K, 2 * j + 2));
      for (int t = 0; t < 4; ++t)
        a[0][t] = _mm256_add_epi32(a[0][t], _mm256_add_epi32(_mm256_madd_epi16(q[t], xa), _mm256_madd_epi16(r[t], xb)));
    }
  }
  for (; j < j1; ++j) {
    __m256i q[4];
    codes(blk + j * 32, q);
    for (int i = 0; i < MB; ++i) {
      const __m256i xa = _mm256_set1_epi32(xq.pair(ms[i], K, 2 * j));
      for (int t = 0; t < 4; ++t) a[i][t] = _mm256_add_epi32(a[i][t], _mm256_madd_epi16(q[t], xa));
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

// y = x W^T for half-precision activations, through int16 activation codes (see
// quantize_rows16 and the top of this file). Per block of 32 weight rows, group and activation
// row: an exact int32 sum of code products, then the group's float32 epilogue as the vector
// code computes it (the scalar code for a 16-row tail block does the same operations).
template <class P>
void int4_linear16(const float* x, const uint8_t* w, const P& params, float* y, int64_t M, int64_t N, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  const Int16Rows xq = quantize_rows16(x, M, K, gs);
  const int64_t NB = (N + BLOCK_N - 1) / BLOCK_N;
  at::parallel_for(0, NB, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> out(M * BLOCK_N);
    alignas(32) float s[BLOCK_N], z[BLOCK_N];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK_N, rows = std::min(BLOCK_N, N - n0);
      const uint8_t* blk = w + n0 * K / 2;
#if defined(__AVX2__)
      if (rows == BLOCK_N) {
        if (M == 1) {  // the outputs stay in registers over the groups
          const int64_t ms[1] = {0};
          __m256 o[4];
          for (int t = 0; t < 4; ++t) o[t] = _mm256_setzero_ps();
          for (int64_t g = 0; g < G; ++g) {
            __m256i acc[1][4];
            int4_group_isums<1>(blk, xq, ms, K, g * gs / 2, (g + 1) * gs / 2, acc);
            params(g, n0, BLOCK_N, s, z);
            int4_epilogue16<P>(s, z, xq.sx[g], xq.xs[g], acc[0], o);
          }
          for (int t = 0; t < 4; ++t) _mm256_storeu_ps(y + n0 + 8 * t, o[t]);
          continue;
        }
        std::fill(out.begin(), out.end(), 0.f);
        for (int64_t g = 0; g < G; ++g) {
          params(g, n0, BLOCK_N, s, z);
          for (int64_t m0 = 0; m0 < M; m0 += 2) {
            const int mb = static_cast<int>(std::min<int64_t>(2, M - m0));
            const int64_t ms[2] = {m0, m0 + mb - 1};
            __m256i acc[2][4];
            if (mb == 2) int4_group_isums<2>(blk, xq, ms, K, g * gs / 2, (g + 1) * gs / 2, acc);
            else int4_group_isums<1>(blk, xq, ms, K, g * gs / 2, (g + 1) * gs / 2, acc);
            for (int i = 0; i < mb; ++i) {
              float* op = out.data() + (m0 + i) * BLOCK_N;
              __m256 o[4];
              for (int t = 0; t < 4; ++t) o[t] = _mm256_loadu_ps(op + 8 * t);
              int4_epilogue16<P>(s, z, xq.sx[(m0 + i) * G + g], xq.xs[(m0 + i) * G + g], acc[i], o);
              for (int t = 0; t < 4; ++t) _mm256_storeu_ps(op + 8 * t, o[t]);
            }
          }
        }
        for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, out.data() + m * BLOCK_N, BLOCK_N * sizeof(float));
        continue;
      }
#endif
      std::fill(out.begin(), out.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        params(g, n0, rows, s, z);
        for (int64_t m = 0; m < M; ++m) {
          const float sx = xq.sx[m * G + g], xs = xq.xs[m * G + g];
          for (int64_t r = 0; r < rows; ++r) {
            int32_t a = 0;
            for (int64_t k = g * gs; k < (g + 1) * gs; ++k) a += code_at(blk, rows, k, r) * int32_t(xq.codes[m * K + k]);
            const float zc = z[r] - P::offset * s[r];
            out[m * BLOCK_N + r] += (s[r] * sx) * float(a) + zc * xs;
          }
        }
      }
      for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * N + n0, out.data() + m * BLOCK_N, rows * sizeof(float));
    }
  });
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

// x: float32 [M, K] contiguous, K a multiple of group_size; packed: uint8 [N, K/2] in the pairs
// layout (int4_repack_pairs); scale_zero: [K/group_size, N, 2] float32, bfloat16 or float16.
// int16_activations: x holds half-precision values (see the top of this file); else the float32
// GEMV at up to gemv_max_rows rows, dequantize + GEMM above. Returns float32 [M, N].
torch::Tensor int4pack_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size,
                              int64_t gemv_max_rows, bool int16_activations) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() * 2 == N * K,
              "packed: contiguous uint8 [N, K/2]");
  TORCH_CHECK(N % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0, "K must be a multiple of an even group_size");
  TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.size(0) == K / group_size && scale_zero.size(1) == N &&
                  scale_zero.size(2) == 2 && scale_zero.is_contiguous(),
              "scale_zero: contiguous [K/group_size, N, 2]");
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  auto run = [&](auto* sz) {
    const ScaleZeroParams<std::remove_const_t<std::remove_pointer_t<decltype(sz)>>> params{sz, N};
    int4_linear(x, w, params, y, N, group_size, gemv_max_rows, int16_activations);
  };
  switch (scale_zero.scalar_type()) {
    case torch::kFloat32: run(scale_zero.data_ptr<float>()); break;
    case torch::kBFloat16: run(scale_zero.data_ptr<c10::BFloat16>()); break;
    case torch::kFloat16: run(scale_zero.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "scale_zero: float32, bfloat16 or float16");
  }
  return y;
}

namespace {

#if defined(__AVX2__)
inline __m256 int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// One activation row against weight rows n..n+3 (dot_rows4 in simd.cpp).
inline void int8_dot4(const float* x, const int8_t* q, int64_t K, int64_t n, float* out) {
  dot_rows4(x, q + n * K, K, [](const int8_t* p) { return int8x8(p); }, [](int8_t c) { return float(c); }, out);
}
#endif

// y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]: one activation row four weight rows at a time,
// more rows two activation rows at a time.
void int8_gemv(const float* x, const int8_t* q, const float* scale, float* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX2__)
  if (M == 1 && N % 4 == 0) {
    at::parallel_for(0, N / 4, 4, [&](int64_t b0, int64_t b1) {
      float d[4];
      for (int64_t b = b0; b < b1; ++b) {
        int8_dot4(x, q, K, 4 * b, d);
        for (int j = 0; j < 4; ++j) y[4 * b + j] = d[j] * scale[4 * b + j];
      }
    });
    return;
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const int8_t* row = q + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        const bool two = m0 + 1 < M;
        const float* x0 = x + m0 * K;
        const float* x1 = x + (two ? m0 + 1 : m0) * K;
        float a0 = 0.f, a1 = 0.f;
        int64_t k = 0;
#if defined(__AVX2__)
        __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
        __m256 u0 = _mm256_setzero_ps(), u1 = _mm256_setzero_ps();
        for (; k + 16 <= K; k += 16) {
          const __m256 wa = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
          const __m256 wb = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k + 8))));
          v0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), wa, v0);
          u0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 8), wb, u0);
          if (two) {
            v1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), wa, v1);
            u1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 8), wb, u1);
          }
        }
        a0 = hsum(_mm256_add_ps(v0, u0));
        a1 = hsum(_mm256_add_ps(v1, u1));
#endif
        for (; k < K; ++k) {
          a0 += x0[k] * float(row[k]);
          a1 += x1[k] * float(row[k]);
        }
        y[m0 * N + n] = a0 * scale[n];
        if (two) y[(m0 + 1) * N + n] = a1 * scale[n];
      }
    }
  });
}

}  // namespace

// x: float32 [M, K] contiguous; q: int8 [N, K] contiguous; scale: float32 [N]. Returns float32
// [M, N]. Many rows: chunks of q * scale (the reference's float32 dequantization) and GEMM.
// (Int16 activation codes, as the int4 GEMV takes, do not pay here: at batch 1 the int8 GEMV
// already reads the weight at about the machine's bandwidth; measured 51.3 against 50.6 ms for
// a TinyLlama token's linears.)
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t gemv_max_rows) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous() && q.size(1) == x.size(1),
              "q: contiguous int8 [N, K]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.numel() == q.size(0) && scale.is_contiguous(), "scale: float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M <= gemv_max_rows) {
    int8_gemv(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
    return y;
  }
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  dequant_gemm(x, y, N, K, 1, /*transposed=*/false, [&](int64_t n0, int64_t n1, float* buf) {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* row = qp + n * K;
      float* o = buf + (n - n0) * K;
      const float s = sp[n];
      for (int64_t k = 0; k < K; ++k) o[k] = float(row[k]) * s;
    }
  });
  return y;
}

// Canonical int4 bytes (uint8 [N, K/2], code of column k in the low nibble of byte k/2 for even
// k, the high nibble for odd k) -> the pairs layout described at the top, for K padded to
// `padded_k` with code 8 (the padding the kernels' zero input columns meet). uint8 [N, padded_k/2].
// Placing a weight for the CPU kernels at load; cpu.py's pairs_int4pack_bytes is the same
// mapping in torch ops (and its test).
torch::Tensor int4_repack_pairs(torch::Tensor canonical, int64_t padded_k) {
  TORCH_CHECK(canonical.dtype() == torch::kUInt8 && canonical.dim() == 2 && canonical.is_contiguous(),
              "canonical: contiguous uint8 [N, K/2]");
  const int64_t N = canonical.size(0), half = canonical.size(1), K = 2 * half;
  TORCH_CHECK(N % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(padded_k >= K && padded_k % 2 == 0, "padded_k: even, at least K");
  auto out = torch::empty({N, padded_k / 2}, canonical.options());
  const uint8_t* c = canonical.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t pairs = padded_k / 2;
  // Canonical byte j of a row holds both codes of column pair j: column 2j low, 2j + 1 high.
  auto byte_at = [&](int64_t n, int64_t j) -> uint8_t { return j < half ? c[n * half + j] : uint8_t(0x88); };
  at::parallel_for(0, (N + BLOCK_N - 1) / BLOCK_N, 1, [&](int64_t b0, int64_t b1) {
    uint8_t src[BLOCK_N];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK_N, rows = std::min(BLOCK_N, N - n0), lanes = rows / 4;
      uint8_t* dst = o + n0 * pairs;  // `rows` bytes per column pair
      for (int64_t j = 0; j < pairs; ++j) {
        for (int64_t r = 0; r < rows; ++r) src[r] = byte_at(n0 + r, j);
        uint8_t* d = dst + j * rows;
        for (int64_t i = 0; i < lanes; ++i)
          for (int p = 0; p < 2; ++p)      // column 2j + p: word 2i + p
            for (int h = 0; h < 2; ++h) {  // byte h of the word: nibbles t = 2h (low), 2h + 1 (high)
              const int lo = (src[(2 * h) * lanes + i] >> (4 * p)) & 15;
              const int hi = (src[(2 * h + 1) * lanes + i] >> (4 * p)) & 15;
              d[4 * i + 2 * p + h] = static_cast<uint8_t>(lo | (hi << 4));
            }
      }
    }
  });
  return out;
}


// Int4DQTensor: the int4 codes above (the same pairs layout, with code 8 padding) whose per-group
// scale d and centre c are 4-bit codes a, b (gparams: a low nibble, b high nibble) between
// per-row ends decoded from 8-bit log codes (rparams: kd_lo, kd_hi, kc_lo, kc_hi) and two
// per-tensor values (tparams: T_d, T_c):
//   LUT[j] = float32(2^(-j/32)), j = 0..31
//   dval(k) = 0 if k == 255 else (T_d * LUT[k % 32]) * 2^-(k / 32)
//   cval(k) = 0 if (k & 127) == 127 else +-(T_c * LUT[2 * (m % 16)]) * 2^-(m / 16), m = k & 127,
//             negative when k >= 128
//   dstep = (dhi - dlo) / 15, cstep = (chi - clo) / 15
//   d = dlo + a * dstep, c = clo + b * cstep, w = (q - 7.5) * d + c
// all in float32, each multiply and add rounded on its own.
namespace {

// (dlo, dstep, clo, cstep) of N rows from rparams [N, 4] into out [N, 4].
void int4dq_decode_rows(const uint8_t* rp, float td, float tc, float* out, int64_t N) {
  float lut[32], pow2[8];
  for (int j = 0; j < 32; ++j) lut[j] = static_cast<float>(std::exp2(-j / 32.0));
  // 2^-e for e = 0..7: multiplying by it is exact, as ldexp is, and much cheaper per row.
  for (int e = 0; e < 8; ++e) pow2[e] = std::ldexp(1.f, -e);
  auto dval = [&](int k) -> float { return k == 255 ? 0.f : (td * lut[k & 31]) * pow2[k >> 5]; };
  auto cval = [&](int k) -> float {
    const int m = k & 127;
    if (m == 127) return 0.f;
    const float v = (tc * lut[2 * (m & 15)]) * pow2[m >> 4];
    return (k >> 7) ? -v : v;
  };
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* r = rp + n * 4;
    const float dlo = dval(r[0]), dhi = dval(r[1]), clo = cval(r[2]), chi = cval(r[3]);
    out[n * 4 + 0] = dlo;
    out[n * 4 + 1] = (dhi - dlo) / 15.f;
    out[n * 4 + 2] = clo;
    out[n * 4 + 3] = (chi - clo) / 15.f;
  }
}

// The int4 kernels' parameter provider for Int4DQTensor: d and c of rows [n0, n0 + rows) in
// group g from gparams_t [G, N] (one group's bytes contiguous over rows) and the decoded rows,
// held as four arrays (dlo, dstep, clo, cstep) so that the loop over rows vectorizes.
struct DQParams {
  static constexpr float offset = 7.5f;
  const uint8_t* gp;  // [G, N]
  const float* dlo;
  const float* dstep;
  const float* clo;
  const float* cstep;
  int64_t N;
  void operator()(int64_t g, int64_t n0, int64_t rows, float* __restrict d, float* __restrict c) const {
    const uint8_t* __restrict p = gp + g * N + n0;
    const float* __restrict l0 = dlo + n0;
    const float* __restrict s0 = dstep + n0;
    const float* __restrict l1 = clo + n0;
    const float* __restrict s1 = cstep + n0;
#if defined(__AVX2__)
    if (rows == BLOCK_N) {  // the same multiply and add, eight rows at a time
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
        const __m256 a = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        const __m256 b = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        _mm256_storeu_ps(d + 8 * j, _mm256_add_ps(_mm256_loadu_ps(l0 + 8 * j), _mm256_mul_ps(a, _mm256_loadu_ps(s0 + 8 * j))));
        _mm256_storeu_ps(c + 8 * j, _mm256_add_ps(_mm256_loadu_ps(l1 + 8 * j), _mm256_mul_ps(b, _mm256_loadu_ps(s1 + 8 * j))));
      }
      return;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const float a = static_cast<float>(p[r] & 15), b = static_cast<float>(p[r] >> 4);
      d[r] = l0[r] + a * s0[r];
      c[r] = l1[r] + b * s1[r];
    }
  }
};

torch::Tensor int4dq_decode(const torch::Tensor& rparams, const torch::Tensor& tparams) {
  TORCH_CHECK(rparams.dtype() == torch::kUInt8 && rparams.dim() == 2 && rparams.size(1) == 4,
              "rparams: uint8 [N, 4]");
  TORCH_CHECK(tparams.dtype() == torch::kFloat32 && tparams.numel() == 2, "tparams: float32 [2]");
  auto rp = rparams.contiguous();
  auto tp = tparams.contiguous();
  const int64_t N = rp.size(0);
  auto out = torch::empty({N, 4}, tp.options());
  const float* t = tp.data_ptr<float>();
  int4dq_decode_rows(rp.data_ptr<uint8_t>(), t[0], t[1], out.data_ptr<float>(), N);
  return out;
}

}  // namespace

// (dlo, dstep, clo, cstep) per row, float32 [N, 4], as the Int4DQTensor kernels decode them.
torch::Tensor int4dq_row_params(torch::Tensor rparams, torch::Tensor tparams) { return int4dq_decode(rparams, tparams); }

// x: float32 [M, Kp] contiguous (Kp: K padded to whole groups, zero input columns past K);
// packed: uint8 [N, Kp/2] in the pairs layout (int4_repack_pairs of the canonical codes);
// gparams_t: uint8 [Kp/group_size, N] contiguous (the canonical gparams transposed); rparams:
// uint8 [N, 4]; tparams: float32 [2]. Returns float32 [M, N]: through int16 activation codes
// when int16_activations, else the float32 GEMV at up to gemv_max_rows rows and above them chunks
// dequantized exactly as the format defines and float32 GEMM.
torch::Tensor int4dq_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams_t, torch::Tensor rparams,
                            torch::Tensor tparams, int64_t group_size, int64_t gemv_max_rows, bool int16_activations) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, Kp]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() * 2 == N * K,
              "packed: contiguous uint8 [N, Kp/2]");
  TORCH_CHECK(N % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0, "Kp must be a multiple of an even group_size");
  TORCH_CHECK(gparams_t.dtype() == torch::kUInt8 && gparams_t.dim() == 2 && gparams_t.size(0) == K / group_size &&
                  gparams_t.size(1) == N && gparams_t.is_contiguous(),
              "gparams_t: contiguous uint8 [Kp/group_size, N]");
  TORCH_CHECK(rparams.dim() == 2 && rparams.size(0) == N, "rparams: uint8 [N, 4]");
  auto rows = int4dq_decode(rparams, tparams).t().contiguous();  // [4, N]: dlo, dstep, clo, cstep
  const float* rp = rows.data_ptr<float>();
  const DQParams params{gparams_t.data_ptr<uint8_t>(), rp, rp + N, rp + 2 * N, rp + 3 * N, N};
  auto y = torch::empty({M, N}, x.options());
  int4_linear(x, packed.data_ptr<uint8_t>(), params, y, N, group_size, gemv_max_rows, int16_activations);
  return y;
}

// Int4DQTensor's quantizer search (int4dq.py `_quantize_rows`), the same arithmetic in C++.
// For each group, the 3x3 (scale index, centre index) candidates around (a0, b0), in the
// Python order (scale outer, centre inner; the first of equal errors wins): codes
// q = clamp(round((x - c) / d + 7.5), 0, 15) (8 where d <= 0) and the squared error
// sum(((q - 7.5) * d + c - x)^2) over the group's real columns. Only the error's summation order
// differs from the Python path (which sums with torch), so a near tie can go the other way.
// x: float32 [N, G * g] contiguous, the last group padded; k: real columns; a0, b0: uint8
// [N, G]; rows: float32 [N, 4] (dlo, dstep, clo, cstep). Returns (codes uint8 [N, G * g], a, b).
namespace {

#if defined(__AVX2__)
// Codes of 8 values and their squared errors (as the scalar code below computes them).
inline __m256 dq_codes8(const float* xp, __m256 d, __m256 c, bool dpos, __m256* qout) {
  const __m256 x = _mm256_loadu_ps(xp), half15 = _mm256_set1_ps(7.5f);
  __m256 q;
  if (dpos) {
    q = _mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(x, c), d), half15);
    q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), _mm256_set1_ps(15.f));
  } else {
    q = _mm256_set1_ps(8.f);
  }
  *qout = q;
  const __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(q, half15), d), c), x);
  return _mm256_mul_ps(r, r);
}
#endif

inline float dq_code1(float x, float d, float c) {
  if (!(d > 0.f)) return 8.f;
  float q = std::nearbyint((x - c) / d + 7.5f);
  return std::min(std::max(q, 0.f), 15.f);
}

}  // namespace

std::vector<torch::Tensor> int4dq_search(torch::Tensor x, torch::Tensor a0, torch::Tensor b0, torch::Tensor rows,
                                         int64_t g, int64_t k) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [N, G*g]");
  const int64_t N = x.size(0), W = x.size(1);
  TORCH_CHECK(g > 0 && W % g == 0 && k > W - g && k <= W, "x: [N, G*g] with k real columns in its last group");
  const int64_t G = W / g;
  TORCH_CHECK(a0.dtype() == torch::kUInt8 && b0.dtype() == torch::kUInt8 && a0.is_contiguous() && b0.is_contiguous() &&
                  a0.numel() == N * G && b0.numel() == N * G,
              "a0, b0: contiguous uint8 [N, G]");
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous() && rows.numel() == N * 4, "rows: float32 [N, 4]");
  auto codes = torch::empty({N, W}, x.options().dtype(torch::kUInt8));
  auto a_out = torch::empty({N, G}, a0.options()), b_out = torch::empty({N, G}, b0.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  const uint8_t *ap = a0.data_ptr<uint8_t>(), *bp = b0.data_ptr<uint8_t>();
  uint8_t *cp = codes.data_ptr<uint8_t>(), *aop = a_out.data_ptr<uint8_t>(), *bop = b_out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> q(g), best_q(g);
    for (int64_t n = n0; n < n1; ++n) {
      const float dlo = rp[4 * n], dstep = rp[4 * n + 1], clo = rp[4 * n + 2], cstep = rp[4 * n + 3];
      for (int64_t j = 0; j < G; ++j) {
        const float* xg = xp + n * W + j * g;
        const int64_t real = std::min(g, k - j * g);
        float best_err = 0.f;
        int best_a = -1, best_b = -1;
        for (int da = -1; da <= 1; ++da) {
          for (int db = -1; db <= 1; ++db) {
            const int a = std::min(std::max(int(ap[n * G + j]) + da, 0), 15);
            const int b = std::min(std::max(int(bp[n * G + j]) + db, 0), 15);
            const float d = dlo + float(a) * dstep, c = clo + float(b) * cstep;
            float err = 0.f;
            int64_t i = 0;
#if defined(__AVX2__)
            if (real == g) {
              __m256 acc = _mm256_setzero_ps();
              const __m256 dv = _mm256_set1_ps(d), cv = _mm256_set1_ps(c);
              for (; i + 8 <= g; i += 8) {
                __m256 qv;
                acc = _mm256_add_ps(acc, dq_codes8(xg + i, dv, cv, d > 0.f, &qv));
                _mm256_storeu_ps(q.data() + i, qv);
              }
              err = hsum(acc);
            }
#endif
            for (; i < g; ++i) {
              q[i] = dq_code1(xg[i], d, c);
              if (i < real) {
                const float r = ((q[i] - 7.5f) * d + c) - xg[i];
                err += r * r;
              }
            }
            if (best_a < 0 || err < best_err) {
              best_err = err;
              best_a = a;
              best_b = b;
              std::swap(q, best_q);
            }
          }
        }
        uint8_t* cg = cp + n * W + j * g;
        for (int64_t i = 0; i < g; ++i) cg[i] = static_cast<uint8_t>(best_q[i]);
        aop[n * G + j] = static_cast<uint8_t>(best_a);
        bop[n * G + j] = static_cast<uint8_t>(best_b);
      }
    }
  });
  return {codes, a_out, b_out};
}
