// What the MX (OCP Microscaling) CPU kernels share (mx.cpp: the GEMV; mx_quant.cpp: activation
// quantization and weight dequantization): the element kinds, e8m0 scales, and the per-block
// quantization rule of tensors/mx.py (mx_quantize) in scalar C++. The NVFP4 kernels (nvfp4.cpp,
// nvfp4_quant.cpp) take its e2m1 and e4m3 pieces: rounding, decoding, lanes and GEMV tiles.
//
// Elements: kind 0 e2m1 (two codes per byte, the even element in the low nibble), 1 e4m3fn,
// 2 e5m2 (one byte each). Scales: one e8m0 code per 32 elements along K, 2^(code - 127), 255 NaN,
// 0 the float32 subnormal 2^-127.
//
// Quantizing a block V (mx.py's rule): amax = max |V| (NaN if any is NaN); a non-finite amax
// gives scale code 255 and zero elements; else e = floor(log2 amax) (frexp's exponent - 1),
// shared = clamp(e - emax, -127, 127), -127 for an all-zero block; q = V * 2^-shared (exact);
// each q is rounded to the nearest element value, ties to even, saturating at the largest
// normal. The rounding here adds and subtracts a power-of-two "magic" constant whose ulp is the
// element format's spacing at |q| (a float32 add rounds to nearest even), which picks the same
// value as torch's float32 -> float8 conversion after mx.py's clamp, and as mx.py's e2m1
// midpoint rule (a tie goes to the even code, which is the even multiple of the spacing).
// Internal linkage (an anonymous namespace), as in every header here.
#pragma once
#include <torch/types.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__SSE__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "simd.h"

namespace {

constexpr int64_t MX_BLOCK = 32;
enum MxKind : int64_t { MX_E2M1 = 0, MX_E4M3 = 1, MX_E5M2 = 2 };

// Per element kind: exponent of the largest normal, smallest normal exponent, mantissa bits,
// largest normal.
struct MxElem {
  int emax, emin, mbits;
  float max_normal;
};
inline MxElem mx_elem(int64_t kind) {
  switch (kind) {
    case MX_E2M1: return {2, 0, 1, 6.f};
    case MX_E4M3: return {8, -6, 3, 448.f};
    case MX_E5M2: return {15, -14, 2, 57344.f};
    default: TORCH_CHECK(false, "MX element kind: 0 (e2m1), 1 (e4m3fn) or 2 (e5m2), got ", kind);
  }
  return {};
}

inline float mx_bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}
inline uint32_t mx_float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

// 2^(code - 127) as float32, built from the bits (tensors/mx.py e8m0_to_float).
inline float e8m0_value(uint8_t c) {
  return mx_bits_float(c == 255 ? 0x7FC00000u : c == 0 ? 0x00400000u : uint32_t(c) << 23);
}

const float E2M1_VALUE[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

// f(T()) for the float dtype t: float, c10::BFloat16 or c10::Half.
template <class F>
void float_dtype(torch::ScalarType t, F f) {
  switch (t) {
    case torch::kFloat32: f(float()); break;
    case torch::kBFloat16: f(c10::BFloat16()); break;
    case torch::kFloat16: f(c10::Half()); break;
    default: TORCH_CHECK(false, "expected float32, bfloat16 or float16, got ", t);
  }
}

// Clears FTZ and DAZ for a scope: subnormal inputs, scales (2^-127) and products stay exact.
struct MxDenormalsKept {
#if defined(__SSE__) || defined(__AVX2__)
  unsigned int saved;
  MxDenormalsKept() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }
  ~MxDenormalsKept() { _mm_setcsr(saved); }
#endif
};

// One block's shared exponent and scale code (mx.py's rule). finite: false for a block holding
// inf or NaN (code 255).
struct MxBlockScale {
  int shared;
  uint8_t code;
  bool finite;
};
inline MxBlockScale mx_block_scale(const float* v, int64_t n, const MxElem& e) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i]);
    nan = nan || std::isnan(a);
    amax = std::max(amax, a);
  }
  if (nan || !std::isfinite(amax)) return {0, 255, false};
  int shared = -127;
  if (amax > 0.f) {
    int ex;
    std::frexp(amax, &ex);
    shared = std::min(std::max(ex - 1 - e.emax, -127), 127);
  }
  return {shared, static_cast<uint8_t>(shared + 127), true};
}

