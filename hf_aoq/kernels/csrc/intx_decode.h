// The SIMD decoding of IntxTensor's bit streams for csrc/intx.cpp's GEMV (the layout of a
// decoded block is described at the top of intx.cpp): 32 int16 lanes as one zmm (AVX-512 build)
// or two ymm (AVX2 build), in the same lane order, so that both builds compute the same sums.
// Internal linkage (an anonymous namespace), as in every header here.
#pragma once
#include <cstdint>
#include <utility>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "simd.h"  // vfloat: 16 float32 lanes

namespace {

// Per bit width B: P codes per 16-bit lane, blocks of 32 * P columns (4 * P * B bytes).

template <int B>
struct Layout {
  static constexpr int P = B == 1 ? 16 : B == 2 ? 8 : (B == 3 || B == 4) ? 4 : B == 7 ? 1 : 2;
  static constexpr int64_t BLOCK = 32 * P;  // columns
  static constexpr bool IDENTITY = 16 % B == 0;
  static constexpr int BASE = 16 - P * B;
  static constexpr int64_t READ = 64;  // bytes a block's load may touch from its start
};

#if defined(__AVX2__)
// 32 int16 lanes (one zmm, or two ymm: lanes 0-15 and 16-31), and 16 int32 lanes likewise.
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HF_AOQ_INTX_ZMM 1
using vi16 = __m512i;
using vi32 = __m512i;
inline vi16 load16(const void* p) { return _mm512_loadu_si512(p); }
inline vi32 izero() { return _mm512_setzero_si512(); }
template <int S>
inline vi16 srl16(vi16 v) { return _mm512_srli_epi16(v, S); }
inline vi16 and16(vi16 v, int m) { return _mm512_and_si512(v, _mm512_set1_epi16(static_cast<int16_t>(m))); }
inline vi32 madd_acc(vi32 acc, vi16 a, vi16 b) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, a, b);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
#endif
}
inline vfloat to_vfloat(vi32 v) { return _mm512_cvtepi32_ps(v); }
#else
#define HF_AOQ_INTX_ZMM 0
struct vi16 {
  __m256i lo, hi;
};
using vi32 = vi16;
inline vi16 load16(const void* p) {
  const __m256i* q = static_cast<const __m256i*>(p);
  return {_mm256_loadu_si256(q), _mm256_loadu_si256(q + 1)};
}
inline vi32 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
template <int S>
inline vi16 srl16(vi16 v) { return {_mm256_srli_epi16(v.lo, S), _mm256_srli_epi16(v.hi, S)}; }
inline vi16 and16(vi16 v, int m) {
  const __m256i k = _mm256_set1_epi16(static_cast<int16_t>(m));
  return {_mm256_and_si256(v.lo, k), _mm256_and_si256(v.hi, k)};
}
inline vi32 madd_acc(vi32 acc, vi16 a, vi16 b) {
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
inline vfloat to_vfloat(vi32 v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
#endif

// The permute, shuffle and multiply that spread a block's bytes into aligned 16-bit lanes (the
// top of intx.cpp); identity for b = 1, 2, 4, 8.
template <int B>
struct Spread {
  using Lay = Layout<B>;
  alignas(64) int32_t perm[16];      // zmm: dword of the block for each dword of the vector
  alignas(64) int32_t perm_h[2][8];  // ymm halves, relative to half_off[h] / 4
  int64_t half_off[2];
  alignas(64) uint8_t shuf[64];
  alignas(64) uint16_t mult[32];
  Spread() {
    constexpr int P = Lay::P;
    for (int i = 0; i < 4; ++i) {  // 128-bit quarter i: P * B bytes from byte i * P * B
      const int start = i * P * B, dw = start / 4, rel = start - 4 * dw;
      for (int d = 0; d < 4; ++d) perm[4 * i + d] = dw + d;
      for (int s = 0; s < 8; ++s) {
        const int bit = s * P * B, byte = bit / 8, o = bit % 8;
        shuf[16 * i + 2 * s] = static_cast<uint8_t>(rel + byte);
        shuf[16 * i + 2 * s + 1] = static_cast<uint8_t>(rel + byte + 1);
        mult[8 * i + s] = static_cast<uint16_t>(1u << (Lay::BASE - o));
      }
    }
    for (int h = 0; h < 2; ++h) {
      half_off[h] = 4 * int64_t(perm[8 * h]);
      for (int d = 0; d < 8; ++d) perm_h[h][d] = perm[8 * h + d] - perm[8 * h];
    }
  }
  inline vi16 load(const uint8_t* p) const {
    if constexpr (Lay::IDENTITY) {
      return load16(p);
    } else {
#if HF_AOQ_INTX_ZMM
      __m512i v = _mm512_permutexvar_epi32(_mm512_load_si512(perm), _mm512_loadu_si512(p));
      v = _mm512_shuffle_epi8(v, _mm512_load_si512(shuf));
      return _mm512_mullo_epi16(v, _mm512_load_si512(mult));
#else
      __m256i h[2];
      for (int i = 0; i < 2; ++i) {
        __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + half_off[i]));
        v = _mm256_permutevar8x32_epi32(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(perm_h[i])));
        v = _mm256_shuffle_epi8(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(shuf + 32 * i)));
        h[i] = _mm256_mullo_epi16(v, _mm256_load_si256(reinterpret_cast<const __m256i*>(mult + 16 * i)));
      }
      return {h[0], h[1]};
#endif
    }
  }
};

