// AVX2 building blocks shared by the CPU kernels. Internal linkage (an anonymous namespace):
// each translation unit gets its own copy, compiled with that unit's instruction-set flags.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// A bf16 (raw bits) as float32: its top half, exact.
inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
// acc + vpdpwssd(a, b) (AVX-512 VNNI), written as inline asm that updates acc's register in place:
// with _mm512_dpwssd_epi32, GCC 12 copied every loop-carried accumulator into a second register
// and back around each vpdpwssd (two register moves per multiply-add in the int4 and int8
// GEMVs' inner loops).
__attribute__((always_inline)) inline __m512i dpwssd512(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}
// acc + vpdpbusd(u, s) (unsigned bytes of u times signed bytes of s), likewise.
__attribute__((always_inline)) inline __m512i dpbusd512(__m512i acc, __m512i u, __m512i s) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s));
  return acc;
}
#endif

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

// Sixteen float32 lanes for `dot_tile4`: one AVX-512 register, or two AVX2 ones. Both builds
// add the same products in the same order (lane l sums columns k = l mod 16; vsum adds the upper
// eight lanes onto the lower, then hsum), so their outputs are bit for bit equal.
constexpr int kLanes = 16;
#if defined(__AVX512F__)
using vfloat = __m512;
inline vfloat vzero() { return _mm512_setzero_ps(); }
inline vfloat vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vfloat v) { _mm512_storeu_ps(p, v); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return _mm512_fmadd_ps(a, b, c); }
inline vfloat vscale(vfloat v, float f) { return _mm512_mul_ps(v, _mm512_set1_ps(f)); }
inline float vsum(vfloat v) { return hsum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1))); }
inline vfloat vadd(vfloat a, vfloat b) { return _mm512_add_ps(a, b); }
inline vfloat vsub(vfloat a, vfloat b) { return _mm512_sub_ps(a, b); }
inline vfloat vmul(vfloat a, vfloat b) { return _mm512_mul_ps(a, b); }
inline vfloat vbroadcast(float f) { return _mm512_set1_ps(f); }
#else
struct vfloat {
  __m256 lo, hi;
};
inline vfloat vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vfloat vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, vfloat v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
inline vfloat vfma(vfloat a, vfloat b, vfloat c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vfloat vscale(vfloat v, float f) {
  const __m256 s = _mm256_set1_ps(f);
  return {_mm256_mul_ps(v.lo, s), _mm256_mul_ps(v.hi, s)};
}
inline float vsum(vfloat v) { return hsum(_mm256_add_ps(v.lo, v.hi)); }
inline vfloat vadd(vfloat a, vfloat b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vfloat vsub(vfloat a, vfloat b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline vfloat vmul(vfloat a, vfloat b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vfloat vbroadcast(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
#endif

// The kLanes bf16 values (raw bits) at p as float32: each widened exactly, in registers.
inline vfloat bf16_lanes(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#else
  auto x8 = [](const uint16_t* q) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 16));
  };
  return {x8(p), x8(p + 8)};
#endif
}

// Software prefetch in the batch-1 GEMVs (`dot_rows`) and the few-row tiles (`dot_tile4`): while a
// block of NR weight rows is read, each row's stream asks for the same column of the row NR
// further on, i.e. the next block's lines, one block (8 KB-45 KB) ahead. A block's NR rows are
// NR interleaved streams of K bytes each, too short (2 KB at K = 2048) for the hardware
// prefetcher to keep enough lines in flight: without prefetch the int8 GEMV read DRAM at about
// half bf16's rate on the AVX-512 VM (weights past its L3). The previous distance, 384 bytes
// ahead in the same row, was measured against this one on that VM, int8 [5632, 2048] weights
// cycled from DRAM at batch 1: 16.8-18.3 against 19.5-21.4 GB/s through the module (five runs
// each, alternated); 19.0 against 21.5-21.9 GB/s in a standalone C++ loop (and 15.7 without
// prefetch; docs/performance.md has the variants tried beside it). The lines go into L2, not L1:
// a block ahead is 16 KB or more of one-byte codes, half an L1 or more, and on the AMD EPYC Zen 4
// (weights cycled from DRAM, 2 threads, both builds alternated in one process, 10 rounds) L2 read
// the int8 GEMV 1.42x as fast at 1 and 4 rows ([5632, 2048]; [2048, 5632] 1.22x), int8dyn 1.43x
// and float8 1.40x at 1 row (1.05x at 4), every round faster (docs/performance.md, "Prefetch into
// L2"); dense.cpp's bf16 rows had measured the same way (26-27 against 22.5-23 GB/s). A prefetch
// never faults (the last block's reach past the tensor's end touches nothing it needs) and
// changes no value.

// Weight rows per `dot_rows` call in the batch-1 GEMVs: eight on AVX-512 (one zmm accumulator a
// row, of 32 registers); four on AVX2, whose 16 registers eight rows' two-register accumulators
// would fill. A row's value is the same either way.
#if defined(__AVX512F__)
constexpr int kDotRows = 8;
#else
constexpr int kDotRows = 4;
#endif

// One activation row x against NR weight rows of codes (one byte, or a bf16 in dense.cpp) starting
// at r0 (rows K apart): each x vector is loaded once for the NR rows. widen(p) gives the float32 values of the kLanes codes
// at p, widen1(c) of one code; out gets the NR dot products. Lane l sums the columns k = l mod 16
// of the full 16-column blocks, vsum adds the lanes, the tail columns are added one by one: the
// same order in the AVX2 and AVX-512 builds and for every NR, so each row's value does not depend
// on how many rows it was computed with.
template <int NR, typename T, class Widen, class Widen1>
inline void dot_rows(const float* x, const T* r0, int64_t K, const Widen& widen, const Widen1& widen1, float* out) {
  vfloat acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (((k * int64_t(sizeof(T))) & 63) == 0)  // once per 64-byte line of each row
      for (int r = 0; r < NR; ++r) {
        _mm_prefetch(reinterpret_cast<const char*>(r0 + (NR + r) * K + k), _MM_HINT_T1);
      }
    const vfloat xv = vload(x + k);
    for (int r = 0; r < NR; ++r) acc[r] = vfma(xv, widen(r0 + r * K + k), acc[r]);
  }
  for (int r = 0; r < NR; ++r) out[r] = vsum(acc[r]);
  for (; k < K; ++k)
    for (int r = 0; r < NR; ++r) out[r] += x[k] * widen1(r0[r * K + k]);
}

// Activation rows per register tile in `dot_tile4`: with AVX-512's 32 vector registers six
// (24 accumulators, 4 weight vectors, 1 activation vector); with AVX2's 16, one. The tile does
// not change any output's value.
#if defined(__AVX512F__)
constexpr int kTileRows = 6;
#else
constexpr int kTileRows = 1;
#endif

// MB activation rows (x, rows ldx apart) against four weight rows w[0..3] of K columns (pointers: a tail block
// may repeat a row): each weight vector is widened once for the MB rows and each x vector loaded
// once for the four weight rows, so the weight is read once per MB activation rows. widen(p)
// gives the float32 values of the kLanes codes at p, widen1(c) of one code. out[i * 4 + j] gets
// the dot product of activation row i with weight row j, accumulated in float32.
// With Prefetch (one-byte codes read from the weight itself, not a widened buffer), each weight
// row's stream is prefetched `ahead` bytes on (the next block's rows, as in dot_rows).
template <int MB, bool Prefetch = false, typename T, class Widen, class Widen1>
inline void dot_tile4(const float* x, int64_t ldx, const T* const* w, int64_t K, const Widen& widen,
                      const Widen1& widen1, float* out, int64_t ahead = 0) {
  static_assert(!Prefetch || sizeof(T) == 1, "dot_tile4 prefetches by bytes: one-byte codes");
  vfloat acc[MB][4];
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) acc[i][j] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (Prefetch && (k & 63) == 0)
      for (int j = 0; j < 4; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + ahead + k), _MM_HINT_T1);
    const vfloat w0 = widen(w[0] + k), w1 = widen(w[1] + k), w2 = widen(w[2] + k), w3 = widen(w[3] + k);
    for (int i = 0; i < MB; ++i) {
      const vfloat xv = vload(x + i * ldx + k);
      acc[i][0] = vfma(xv, w0, acc[i][0]);
      acc[i][1] = vfma(xv, w1, acc[i][1]);
      acc[i][2] = vfma(xv, w2, acc[i][2]);
      acc[i][3] = vfma(xv, w3, acc[i][3]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int j = 0; j < 4; ++j) out[i * 4 + j] = vsum(acc[i][j]);
  for (; k < K; ++k)
    for (int j = 0; j < 4; ++j) {
      const float wk = widen1(w[j][k]);
      for (int i = 0; i < MB; ++i) out[i * 4 + j] += x[i * ldx + k] * wk;
    }
}