// q rounded to the element format (nearest, ties to even, saturating), sign kept (zero too).
inline float mx_round_elem(float q, const MxElem& e) {
  const uint32_t bits = mx_float_bits(q);
  const float a = mx_bits_float(bits & 0x7FFFFFFFu);
  const int exp = std::max(int((bits >> 23) & 0xFF) - 127, e.emin);  // |q| < 2^(emax + 1) here
  const float magic = mx_bits_float(uint32_t(exp - e.mbits + 23 + 127) << 23 | 0x400000u);  // 1.5 * 2^(spacing + 23)
  const float r = std::min((a + magic) - magic, e.max_normal);
  return mx_bits_float(mx_float_bits(r) | (bits & 0x80000000u));
}

// The e2m1 code (0..15) of a value mx_round_elem gave.
inline uint8_t e2m1_code(float r) {
  const float a = std::fabs(r);
  const uint8_t mag = a < 2.f ? uint8_t(a * 2.f) : a == 2.f ? 4 : a == 3.f ? 5 : a == 4.f ? 6 : 7;
  return static_cast<uint8_t>(mag | (std::signbit(r) ? 8 : 0));
}

// 2^n as float32 for n in [-126, 127] (mx.py _pow2).
inline float mx_pow2(int n) { return mx_bits_float(uint32_t(n + 127) << 23); }

// One block of n (<= 32) floats quantized: `elem[i]` gets each element's value (the rounded q,
// before the scale), and the block's scale. A non-finite block gives zeros.
inline MxBlockScale mx_quantize_block(const float* v, int64_t n, const MxElem& e, float* elem) {
  const MxBlockScale s = mx_block_scale(v, n, e);
  if (!s.finite) {
    for (int64_t i = 0; i < n; ++i) elem[i] = 0.f;
    return s;
  }
  const float inv = mx_pow2(-s.shared);
  for (int64_t i = 0; i < n; ++i) elem[i] = mx_round_elem(v[i] * inv, e);
  return s;
}

// One activation row as the reference's simulate_input_quantization gives it (quantized in
// blocks of 32 to element kind e, decoded in float32, rounded to the activation dtype T), back
// in float32: out[k] for k < K.
template <typename T>
inline void mx_fake_quantize_row(const float* x, int64_t K, const MxElem& e, float* out) {
  float elem[MX_BLOCK];
  for (int64_t k0 = 0; k0 < K; k0 += MX_BLOCK) {
    const int64_t n = std::min(MX_BLOCK, K - k0);
    const MxBlockScale s = mx_quantize_block(x + k0, n, e, elem);
    const float sv = e8m0_value(s.code);
    for (int64_t i = 0; i < n; ++i) out[k0 + i] = static_cast<float>(static_cast<T>(elem[i] * sv));
  }
}

// Checks an MX weight's fields against k and the element kind; returns N.
inline int64_t mx_check_weight(const torch::Tensor& qdata, const torch::Tensor& scale, int64_t kind, int64_t k) {
  mx_elem(kind);
  TORCH_CHECK(k > 0 && (kind != MX_E2M1 || k % 2 == 0), "k: positive (even for e2m1), got ", k);
  const int64_t kb = kind == MX_E2M1 ? k / 2 : k;
  TORCH_CHECK(qdata.element_size() == 1 && qdata.dim() == 2 && qdata.size(1) == kb,
              "qdata: 1-byte elements [N, ", kb, "], got ", qdata.dtype(), " ", qdata.sizes());
  const int64_t N = qdata.size(0), B = (k + MX_BLOCK - 1) / MX_BLOCK;
  TORCH_CHECK(scale.dtype() == torch::kUInt8 && scale.dim() == 2 && scale.size(0) == N && scale.size(1) == B,
              "scale: uint8 [", N, ", ", B, "], got ", scale.dtype(), " ", scale.sizes());
  return N;
}

