// The AVX-512 step of the int4 kernels' integer path (int4_pairs.h's int4_linear_codes): two
// adjacent full blocks of the pairs layout, 64 weight rows, per 512-bit register.
//
// Column pair j of block A (rows n0..n0+31) and of block B (rows n0+32..n0+63) are 32 bytes
// each; one zmm holds both, so shifting and masking it gives four vectors of int16 code pairs,
// vector t holding rows 8t..8t+7 of A in lanes 0-7 and of B in lanes 8-15 (the "64-row lane
// order"). Every per-group step then covers 16 rows per instruction where the AVX2 code covers 8:
// the integer multiply-adds (vpdpwssd), and above all the group's parameters and epilogue, which
// dominate at groups of 32 (Int4Tensor's provider's `block64` produces scale and zero, Int4DQ's
// `indices64` its group indices, straight in this lane order). Per output the operations are
// those of the AVX2 code, in the same order (exact int32 sums, then int4_epilogue16's multiplies
// and adds, or for Int4DQ int4_affine_group16's sums and int4_affine_store16's end, group after
// group), so both builds still give the same outputs bit for bit.
// Internal linkage (an anonymous namespace), as in every header here.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "int16_rows.h"
#include "simd.h"  // dpwssd512

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512DQ__)
#define HF_AOQ_INT4_512 1
#else
#define HF_AOQ_INT4_512 0
#endif

