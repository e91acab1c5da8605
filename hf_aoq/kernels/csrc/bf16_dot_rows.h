// y = x W^T for bf16 x at a few rows and one-byte weight codes whose every value is a bf16 value:
// each code becomes its exact bf16 bits by byte-table lookups in registers (AVX512-VBMI's
// 128-entry byte permutes, the format's converter), and AVX512-BF16's VDPBF16PS multiplies them
// with x's bf16 values, 32 products an instruction (twice a float32 FMA's), summed in float32; the
// row's scale multiplies each sum, which is rounded once to bf16. Float8's few-row kernel
// (fp8.cpp), between its float32 GEMV and the panel GEMM (amx_gemm.h), whose writer rounds code x
// scale to bf16 per call. (Int8 codes, tried with an |c| table: as fast as int8.cpp's GEMV on
// int16 activation codes at 1-2 rows, slower at 4-8, 0.90-0.94x its time at 16-28; not taken.)
// Built in the avx512 binary (HF_AOQ_AMX), the byte permutes under a target pragma; the entry
// points check the CPU for VBMI. Internal linkage, as in every header here.
#pragma once
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <vector>

#include "amx_gemm.h"  // HF_AOQ_AMX

#if HF_AOQ_AMX
namespace {
#pragma GCC push_options
#pragma GCC target("avx512vbmi")

// A format's converter (convert(c, lo, hi)) gives 64 codes (one byte each) as 64 bf16 (raw bits)
// in two vectors, in the "64-k order": lo holds the codes of k 0-7, 16-23, 32-39, 48-55 and hi
// those of 8-15, 24-31, 40-47, 56-63 (what unpacking the high and low bytes per 128-bit lane
// gives). Bf16Lookup does the lookup and the unpacking, from a table of the bf16 bits of 128
// magnitudes, their high bytes and low bytes apart:
struct Bf16ByteTable {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
  void set(int i, uint16_t bits) {
    high[i] = static_cast<uint8_t>(bits >> 8);
    low[i] = static_cast<uint8_t>(bits & 0xFF);
  }
};

// The bf16 bits of 128 magnitudes looked up for each of 64 indices (bits 0-6), in the 64-k order;
// high_fix(...) adjusts the high bytes (the sign) before the unpacking.
struct Bf16Lookup {
  __m512i h0, h1, l0, l1;
  explicit Bf16Lookup(const Bf16ByteTable& t)
      : h0(_mm512_load_si512(t.high)), h1(_mm512_load_si512(t.high + 64)), l0(_mm512_load_si512(t.low)),
        l1(_mm512_load_si512(t.low + 64)) {}
  template <class High>
  __attribute__((always_inline)) void operator()(__m512i idx, const High& high_fix, __m512i& lo, __m512i& hi) const {
    const __m512i high = high_fix(_mm512_permutex2var_epi8(h0, idx, h1));
    const __m512i low = _mm512_permutex2var_epi8(l0, idx, l1);
    lo = _mm512_unpacklo_epi8(low, high);
    hi = _mm512_unpackhi_epi8(low, high);
  }
};

// x's row (K bf16, zero past K up to Kp, a multiple of 64) in the 64-k order, 64 values a block.
inline void bf16_dot_x_order(const uint16_t* x, int64_t K, int64_t Kp, uint16_t* out) {
  for (int64_t k = 0; k < Kp; k += 64) {
    const int64_t n = K - k;
    const __m512i x0 = n >= 32 ? _mm512_loadu_si512(x + k)
                               : _mm512_maskz_loadu_epi16(static_cast<__mmask32>(n > 0 ? (1ull << n) - 1 : 0), x + k);
    const __m512i x1 = n >= 64 ? _mm512_loadu_si512(x + k + 32)
                               : _mm512_maskz_loadu_epi16(static_cast<__mmask32>(n > 32 ? (1ull << (n - 32)) - 1 : 0),
                                                          x + k + 32);
    _mm512_store_si512(out + k, _mm512_shuffle_i64x2(x0, x1, 0x88));       // 128-bit lanes 0, 2 of each
    _mm512_store_si512(out + k + 32, _mm512_shuffle_i64x2(x0, x1, 0xDD));  // lanes 1, 3
  }
}

// sums[i][j] (16 float32 lanes) += x row i . weight row j over the bf16 values [0, len) of w (four
// rows, ldw apart, in the 64-k order) and of x (MB rows, ldx apart, the same order): each weight
// vector is loaded once for the MB rows, each x vector once for the four weight rows.
template <int MB>
__attribute__((always_inline)) inline void bf16_dot_tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw,
                                                        int64_t len, __m512 (*sums)[4]) {
  __m512 acc[MB][4];  // in registers for the loop
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = sums[i][j];
  for (int64_t k = 0; k < len; k += 32) {
    const __m512bh w0 = (__m512bh)_mm512_load_si512(w + k), w1 = (__m512bh)_mm512_load_si512(w + ldw + k);
    const __m512bh w2 = (__m512bh)_mm512_load_si512(w + 2 * ldw + k), w3 = (__m512bh)_mm512_load_si512(w + 3 * ldw + k);
    for (int i = 0; i < MB; ++i) {
      const __m512bh xv = (__m512bh)_mm512_load_si512(x + i * ldx + k);
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xv, w0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xv, w1);
      acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xv, w2);
      acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xv, w3);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) sums[i][j] = acc[i][j];
}

