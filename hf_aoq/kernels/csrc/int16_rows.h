// Activation rows as int16 codes per group, for the integer int4 kernels (int4_pairs.h,
// int4_pairs512.h) and intx.cpp: Int16Rows and quantize_rows16.
// Internal linkage (an anonymous namespace), as in every header here.
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

namespace {

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

}  // namespace
