// Int4Tensor's per-group parameters for the int4 kernels (int4_pairs.h): scale and zero from
// scale_zero [groups, N, 2] in float32, bfloat16 or float16; the weight is (q - 8) * scale + zero.
// Shared by int4.cpp (float activations) and int8_int4.cpp (integer activation codes).
#pragma once
#include <torch/types.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <type_traits>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "int4_pairs512.h"  // HF_AOQ_INT4_512

namespace {

#if defined(__AVX2__)
// [s0 z0 .. s3 z3], [s4 z4 .. s7 z7] -> s[0..7], z[0..7].
inline void deinterleave8(__m256 a, __m256 b, float* s, float* z) {
  const __m256 e = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), o = _mm256_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1));
  _mm256_storeu_ps(s, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), _MM_SHUFFLE(3, 1, 2, 0))));
  _mm256_storeu_ps(z, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), _MM_SHUFFLE(3, 1, 2, 0))));
}
#endif

template <typename T>
struct ScaleZeroParams {
  static constexpr float offset = 8.f;
  static constexpr bool kAffine = false;  // int4_pairs.h: its own scale and zero per group
  const T* sz;
  int64_t N;
  void operator()(int64_t g, int64_t n0, int64_t rows, float* s, float* z) const {
    const T* p = sz + (g * N + n0) * 2;
    int64_t r = 0;
#if defined(__AVX2__)
    // Eight rows at a time (the same exact conversions): per group and block the scalar loop
    // cost as much as the block's integer multiply-adds at groups of 32.
    if constexpr (std::is_same<T, c10::BFloat16>::value) {
      const __m256i hi = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
      for (; r + 8 <= rows; r += 8) {  // one 32-bit lane per row: scale low, zero high
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 2 * r));
        _mm256_storeu_ps(s + r, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        _mm256_storeu_ps(z + r, _mm256_castsi256_ps(_mm256_and_si256(v, hi)));
      }
    } else if constexpr (std::is_same<T, float>::value) {
      for (; r + 8 <= rows; r += 8) deinterleave8(_mm256_loadu_ps(p + 2 * r), _mm256_loadu_ps(p + 2 * r + 8), s + r, z + r);
    }
#if defined(__F16C__)
    else if constexpr (std::is_same<T, c10::Half>::value) {
      for (; r + 8 <= rows; r += 8) {
        const __m128i* h = reinterpret_cast<const __m128i*>(p + 2 * r);
        deinterleave8(_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1)), s + r, z + r);
      }
    }
#endif
#endif
    for (; r < rows; ++r) {
      s[r] = static_cast<float>(p[2 * r]);
      z[r] = static_cast<float>(p[2 * r + 1]);
    }
  }
  // Brings group g's scale and zero of rows n0..n0+63 towards the core (int4_prefetch_params).
  void prefetch64(int64_t g, int64_t n0) const {
    const uint8_t* p = reinterpret_cast<const uint8_t*>(sz + (g * N + n0) * 2);
    for (int64_t i = 0; i < int64_t(128 * sizeof(T)); i += 64) int4_prefetch(p + i);
  }
#if HF_AOQ_INT4_512
  // Scale and zero of rows n0..n0+63 in int4_pairs512.h's 64-row lane order: vector t holds rows
  // n0 + 8t.. (lanes 0-7) and n0 + 32 + 8t.. (lanes 8-15).
  void block64(int64_t g, int64_t n0, __m512* s, __m512* z) const {
    const T* p = sz + (g * N + n0) * 2;
    for (int t = 0; t < 4; ++t) {
      const T* a = p + 16 * t;  // rows n0 + 8t.., 16 values
      const T* b = a + 64;      // rows n0 + 32 + 8t..
      if constexpr (std::is_same<T, c10::BFloat16>::value) {
        const __m512i v = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1);
        s[t] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        z[t] = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
      } else {
        __m512 va, vb;  // [s z] x 8 rows each
        if constexpr (std::is_same<T, float>::value) {
          va = _mm512_loadu_ps(a);
          vb = _mm512_loadu_ps(b);
        } else {
          va = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
          vb = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
        }
        const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
        s[t] = _mm512_permutex2var_ps(va, even, vb);
        z[t] = _mm512_permutex2var_ps(va, _mm512_add_epi32(even, _mm512_set1_epi32(1)), vb);
      }
    }
  }
#endif
};

// Checks scale_zero against K, N and group_size, then calls f(params) with the provider for its dtype.
template <class F>
void with_scale_zero(const torch::Tensor& scale_zero, int64_t N, int64_t K, int64_t group_size, F f) {
  TORCH_CHECK(N % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0, "K must be a multiple of an even group_size");
  TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.size(0) == K / group_size && scale_zero.size(1) == N &&
                  scale_zero.size(2) == 2 && scale_zero.is_contiguous(),
              "scale_zero: contiguous [K/group_size, N, 2]");
  switch (scale_zero.scalar_type()) {
    case torch::kFloat32: f(ScaleZeroParams<float>{scale_zero.data_ptr<float>(), N}); break;
    case torch::kBFloat16: f(ScaleZeroParams<c10::BFloat16>{scale_zero.data_ptr<c10::BFloat16>(), N}); break;
    case torch::kFloat16: f(ScaleZeroParams<c10::Half>{scale_zero.data_ptr<c10::Half>(), N}); break;
    default: TORCH_CHECK(false, "scale_zero: float32, bfloat16 or float16");
  }
}

}  // namespace