// ---------------------------------------------------------------------- decoding in registers
// A block's 32 weights as two vfloats (simd.h: 16 float32 lanes) w0, w1, each the element's
// value times the block's scale, in float32 (one rounding: the reference's dequantized weight).
//   e2m1: 16 bytes; lane j of w0 is element 2j (byte j's low nibble), of w1 element 2j + 1.
//         A table of the 16 values times the scale, indexed by the nibble: AVX-512's vpermps
//         takes 16 entries (sign included); AVX2's takes 8 magnitudes, and the sign comes from
//         the nibble's bit 3 moved to bit 31 by `code << 28`, which also puts the magnitude bits
//         at 28..30: the table holds each entry's bits XOR (index << 28), which that XOR cancels.
//   e4m3 / e5m2: 32 bytes; lane j of w0 is element j, of w1 element 16 + j. The code's exponent
//         and mantissa bits shifted into a float32's (shift 20 / 21) give the value times 2^-120
//         / 2^-112, exactly, subnormal codes included (DAZ must be off); times 2^120 / 2^112
//         (exact), times the scale.
// Element codes that are not finite (e4m3fn 0x7F/0xFF, e5m2 0x7C-0x7F/0xFC-0xFF: mx.py's encoder
// saturates and never writes them; the loader refuses them, core/primitives.py
// check_float8_codes_finite) decode to finite values here.
#if defined(__AVX2__)
#if defined(__AVX512F__)
using Fp4Table = __m512;
inline Fp4Table fp4_table(float s) { return _mm512_mul_ps(_mm512_loadu_ps(E2M1_VALUE), _mm512_set1_ps(s)); }
inline void fp4_decode(const uint8_t* p, const Fp4Table& t, vfloat& w0, vfloat& w1) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  w0 = _mm512_permutexvar_ps(b, t);
  w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), t);
}
inline __m512 fp8_lanes(const uint8_t* p, int shift) {
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return shift == 20 ? _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(int(0x87F00000u))))
                     : _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 21), _mm512_set1_epi32(int(0x8FE00000u))));
}
inline vfloat fp8_decode16(const uint8_t* p, int shift, __m512 factor, __m512 s) {
  return _mm512_mul_ps(_mm512_mul_ps(fp8_lanes(p, shift), factor), s);
}
#else
using Fp4Table = __m256;
inline Fp4Table fp4_table(float s) {
  const __m256i pre = _mm256_setr_epi32(0, 1 << 28, 2 << 28, 3 << 28, 4 << 28, 5 << 28, 6 << 28, 7 << 28);
  const __m256 mag = _mm256_mul_ps(_mm256_loadu_ps(E2M1_VALUE), _mm256_set1_ps(s));
  return _mm256_xor_ps(mag, _mm256_castsi256_ps(pre));
}
inline __m256 fp4_lookup(__m256i idx, __m256 t) {
  return _mm256_xor_ps(_mm256_permutevar8x32_ps(t, idx), _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));
}
inline void fp4_decode(const uint8_t* p, const Fp4Table& t, vfloat& w0, vfloat& w1) {
  const __m256i lo = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m256i hi = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)));
  w0 = {fp4_lookup(lo, t), fp4_lookup(hi, t)};
  w1 = {fp4_lookup(_mm256_srli_epi32(lo, 4), t), fp4_lookup(_mm256_srli_epi32(hi, 4), t)};
}
inline __m256 fp8_lanes8(const uint8_t* p, int shift) {
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return shift == 20 ? _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(int(0x87F00000u))))
                     : _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 21), _mm256_set1_epi32(int(0x8FE00000u))));
}
inline vfloat fp8_decode16(const uint8_t* p, int shift, __m256 factor, __m256 s) {
  return {_mm256_mul_ps(_mm256_mul_ps(fp8_lanes8(p, shift), factor), s),
          _mm256_mul_ps(_mm256_mul_ps(fp8_lanes8(p + 8, shift), factor), s)};
}
#endif
// 32 e2m1 weights in element order from fp4_decode's lanes (w0 the even elements, w1 the odd).
inline void store_interleaved(float* o, const vfloat& e, const vfloat& d) {
#if defined(__AVX512F__)
  const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  _mm512_storeu_ps(o, _mm512_permutex2var_ps(e, lo, d));
  _mm512_storeu_ps(o + 16, _mm512_permutex2var_ps(e, hi, d));
#else
  const __m256 halves[2][2] = {{e.lo, d.lo}, {e.hi, d.hi}};
  for (int h = 0; h < 2; ++h) {
    const __m256 a = _mm256_unpacklo_ps(halves[h][0], halves[h][1]), b = _mm256_unpackhi_ps(halves[h][0], halves[h][1]);
    _mm256_storeu_ps(o + 16 * h, _mm256_permute2f128_ps(a, b, 0x20));
    _mm256_storeu_ps(o + 16 * h + 8, _mm256_permute2f128_ps(a, b, 0x31));
  }
#endif
}
#endif