namespace {

// Software prefetch in the integer int4 GEMV, both builds (here and int4_pairs.h). A thread walks
// its steps (blocks) in order and each step's codes are one or two contiguous streams, but the
// hardware prefetcher kept too few lines in flight: from DRAM (weights cycled past L3) the AVX-512
// GEMV read 9-10 GB/s where the same loop ran at 26 GB/s from L3. So each code stream is fetched
// ahead (one prefetch per 64 bytes), and the group parameters, [G, N] with a whole page or more
// between groups (a strided stream the hardware prefetcher does not follow), kInt4ParamPrefetch
// groups ahead. A prefetch is a hint, never a fault, so one past a row's or the tensor's end (the
// last step's) is harmless; it changes no arithmetic.
// The AVX2 step reads one stream, a block after the other, so kInt4Prefetch bytes on is simply
// further along the same stream, into L1 (1-4 KB and 2-8 groups measured alike on the Xeon; none
// 25-40% slower). The AVX-512 step reads two blocks side by side (a and b below, 16 K bytes
// apart): there the codes are asked for kInt4Prefetch64 bytes on into L2, and a distance that
// passes a block's end goes on at the same place in the next step's block (the next thing this
// stream reads) instead of into the other block, which is already being read. On the AMD EPYC
// Zen 4 (weights cycled from DRAM, 2 threads, builds alternated in one process, 10 rounds) the
// AVX-512 GEMV read int4 g128 [5632, 2048] 1.27-1.28x as fast (median of per-round ratios) as
// with 2 KB into L1, [2048, 5632] 1.07-1.18x, Int4DQ g32 1.07-1.09x; 4 KB and 16 KB measured
// alike, 8 KB into L1 or without the jump past a block's end no better than before
// (docs/performance.md, "Prefetch into L2"). With K < 512 (a block under 8 KB) the jump lands a
// block early: a wasted hint, nothing else.
constexpr int64_t kInt4Prefetch = 2048;
constexpr int64_t kInt4Prefetch64 = 8192;
constexpr int64_t kInt4ParamPrefetch = 4;
inline void int4_prefetch(const uint8_t* p) { __builtin_prefetch(p, 0, 3); }
inline void int4_prefetch_l2(const uint8_t* p) { __builtin_prefetch(p, 0, 2); }

// The parameters kInt4ParamPrefetch groups after group g of the step at rows n0 (of `step` rows,
// G groups): past the step's last group, the next step's, which the same thread computes next.
template <class P>
inline void int4_prefetch_params(const P& params, int64_t G, int64_t g, int64_t n0, int64_t step) {
  const int64_t ahead = g + kInt4ParamPrefetch;
  params.prefetch64(ahead % G, n0 + ahead / G * step);
}

// Row r (0..63) of a 64-row step sits at lane position int4_lane64(r) of the step's 4 x 16
// lanes (vector t = position / 16).
inline int64_t int4_lane64(int64_t r) { return (r % 32) / 8 * 16 + r / 32 * 8 + r % 8; }

#if HF_AOQ_INT4_512
constexpr int kMaxTile64 = 4;  // activation rows per pass over a step's codes: 16 int32 accumulators

// acc[i][t] (int32) = sum over column pairs [j0, j1) of the step's codes times row xc[i]'s
// int16 codes, in the 64-row lane order. One row: two chains per vector (even and odd pairs),
// as the AVX2 code, so that vpdpwssd's latency hides. pf: prefetch the codes ahead (the first of
// the tiles that read these codes).
template <int MB>
__attribute__((always_inline)) inline void int4_group_isums64(const uint8_t* a, const uint8_t* b,
                                                              const int16_t* const* xc, int64_t j0, int64_t j1,
                                                              __m512i (*acc)[4], bool pf, int64_t blen) {
  // The byte kInt4Prefetch64 on in stream s at column pair j; past the block's end (blen bytes),
  // the same place in the next step's block, 2 * blen on.
  auto ahead = [blen](const uint8_t* s, int64_t j) {
    const int64_t off = 32 * j + kInt4Prefetch64;
    return s + (off < blen ? off : off + blen);
  };
  const __m512i m4 = _mm512_set1_epi16(15);
  auto codes = [&](int64_t j, __m512i* q) {
    const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32 * j))),
                                         _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32 * j)), 1);
    q[0] = _mm512_and_si512(v, m4);
    q[1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    q[2] = _mm512_and_si512(_mm512_srli_epi16(v, 8), m4);
    q[3] = _mm512_srli_epi16(v, 12);
  };
  auto xpair = [&](int i, int64_t j) {
    int32_t v;
    std::memcpy(&v, xc[i] + 2 * j, sizeof v);
    return _mm512_set1_epi32(v);
  };
  if constexpr (MB == 1) {
    // Two chains per vector (even and odd column pairs), in arrays of their own (not the
    // tiles' s[MB][4]) and fully unrolled, so that all eight stay in registers.
    __m512i e[4], o[4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) e[t] = o[t] = _mm512_setzero_si512();
    int64_t j = j0;
    for (; j + 2 <= j1; j += 2) {
      int4_prefetch_l2(ahead(a, j));
      int4_prefetch_l2(ahead(b, j));
      __m512i q[4], r[4];
      codes(j, q);
      codes(j + 1, r);
      const __m512i xa = xpair(0, j), xb = xpair(0, j + 1);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        e[t] = dpwssd512(e[t], q[t], xa);
        o[t] = dpwssd512(o[t], r[t], xb);
      }
    }
    if (j < j1) {
      __m512i q[4];
      codes(j, q);
      const __m512i x = xpair(0, j);
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) e[t] = dpwssd512(e[t], q[t], x);
    }
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) acc[0][t] = _mm512_add_epi32(e[t], o[t]);
  } else {
    __m512i s[MB][4];
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) s[i][t] = _mm512_setzero_si512();
    for (int64_t j = j0; j < j1; ++j) {
      if (pf && (j & 1) == 0) {  // a 64-byte line per stream every two column pairs
        int4_prefetch_l2(ahead(a, j));
        int4_prefetch_l2(ahead(b, j));
      }
      __m512i q[4];
      codes(j, q);
#pragma GCC unroll 16
      for (int i = 0; i < MB; ++i) {
        const __m512i x = xpair(i, j);
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) s[i][t] = dpwssd512(s[i][t], q[t], x);
      }
    }
#pragma GCC unroll 16
    for (int i = 0; i < MB; ++i)
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) acc[i][t] = s[i][t];
  }
}

