// AVX2 building blocks shared by the CPU kernels. Internal linkage (an anonymous namespace):
// each translation unit gets its own copy, compiled with that unit's instruction-set flags.
#pragma once
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// One activation row x against four weight rows of codes starting at r0 (rows K apart): each x
// vector is loaded once for the four rows, and eight independent FMA chains (two per row) hide
// the FMA latency. widen8(p) gives the float32 values of the 8 codes at p, widen1(c) of one code.
// out gets the four dot products.
template <typename T, class Widen8, class Widen1>
inline void dot_rows4(const float* x, const T* r0, int64_t K, const Widen8& widen8, const Widen1& widen1, float* out) {
  const T* r1 = r0 + K;
  const T* r2 = r1 + K;
  const T* r3 = r2 + K;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 xa = _mm256_loadu_ps(x + k), xb = _mm256_loadu_ps(x + k + 8);
    a0 = _mm256_fmadd_ps(xa, widen8(r0 + k), a0);
    a1 = _mm256_fmadd_ps(xa, widen8(r1 + k), a1);
    a2 = _mm256_fmadd_ps(xa, widen8(r2 + k), a2);
    a3 = _mm256_fmadd_ps(xa, widen8(r3 + k), a3);
    b0 = _mm256_fmadd_ps(xb, widen8(r0 + k + 8), b0);
    b1 = _mm256_fmadd_ps(xb, widen8(r1 + k + 8), b1);
    b2 = _mm256_fmadd_ps(xb, widen8(r2 + k + 8), b2);
    b3 = _mm256_fmadd_ps(xb, widen8(r3 + k + 8), b3);
  }
  out[0] = hsum(_mm256_add_ps(a0, b0));
  out[1] = hsum(_mm256_add_ps(a1, b1));
  out[2] = hsum(_mm256_add_ps(a2, b2));
  out[3] = hsum(_mm256_add_ps(a3, b3));
  for (; k < K; ++k) {
    out[0] += x[k] * widen1(r0[k]);
    out[1] += x[k] * widen1(r1[k]);
    out[2] += x[k] * widen1(r2[k]);
    out[3] += x[k] * widen1(r3[k]);
  }
}
#endif

}  // namespace