// One tile of mb (1..kTileRows) activation rows: dot_tile4 with the row count as a constant.
template <bool Prefetch = false, typename T, class Widen, class Widen1>
inline void dot_tile4_rows(int mb, const float* x, int64_t ldx, const T* const* w, int64_t K, const Widen& widen,
                           const Widen1& widen1, float* out, int64_t ahead = 0) {
  switch (mb) {
    case 1: dot_tile4<1, Prefetch>(x, ldx, w, K, widen, widen1, out, ahead); break;
#if defined(__AVX512F__)
    case 2: dot_tile4<2, Prefetch>(x, ldx, w, K, widen, widen1, out, ahead); break;
    case 3: dot_tile4<3, Prefetch>(x, ldx, w, K, widen, widen1, out, ahead); break;
    case 4: dot_tile4<4, Prefetch>(x, ldx, w, K, widen, widen1, out, ahead); break;
    case 5: dot_tile4<5, Prefetch>(x, ldx, w, K, widen, widen1, out, ahead); break;
#endif
    default: dot_tile4<kTileRows, Prefetch>(x, ldx, w, K, widen, widen1, out, ahead); break;
  }
}

// All M activation rows against weight rows [4 * b0, 4 * b1) of q ([N, K], rows K apart), in
// tiles of four weight rows by up to kTileRows activation rows; store(m, n, dot) takes each
// float32 dot product, the sum of its kChunk-column chunks' partial sums. Weight rows past N
// repeat row N - 1 and are not stored. Up to kTileRows rows: one tile, widening in registers.
// More: per chunk of kChunk columns the four weight rows
// are widened once into a float32 buffer that every tile then reads (the widening would
// otherwise be repeated per tile), and the chunks' float32 partial sums are added. The widening
// asks for the next block's line into L2 as it reads each line, as dot_tile4 does: without it the
// loads waited on memory (a third of the time, perf), and with it float8 [5632, 2048] from DRAM
// ran 1.15-1.19x as fast at 7-16 rows on the AMD EPYC Zen 4 (AVX-512, 2 threads), and 1.05-1.25x
// at 2-32 rows in the AVX2 build there, where every call of two rows or more comes here.
template <typename T, class Widen, class Widen1, class Store>
inline void tiled_dots(const float* x, const T* q, int64_t M, int64_t N, int64_t K, int64_t b0, int64_t b1,
                       const Widen& widen, const Widen1& widen1, const Store& store) {
  constexpr int64_t kChunk = 512;  // 4 widened rows (8 KB) and 16 activation rows (32 KB) stay in L1
  alignas(64) float wbuf[4 * kChunk];
  float d[kTileRows * 4];
  std::vector<float> sums(M * 4);
  const auto vcopy = [](const float* p) { return vload(p); };
  const auto same = [](float v) { return v; };
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t n0 = 4 * b;
    const T* w[4];
    for (int j = 0; j < 4; ++j) w[j] = q + std::min<int64_t>(n0 + j, N - 1) * K;
    const int nj = static_cast<int>(std::min<int64_t>(4, N - n0));
    std::fill(sums.begin(), sums.end(), 0.f);
    if (M <= kTileRows) {  // one tile, widening in registers; the same chunked sums
      for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
        const T* wk[4] = {w[0] + k0, w[1] + k0, w[2] + k0, w[3] + k0};
        dot_tile4_rows<sizeof(T) == 1>(static_cast<int>(M), x + k0, K, wk, std::min<int64_t>(kChunk, K - k0), widen,
                                       widen1, d, 4 * K * static_cast<int64_t>(sizeof(T)));
        for (int64_t i = 0; i < M * 4; ++i) sums[i] += d[i];
      }
      for (int i = 0; i < M; ++i)
        for (int j = 0; j < nj; ++j) store(i, n0 + j, sums[i * 4 + j]);
      continue;
    }
    for (int64_t k0 = 0; k0 < K; k0 += kChunk) {
      const int64_t len = std::min<int64_t>(kChunk, K - k0);
      for (int j = 0; j < 4; ++j) {
        float* o = wbuf + j * kChunk;
        int64_t k = 0;
        for (; k + kLanes <= len; k += kLanes) {
          if ((((k0 + k) * int64_t(sizeof(T))) & 63) == 0)  // the next block's line, as dot_tile4's
            _mm_prefetch(reinterpret_cast<const char*>(w[j] + 4 * K + k0 + k), _MM_HINT_T1);
          vstore(o + k, widen(w[j] + k0 + k));
        }
        for (; k < len; ++k) o[k] = widen1(w[j][k0 + k]);
      }
      const float* wf[4] = {wbuf, wbuf + kChunk, wbuf + 2 * kChunk, wbuf + 3 * kChunk};
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int mb = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
        dot_tile4_rows(mb, x + m0 * K + k0, K, wf, len, vcopy, same, d);
        for (int i = 0; i < mb; ++i)
          for (int j = 0; j < 4; ++j) sums[(m0 + i) * 4 + j] += d[i * 4 + j];
      }
    }
    for (int64_t m = 0; m < M; ++m)
      for (int j = 0; j < nj; ++j) store(m, n0 + j, sums[m * 4 + j]);
  }
}
#endif

}  // namespace