// out[t] += (s * sx) * acc[t] + zc * xs: int4_epilogue16's operations (zc = z - offset * s,
// computed once per group by the caller), 16 rows at a time.
__attribute__((always_inline)) inline void int4_epilogue64(const __m512* s, const __m512* zc, float sx, float xs,
                                                           const __m512i* acc, __m512* out) {
  const __m512 sxv = _mm512_set1_ps(sx), xsv = _mm512_set1_ps(xs);
  for (int t = 0; t < 4; ++t) {
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(s[t], sxv), _mm512_cvtepi32_ps(acc[t])),
                                   _mm512_mul_ps(zc[t], xsv));
    out[t] = _mm512_add_ps(out[t], v);
  }
}

template <class P>
__attribute__((always_inline)) inline void int4_params64(const P& params, int64_t g, int64_t n0, __m512* s, __m512* zc) {
  __m512 z[4];
  params.block64(g, n0, s, z);
  const __m512 off = _mm512_set1_ps(P::offset);
  for (int t = 0; t < 4; ++t) zc[t] = _mm512_sub_ps(z[t], _mm512_mul_ps(off, s[t]));
}

// Output vector t (64-row lane order) to y's rows n0 + 8t.. and n0 + 32 + 8t..
inline void int4_store64(float* y, const __m512* o) {
  for (int t = 0; t < 4; ++t) {
    _mm256_storeu_ps(y + 8 * t, _mm512_castps512_ps256(o[t]));
    _mm256_storeu_ps(y + 32 + 8 * t, _mm512_extractf32x8_ps(o[t], 1));
  }
}

// The affine providers' epilogue (int4_pairs.h's int4_affine_group16 and int4_affine_store16,
// 16 rows a vector): a group of the step's rows into the sums U, AU, BX (a, b: the rows'
// indices as float32, lane order) ...
__attribute__((always_inline)) inline void int4_affine_group64(const __m512* a, const __m512* b, float sx, float xs,
                                                               float offset, const __m512i* acc, __m512* U, __m512* AU,
                                                               __m512* BX) {
  const __m512 sxv = _mm512_set1_ps(sx), xsv = _mm512_set1_ps(xs), nxo = _mm512_set1_ps(-(offset * xs));
  for (int t = 0; t < 4; ++t) {
    const __m512 u = _mm512_fmadd_ps(sxv, _mm512_cvtepi32_ps(acc[t]), nxo);
    U[t] = _mm512_add_ps(U[t], u);
    AU[t] = _mm512_fmadd_ps(a[t], u, AU[t]);
    BX[t] = _mm512_fmadd_ps(b[t], xsv, BX[t]);
  }
}

// ... and the step's outputs from them, with the rows' parameters in lane order (P::rows64).
template <class P>
inline void int4_affine_store64(const P& p, int64_t n0, float XS, const __m512* U, const __m512* AU, const __m512* BX,
                                float* y) {
  const float* r = p.rows64 + n0;
  const int64_t N = p.N;
  const __m512 xsv = _mm512_set1_ps(XS);
  __m512 o[4];
  for (int t = 0; t < 4; ++t) {
    const float* q = r + 16 * t;
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(q), U[t]);
    v = _mm512_fmadd_ps(_mm512_loadu_ps(q + N), AU[t], v);
    v = _mm512_fmadd_ps(_mm512_loadu_ps(q + 2 * N), xsv, v);
    o[t] = _mm512_fmadd_ps(_mm512_loadu_ps(q + 3 * N), BX[t], v);
  }
  int4_store64(y, o);
}

// Activation rows [m0, m0 + MB) of a step, the outputs in `out` (float [M][64], lane order; for
// an affine provider the sums, [M][3][64], with s and zc holding the indices a and b).
template <int MB, bool Affine, class P>
inline void int4_tile64(const Int16Rows& xq, const uint8_t* a, const uint8_t* b, const __m512* s, const __m512* zc,
                        int64_t m0, int64_t K, int64_t G, int64_t g, int64_t gs, float* out) {
  constexpr int R = Affine ? 3 : 1;
  const int16_t* xc[MB];
  for (int i = 0; i < MB; ++i) xc[i] = xq.codes.data() + (m0 + i) * K;
  __m512i acc[MB][4];
  int4_group_isums64<MB>(a, b, xc, g * gs / 2, (g + 1) * gs / 2, acc, m0 == 0, 16 * K);
  for (int i = 0; i < MB; ++i) {
    float* op = out + (m0 + i) * R * 64;
    __m512 o[R][4];
    for (int q = 0; q < R; ++q)
      for (int t = 0; t < 4; ++t) o[q][t] = _mm512_loadu_ps(op + q * 64 + 16 * t);
    const float sx = xq.sx[(m0 + i) * G + g], xs = xq.xs[(m0 + i) * G + g];
    if constexpr (Affine) int4_affine_group64(s, zc, sx, xs, P::offset, acc[i], o[0], o[1], o[2]);
    else int4_epilogue64(s, zc, sx, xs, acc[i], o[0]);
    for (int q = 0; q < R; ++q)
      for (int t = 0; t < 4; ++t) _mm512_storeu_ps(op + q * 64 + 16 * t, o[q][t]);
  }
}