constexpr int kBf16DotRows = 6;  // rows of x per tile: 24 sums, 4 weight vectors, 1 of x
inline void bf16_dot_tile_rows(int mb, const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t ldw, int64_t len,
                              __m512 (*sums)[4]) {
  switch (mb) {
    case 1: bf16_dot_tile<1>(x, ldx, w, ldw, len, sums); break;
    case 2: bf16_dot_tile<2>(x, ldx, w, ldw, len, sums); break;
    case 3: bf16_dot_tile<3>(x, ldx, w, ldw, len, sums); break;
    case 4: bf16_dot_tile<4>(x, ldx, w, ldw, len, sums); break;
    case 5: bf16_dot_tile<5>(x, ldx, w, ldw, len, sums); break;
    default: bf16_dot_tile<kBf16DotRows>(x, ldx, w, ldw, len, sums); break;
  }
}

// The sums of the 16 lanes of a[0..3], as the four low lanes (a shuffle-and-add tree).
inline __m128 bf16_dot_sum4(const __m512* a) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
  // per 128-bit lane: [a0 a1 a0 a1] and [a2 a3 a2 a3] partial sums -> [a0 a1 a2 a3]
  const __m512 t = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t0), _mm512_castps_pd(t1))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(t), _mm512_extractf32x8_ps(t, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// y [M, N] (bf16 bits) = (x . codes) x scale (+ bias): x bf16 [M, K], codes [N, K] one byte each,
// cv(c, lo, hi) the format's converter; on a CPU with AVX512-VBMI. Per block of four weight rows
// and chunk of k, the codes are converted once into a bf16 buffer (8 KB, L1) that tiles of up to
// six rows of x read; the sums stay vectors across the chunks and are added up once at the end.
// Each weight row asks for the next block's line into L2 as it is read (simd.h's GEMVs, the same
// distance; spread over the tiles instead, or left to the hardware, it was slower).
template <class Convert>
void bf16_dot_rows(const uint16_t* xp, int64_t M, int64_t K, const uint8_t* cp, int64_t N, const float* sp,
                   const float* bp, const Convert& cv, uint16_t* yp) {
  const int64_t Kp = (K + 63) / 64 * 64;
  // x in the 64-k order, once per call (torch's allocator aligns to 64 bytes).
  const torch::Tensor xo_t = torch::empty({M, Kp}, torch::kBFloat16);
  uint16_t* const xo = reinterpret_cast<uint16_t*>(xo_t.data_ptr());
  for (int64_t m = 0; m < M; ++m) bf16_dot_x_order(xp + m * K, K, Kp, xo + m * Kp);
  constexpr int64_t kChunk = 1024;  // four rows' bf16 (8 KB) and six rows of x (12 KB) in L1
  at::parallel_for(0, (N + 3) / 4, 8, [&](int64_t b0, int64_t b1) {
    alignas(64) uint16_t wbuf[4 * kChunk];
    std::vector<__m512> part(size_t(M * 4));
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t n0 = 4 * blk;
      const int nj = static_cast<int>(std::min<int64_t>(4, N - n0));
      const uint8_t* w[4];
      for (int j = 0; j < 4; ++j) w[j] = cp + std::min<int64_t>(n0 + j, N - 1) * K;
      std::fill(part.begin(), part.end(), _mm512_setzero_ps());
      for (int64_t k0 = 0; k0 < Kp; k0 += kChunk) {
        const int64_t len = std::min<int64_t>(kChunk, Kp - k0);
        for (int j = 0; j < 4; ++j)
          for (int64_t k = 0; k < len; k += 64) {
            const uint8_t* p = w[j] + k0 + k;
            _mm_prefetch(reinterpret_cast<const char*>(p + 4 * K), _MM_HINT_T1);  // the next block's row
            const int64_t n = K - k0 - k;  // > 0: Kp - K < 64
            const __m512i c = n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((1ull << n) - 1, p);
            __m512i lo, hi;
            cv(c, lo, hi);
            _mm512_store_si512(wbuf + j * kChunk + k, lo);
            _mm512_store_si512(wbuf + j * kChunk + k + 32, hi);
          }
        for (int64_t m0 = 0; m0 < M; m0 += kBf16DotRows) {
          const int mb = static_cast<int>(std::min<int64_t>(kBf16DotRows, M - m0));
          bf16_dot_tile_rows(mb, xo + m0 * Kp + k0, Kp, wbuf, kChunk, len,
                             reinterpret_cast<__m512(*)[4]>(part.data() + m0 * 4));
        }
      }
      alignas(16) float v[4];
      for (int64_t m = 0; m < M; ++m) {
        _mm_store_ps(v, bf16_dot_sum4(&part[m * 4]));
        for (int j = 0; j < nj; ++j) {
          float o = v[j] * sp[n0 + j];
          if (bp) o += bp[n0 + j];
          yp[m * N + n0 + j] = c10::BFloat16(o).x;
        }
      }
    }
  });
}
#pragma GCC pop_options
}  // namespace
#endif  // HF_AOQ_AMX
