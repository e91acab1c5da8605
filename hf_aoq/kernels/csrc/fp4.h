// What the e2m1 (FP4, two codes per byte, the even element in the low nibble) GEMVs share: the
// activation permutation that matches the weight's 32-bit lanes, the exact table decode of eight
// codes at once, and keeping denormals for the duration of a call. nvfp4.cpp uses it; mx.cpp holds
// the same pieces in its own file for now (it is being optimised separately) and can include this.
//
// 32 bytes of a weight row (64 elements) load as eight 32-bit lanes; lane j holds elements
// 8j .. 8j + 7, element 8j + t in nibble t. So (lane >> 4t) has element 8j + t's code in its low
// four bits, for every lane at once. Its magnitude comes from an 8-entry table by the low three
// bits (vpermps ignores the others), its sign is the code's bit 3 moved to bit 31 by
// (lane >> 4t) << 28. That shift also moves the magnitude bits to bits 28..30, so the table holds
// each magnitude's bits XOR (index << 28), which the same XOR cancels: exact e2m1 values.
#pragma once
#include <cstdint>
#include <cstring>
#if defined(__SSE__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace hf_aoq_fp4 {

constexpr int64_t CHUNK = 64;  // elements per 32-byte load
const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

struct DenormalsKept {
#if defined(__SSE__) || defined(__AVX2__)
  unsigned int saved;
  DenormalsKept() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }  // clear FTZ and DAZ
  ~DenormalsKept() { _mm_setcsr(saved); }
#endif
};

// Activation rows [M, K] (float32) as [M, chunks, 8 (t), L (j)] with L = chunk / 8 lanes (8 for a
// 32-byte load, 16 for a 64-byte one): x[chunk * c + 8j + t], zero past K.
inline void permute_rows(const float* x, float* xp, int64_t M, int64_t K, int64_t chunks, int64_t chunk = CHUNK) {
  const int64_t lanes = chunk / 8;
  for (int64_t m = 0; m < M; ++m) {
    const float* s = x + m * K;
    float* d = xp + m * chunks * chunk;
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t t = 0; t < 8; ++t)
        for (int64_t j = 0; j < lanes; ++j) {
          const int64_t k = c * chunk + 8 * j + t;
          d[c * chunk + lanes * t + j] = k < K ? s[k] : 0.f;
        }
  }
}

// The activation value the scalar code pairs with element k (the permuted layout above).
inline float permuted(const float* xp_row, int64_t k, int64_t chunk = CHUNK) {
  const int64_t c = k / chunk, r = k % chunk;
  return xp_row[c * chunk + (chunk / 8) * (r % 8) + r / 8];
}

#if defined(__AVX2__)
inline __m256 e2m1_table() {
  alignas(32) static const uint32_t table_bits[8] = {
      0x00000000u ^ (0u << 28), 0x3F000000u ^ (1u << 28), 0x3F800000u ^ (2u << 28), 0x3FC00000u ^ (3u << 28),
      0x40000000u ^ (4u << 28), 0x40400000u ^ (5u << 28), 0x40800000u ^ (6u << 28), 0x40C00000u ^ (7u << 28)};
  return _mm256_load_ps(reinterpret_cast<const float*>(table_bits));
}

// Element 8j + T of each lane j of `v` (32 bytes of a row), exactly.
template <int T>
inline __m256 e2m1_decode(__m256i v, __m256 table) {
  const __m256i idx = T ? _mm256_srli_epi32(v, 4 * T) : v;
  const __m256 mag = _mm256_permutevar8x32_ps(table, idx);
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}

// 32 bytes of a row at byte `c * 32`: a full load, or the row's last partial chunk zero-padded.
inline __m256i load_chunk(const uint8_t* row, int64_t c, int64_t row_bytes) {
  if ((c + 1) * 32 <= row_bytes) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
  alignas(32) uint8_t tail[32] = {0};
  std::memcpy(tail, row + c * 32, size_t(row_bytes - c * 32));
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
}
#endif

}  // namespace hf_aoq_fp4