// The same values one at a time (tails and the generic build).
inline float fp8_value(uint8_t c, int shift) {
  const float trick = mx_bits_float((uint32_t(c & 0x80) << 24) | (uint32_t(c & 0x7F) << shift));
  return trick * (shift == 20 ? 0x1p120f : 0x1p112f);
}
inline float mx_elem_value(const uint8_t* row, int64_t kind, int64_t k) {
  if (kind == MX_E2M1) return E2M1_VALUE[(k & 1) ? row[k >> 1] >> 4 : row[k >> 1] & 15];
  return fp8_value(row[k], kind == MX_E4M3 ? 20 : 21);
}


// ---------------------------------------------------------------------- e2m1 GEMV tiles
// What the e2m1 GEMVs share (mx.cpp: MXFP4, a scale per 32; nvfp4.cpp: NVFP4, a scale per 16),
// in chunks of 128 elements (64 bytes): the chunk's bytes load as 16 32-bit lanes, lane i holding
// elements 8i .. 8i + 7 in its eight nibbles, so `lane >> 4u` has element 8i + u's code in its low
// four bits for every lane at once; the e2m1 table above (vpermps; AVX2's 8-entry one takes the
// sign from the code) gives the value. A block of 32 is four lanes, a block of 16 two. Per chunk
// and lane the eight products x * value are added into a partial sum in the order
// u = 4, 0, 5, 1, 6, 2, 7, 3, the partial sum times its block's scale into the lane's total (one
// FMA); each output is its 16 lanes' sum (simd.h vsum). The AVX2 build computes the same lanes in
// two 8-lane halves with the same operations: both builds give the same outputs. Tiles of NR
// weight rows x MB activation rows share each decoded weight vector and activation load.
constexpr int64_t FP4_CHUNK = 128;  // e2m1 elements per 64-byte chunk

// The activation rows laid out for fp4_tile, zero past K: x float32 [M, K]; xp [M, ld], ld a
// multiple of FP4_CHUNK: per chunk, xp[128c + 16u + i] = x[128c + 8i + u].
inline void fp4_layout_rows(const float* x, float* xp, int64_t M, int64_t K, int64_t ld) {
  for (int64_t m = 0; m < M; ++m) {
    const float* s = x + m * K;
    float* d = xp + m * ld;
    for (int64_t c = 0; c < ld; c += FP4_CHUNK)
      for (int64_t u = 0; u < 8; ++u)
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t k = c + 8 * i + u;
          d[c + 16 * u + i] = k < K ? s[k] : 0.f;
        }
  }
}

// Where each weight row of a tile reads: the row, a zero-padded copy of its last partial chunk
// (or block), and its scales as float32 per block (for fp4_tile: zeros past the row's end, to
// whole chunks).
struct RowView {
  const uint8_t* row;
  const uint8_t* tail;
  const float* sf;
};