// y[:, n0:n0+64] for weight rows n0..n0+63 (two full blocks), all M activation rows (XS: each
// row's xs summed over its groups, for an affine provider). One row: the outputs stay in
// registers over the groups; more: per group, tiles of up to kMaxTile64 rows share each decoded
// code vector.
template <class P>
void int4_step64(const Int16Rows& xq, const uint8_t* w, const P& params, const float* XS, float* y, int64_t M,
                 int64_t N, int64_t K, int64_t gs, int64_t n0, std::vector<float>& out) {
  constexpr bool Affine = P::kAffine;
  constexpr int R = Affine ? 3 : 1;
  const int64_t G = K / gs;
  const uint8_t* a = w + n0 * K / 2;
  const uint8_t* b = a + 32 * K / 2;
  __m512 s[4], zc[4];
  auto group_params = [&](int64_t g) {
    if constexpr (Affine) params.indices64(g, n0, s, zc);
    else int4_params64(params, g, n0, s, zc);
  };
  if (M == 1) {
    const int16_t* xc[1] = {xq.codes.data()};
    __m512 o[4], AU[4], BX[4];
    for (int t = 0; t < 4; ++t) o[t] = AU[t] = BX[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      int4_prefetch_params(params, G, g, n0, 64);
      __m512i acc[1][4];
      int4_group_isums64<1>(a, b, xc, g * gs / 2, (g + 1) * gs / 2, acc, true, 16 * K);
      group_params(g);
      if constexpr (Affine) int4_affine_group64(s, zc, xq.sx[g], xq.xs[g], P::offset, acc[0], o, AU, BX);
      else int4_epilogue64(s, zc, xq.sx[g], xq.xs[g], acc[0], o);
    }
    if constexpr (Affine) int4_affine_store64(params, n0, XS[0], o, AU, BX, y + n0);
    else int4_store64(y + n0, o);
    return;
  }
  out.assign(M * R * 64, 0.f);
  for (int64_t g = 0; g < G; ++g) {
    int4_prefetch_params(params, G, g, n0, 64);
    group_params(g);
    for (int64_t m0 = 0; m0 < M; m0 += kMaxTile64) {
      switch (std::min<int64_t>(kMaxTile64, M - m0)) {
        case 1: int4_tile64<1, Affine, P>(xq, a, b, s, zc, m0, K, G, g, gs, out.data()); break;
        case 2: int4_tile64<2, Affine, P>(xq, a, b, s, zc, m0, K, G, g, gs, out.data()); break;
        case 3: int4_tile64<3, Affine, P>(xq, a, b, s, zc, m0, K, G, g, gs, out.data()); break;
        default: int4_tile64<kMaxTile64, Affine, P>(xq, a, b, s, zc, m0, K, G, g, gs, out.data()); break;
      }
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const float* op = out.data() + m * R * 64;
    __m512 o[R][4];
    for (int q = 0; q < R; ++q)
      for (int t = 0; t < 4; ++t) o[q][t] = _mm512_loadu_ps(op + q * 64 + 16 * t);
    if constexpr (Affine) int4_affine_store64(params, n0, XS[m], o[0], o[1], o[2], y + m * N + n0);
    else int4_store64(y + m * N + n0, o[0]);
  }
}
#endif

}  // namespace