// Code t of every lane of a spread block.
template <int B, int T>
inline vi16 code_t(vi16 v) {
  constexpr int shift = Layout<B>::BASE + T * B;
  constexpr bool top = T == Layout<B>::P - 1;
  if constexpr (top) return srl16<shift>(v);
  else if constexpr (shift == 0) return and16(v, (1 << B) - 1);
  else return and16(srl16<shift>(v), (1 << B) - 1);
}

template <int B, int MB, int... T>
inline void block_dots(vi16 v, const int16_t* const* xs, vi32* acc, std::integer_sequence<int, T...>) {
  auto one = [&](auto tc) {
    constexpr int t = decltype(tc)::value;
    const vi16 c = code_t<B, t>(v);
    for (int i = 0; i < MB; ++i) acc[i] = madd_acc(acc[i], c, load16(xs[i] + 32 * t));
  };
  (one(std::integral_constant<int, T>()), ...);
}

// The low and high nibbles of 16 bytes at p as float32 lanes (IntxDQTensor's group indices:
// scale index low, centre index high).
inline void nibbles16(const uint8_t* p, vfloat& lo, vfloat& hi) {
#if HF_AOQ_INTX_ZMM
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
#else
  const __m256i k = _mm256_set1_epi32(15);
  const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  lo = {_mm256_cvtepi32_ps(_mm256_and_si256(a, k)), _mm256_cvtepi32_ps(_mm256_and_si256(b, k))};
  hi = {_mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4))};
#endif
}

// 16 floats, lane j = t[idx[j]] with idx[j] < 16 (lanes 0-7 from t[0..7], 8-15 from t[h..h+7]).
struct LaneScale {
  alignas(64) int32_t idx[16];
  int64_t h;
  inline vfloat get(const float* t) const {
#if HF_AOQ_INTX_ZMM
    return _mm512_permutexvar_ps(_mm512_load_si512(idx), _mm512_loadu_ps(t));
#else
    const __m256i lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(idx));
    const __m256i hi = _mm256_sub_epi32(_mm256_load_si256(reinterpret_cast<const __m256i*>(idx + 8)), _mm256_set1_epi32(int(h)));
    return {_mm256_permutevar8x32_ps(_mm256_loadu_ps(t), lo), _mm256_permutevar8x32_ps(_mm256_loadu_ps(t + h), hi)};
#endif
  }
};
#endif  // __AVX2__

}  // namespace