#if defined(__AVX2__)
#if defined(__AVX512F__)
using vint = __m512i;
inline vint load_lanes(const uint8_t* p) { return _mm512_loadu_si512(p); }
using E2m1Table = __m512;  // the 16 values
inline E2m1Table e2m1_table() { return _mm512_loadu_ps(E2M1_VALUE); }
inline vfloat e2m1_lanes(const vint& v, int u, const E2m1Table& table) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4 * u), table);
}
#else
struct vint {
  __m256i lo, hi;
};
inline vint load_lanes(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
using E2m1Table = __m256;  // the 8 magnitudes, bits XOR (index << 28) (above)
inline E2m1Table e2m1_table() { return fp4_table(1.f); }
inline vfloat e2m1_lanes(const vint& v, int u, const E2m1Table& table) {
  return {fp4_lookup(_mm256_srli_epi32(v.lo, 4 * u), table), fp4_lookup(_mm256_srli_epi32(v.hi, 4 * u), table)};
}
#endif

// The 16 lanes' scales of a chunk from its blocks' (BPC = 4 blocks of 32: lane i gets block
// i / 4; BPC = 8 blocks of 16: block i / 2).
template <int BPC>
inline vfloat fp4_chunk_scales(const float* s) {
  static_assert(BPC == 4 || BPC == 8, "blocks per chunk: 4 or 8");
#if defined(__AVX512F__)
  if (BPC == 4)
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
                                 _mm512_castps128_ps512(_mm_loadu_ps(s)));
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7),
                               _mm512_castps256_ps512(_mm256_loadu_ps(s)));
#else
  if (BPC == 4) {
    const __m256 v = _mm256_castps128_ps256(_mm_loadu_ps(s));
    return {_mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1)),
            _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3))};
  }
  const __m256 v = _mm256_loadu_ps(s);
  return {_mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3)),
          _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7))};
#endif
}

// out[i * NR + r] = activation row i (xp, laid out by fp4_layout_rows, ldx floats apart) . weight
// row r, over `chunks` chunks of which the first `full` are read from the row, the last from its
// tail; the rows' sf hold BPC scales per chunk.
constexpr int64_t kFp4Prefetch = 8;  // chunks ahead (fp4_tile)

template <int NR, int MB, int BPC>
void fp4_tile(const RowView* rows, int64_t chunks, int64_t full, const float* xp, int64_t ldx, float* out) {
  static constexpr int order[8] = {4, 0, 5, 1, 6, 2, 7, 3};
  const E2m1Table table = e2m1_table();
  vfloat total[MB][NR];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NR; ++r) total[i][r] = vzero();
  for (int64_t c = 0; c < chunks; ++c) {
    vint v[NR];
    for (int r = 0; r < NR; ++r) v[r] = load_lanes(c < full ? rows[r].row + c * 64 : rows[r].tail);
    // The tile's NR rows are NR interleaved streams within one 4 KB page (rows of K / 2 bytes),
    // which the hardware prefetcher follows poorly: the loads above stalled on memory (a third of
    // the GEMV's samples under perf). Asking for each row's chunk 8 ahead (512 bytes) took the
    // MXFP4 GEMV from 0.56 to 0.45 ms (2048x5632, batch 1, one thread, AVX-512 Xeon; 4 and 16
    // ahead measured the same). A prefetch past a row's end touches the next row, never faults,
    // and changes no value.
    for (int r = 0; r < NR; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(rows[r].row + (c + kFp4Prefetch) * 64), _MM_HINT_T0);
    vfloat part[MB][NR];
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < NR; ++r) part[i][r] = vzero();
    for (int s = 0; s < 8; ++s) {
      const int u = order[s];
      vfloat w[NR];
      for (int r = 0; r < NR; ++r) w[r] = e2m1_lanes(v[r], u, table);
      for (int i = 0; i < MB; ++i) {
        const vfloat xv = vload(xp + i * ldx + c * FP4_CHUNK + 16 * u);
        for (int r = 0; r < NR; ++r) part[i][r] = vfma(xv, w[r], part[i][r]);
      }
    }
    for (int r = 0; r < NR; ++r) {
      const vfloat sv = fp4_chunk_scales<BPC>(rows[r].sf + c * BPC);
      for (int i = 0; i < MB; ++i) total[i][r] = vfma(part[i][r], sv, total[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NR; ++r) out[i * NR + r] = vsum(total[i][r]);
}
#endif

}  // namespace
