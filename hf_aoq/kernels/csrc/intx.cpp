// IntxTensor's CPU kernels (1-8 bit codes, canonical layout: per row a little-endian bit stream,
// the code of column k at stream bits [k*b, (k+1)*b)): F.linear in one call, and the weight
// dequantized exactly as the reference does it. IntxDQTensor's 2- and 3-bit codes are the same
// bit streams: the same kernels, with its groups' scale and centre decoded from Int4DQ's 4-bit
// indices per row (IntxWeight::row_params) and the codes' centre o = (2^b - 1) / 2.
//
// Few rows: an integer GEMV that decodes the packed codes in registers, so that the bytes read
// per weight are b/8 (what fewer bits are for at batch 1). The activations become int16 codes:
// per row and sub-group of `a` columns (a = g for g <= 256, else 256) with int4_pairs.h's
// quantize_rows16 (weight-only: within 1/65534 of the sub-group's largest |x|), or Int8Tensor's
// per-token int8 codes (act_quant "per_token", exactly as its quantize_input: the same
// products as the reference, whose activation is then rounded to x's dtype). The codes meet in
// vpmaddwd (AVX-512 VNNI: vpdpwssd), exact int32 sums, then float32 scaling:
//   y[m, n] = sum_j s[n, g(j)] * sx[m, j] * isum_j + sum_j (z - o * s)[n, g(j)] * xs[m, j],
// o = 2^(b-1) (IntxDQTensor: (2^b - 1) / 2), xs = sx * (sum of the sub-group's activation codes).
//
// Decoding. A block is 32 * P columns, P = codes per 16-bit lane (b = 1, 2, 3, 4, 5, 6, 7, 8:
// P = 16, 8, 4, 4, 2, 2, 1, 2): its 4 * P * b bytes fill 32 16-bit lanes, lane L holding the
// codes of columns P * L .. P * L + P - 1 with code P * L + t at bits BASE + t * b (BASE =
// 16 - P * b), so that code t of every lane is one shift and one mask away. For b = 1, 2, 4, 8
// the bytes are the lanes as loaded (codes never straddle 16 bits); for 3, 5, 6, 7 each 128-bit
// quarter gathers its P * b bytes with a dword permute and a byte shuffle, two bytes per lane,
// and a 16-bit multiply by 2^(BASE - offset) moves each lane's codes to the same bits. The
// activation codes are permuted once per call to match (vector t of a block holds the codes of
// columns P * L + t). Pairs of lanes (2P columns, never across a sub-group) add into one int32
// lane; a sub-group's int32 lanes are scaled in float32 (one broadcast, or per lane where a
// block spans several sub-groups). 32 lanes are one zmm in the AVX-512 build and two ymm in the
// AVX2 build, with the same lane order and the same float32 operations: both give the same
// outputs bit for bit.
//
// Many rows: chunks of the weight dequantized to float32 exactly as the reference and float32
// GEMM (dequant_gemm.h); intx_dequantize gives the weight in bf16/fp16/fp32 for aten's GEMM.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_gemm.h"     // amx_linear_bf16: many bf16 rows on AMX tiles or AVX512-BF16
#include "hf_aoq_cpu.h"
#include "int4_pairs.h"   // quantize_rows16 (int16 activation codes), dequant_gemm.h
#include "int4dq_rows.h"  // int4dq_decode: IntxDQTensor's row grid
#include "int8_per_token.h"  // Int8Tensor's activation codes
#include "intx_decode.h"  // Layout, Spread, block_dots: the decoding in registers
#include "simd.h"

namespace {

// The value of column k's code in a row's stream.
template <int B>
inline int code_of(const uint8_t* row, int64_t k) {
  const int64_t bit = k * B, byte = bit >> 3;
  const int sh = static_cast<int>(bit & 7);
  uint32_t w = row[byte];
  if (sh + B > 8) w |= uint32_t(row[byte + 1]) << 8;
  return static_cast<int>((w >> sh) & ((1u << B) - 1));
}

// A row of `n` scales (or zeros) of dtype `t` as float32.
inline void row_to_float(const void* src, torch::ScalarType t, float* dst, int64_t n) {
  int64_t i = 0;
  if (t == torch::kFloat32) {
    std::memcpy(dst, src, n * sizeof(float));
    return;
  }
  if (t == torch::kBFloat16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
#if defined(__AVX2__)
    for (; i + 8 <= n; i += 8) {
      const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i)));
      _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
#endif
    for (; i < n; ++i) {
      const uint32_t b = uint32_t(s[i]) << 16;
      std::memcpy(dst + i, &b, 4);
    }
    return;
  }
  const c10::Half* h = static_cast<const c10::Half*>(src);
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(h[i]);
}

// The weight's fields as the kernels read them. IntxTensor: a scale (and a zero) per group, of
// one float dtype. IntxDQTensor: each group's scale d and zero (its centre c) decoded from 4-bit
// indices (gp [N, G]: a low nibble, b high) on its row's grid (rows [N, 4]: dlo, dstep, clo,
// cstep, Int4DQ's decoding), d = dlo + a * dstep and c = clo + b * cstep in float32 as the
// reference; scale and zero are null then.
struct IntxWeight {
  const uint8_t* q;
  int64_t N, K, row_bytes, G, g;  // G: scale columns, g: group size
  const void* scale;
  const void* zero;  // null: symmetric
  torch::ScalarType dtype;
  float off;  // the codes' centre o: 2^(b-1) (IntxTensor) or (2^b - 1) / 2 (IntxDQTensor)
  const uint8_t* gp = nullptr;
  const float* rows = nullptr;
  bool has_zero() const { return zero != nullptr || gp != nullptr; }
  // Group j of row n's scale and zero (0 where there is none), as float32.
  void group_params(int64_t n, int64_t j, float& s, float& z) const {
    if (gp) {
      const uint8_t p = gp[n * G + j];
      const float* r = rows + n * 4;
      s = r[0] + static_cast<float>(p & 15) * r[1];
      z = r[2] + static_cast<float>(p >> 4) * r[3];
      return;
    }
    const int64_t i = n * G + j;
    const auto value = [&](const void* base) -> float {
      if (dtype == torch::kFloat32) return static_cast<const float*>(base)[i];
      if (dtype == torch::kBFloat16) return static_cast<float>(static_cast<const c10::BFloat16*>(base)[i]);
      return static_cast<float>(static_cast<const c10::Half*>(base)[i]);
    };
    s = value(scale);
    z = zero ? value(zero) : 0.f;
  }
  // Row n's G scales and (where there are) zeros, as float32.
  void row_params(int64_t n, float* s, float* z) const {
    if (gp) {
      for (int64_t j = 0; j < G; ++j) group_params(n, j, s[j], z[j]);
      return;
    }
    const int64_t esz = dtype == torch::kFloat32 ? 4 : 2;
    row_to_float(static_cast<const char*>(scale) + n * G * esz, dtype, s, G);
    if (zero) row_to_float(static_cast<const char*>(zero) + n * G * esz, dtype, z, G);
  }
};

// Eight codes (exactly B bytes at `p`) as int32 lanes, code i in lane i: the four low codes from
// the first 32 bits, the four high ones from the 32 bits that start at code 4 (4 * B <= 32); the
// bits above code 7 never reach a lane. Where 8 bytes remain before `end`, one 8-byte load: B
// bytes copied into a zeroed word went through the stack, and the wide reload of those narrow
// stores stalled (a third of the dequantization's time at B = 3).
#if defined(__AVX2__)
template <int B>
inline __m256i eight_codes(const uint8_t* p, const uint8_t* end) {
  uint64_t v = 0;
  if (p + 8 <= end)
    std::memcpy(&v, p, 8);
  else
    std::memcpy(&v, p, B);
  const __m256i both = _mm256_setr_epi32(int(uint32_t(v)), int(uint32_t(v)), int(uint32_t(v)), int(uint32_t(v)),
                                         int(uint32_t(v >> (4 * B))), int(uint32_t(v >> (4 * B))),
                                         int(uint32_t(v >> (4 * B))), int(uint32_t(v >> (4 * B))));
  const __m256i shift = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 0, B, 2 * B, 3 * B);
  return _mm256_and_si256(_mm256_srlv_epi32(both, shift), _mm256_set1_epi32((1 << B) - 1));
}
#endif

// Rows [n0, n1) as float32 [n1 - n0, K]: (q - o) * s (+ z), as the reference, in float32 (eight
// codes at a time in the AVX2 builds: the same subtract, multiply and add per weight).
template <int B>
struct IntxRows {
  const IntxWeight& w;
  void operator()(int64_t n0, int64_t n1, float* buf) const {
    const float off = w.off;
    const bool has_zero = w.has_zero();
    [[maybe_unused]] const uint8_t* qend = w.q + w.N * w.row_bytes;
    // Per thread, kept across calls: dequant_weight_into asks for one row at a time.
    thread_local std::vector<float> scratch;
    if (scratch.size() < size_t(2 * w.G)) scratch.assign(2 * w.G, 0.f);
    float* s = scratch.data();
    float* z = s + w.G;
    std::fill(z, z + w.G, 0.f);
    for (int64_t n = n0; n < n1; ++n) {
      w.row_params(n, s, z);
      const uint8_t* row = w.q + n * w.row_bytes;
      float* o = buf + (n - n0) * w.K;
      for (int64_t k0 = 0; k0 < w.K; k0 += w.g) {
        const int64_t k1 = std::min(w.K, k0 + w.g), gi = k0 / w.g;
        const float sg = s[gi], zg = z[gi];
        int64_t k = k0;
#if defined(__AVX2__)
        const auto one = [&](int64_t j) {
          const float v = (float(code_of<B>(row, j)) - off) * sg;
          o[j] = has_zero ? v + zg : v;
        };
        for (; k < k1 && (k & 7); ++k) one(k);
        const __m256 vo = _mm256_set1_ps(off), vs = _mm256_set1_ps(sg), vz = _mm256_set1_ps(zg);
        for (; k + 8 <= k1; k += 8) {
          __m256 f = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(eight_codes<B>(row + k / 8 * B, qend)), vo), vs);
          if (has_zero) f = _mm256_add_ps(f, vz);
          _mm256_storeu_ps(o + k, f);
        }
        for (; k < k1; ++k) one(k);
#else
        for (; k < k1 && (k & 7); ++k) o[k] = (float(code_of<B>(row, k)) - off) * sg;
        for (; k + 8 <= k1; k += 8) {  // eight codes are exactly B bytes
          uint64_t v = 0;
          std::memcpy(&v, row + k / 8 * B, B);
          for (int i = 0; i < 8; ++i) o[k + i] = (float((v >> (B * i)) & ((1u << B) - 1)) - off) * sg;
        }
        for (; k < k1; ++k) o[k] = (float(code_of<B>(row, k)) - off) * sg;
        if (has_zero)
          for (int64_t j = k0; j < k1; ++j) o[j] = o[j] + zg;
#endif
      }
    }
  }
};

#if HF_AOQ_AMX
// Sixteen consecutive codes of a row, from a byte boundary (2B bytes at p), as int32 lanes: the
// 16 bytes at p in every 128-bit quarter, each lane's 32-bit window gathered by a byte shuffle
// (byte B * i / 8 on: bytes past the 16 read as zero, above the code), then shifted right by
// B * i % 8 (`shifted`: code i in lane i's low B bits, the next codes' bits above). load(p, end):
// the 16 bytes at p, zero past the tensor's end.
template <int B>
struct Codes16 {
  alignas(64) uint8_t shuf[64];
  alignas(64) uint32_t shift[16];
  Codes16() {
    for (int i = 0; i < 16; ++i) {
      const int bit = B * i, byte = bit / 8;
      shift[i] = static_cast<uint32_t>(bit % 8);
      for (int j = 0; j < 4; ++j) {
        const int src = byte + j;
        shuf[16 * (i / 4) + 4 * (i % 4) + j] = static_cast<uint8_t>(src <= 15 ? src : 0x80);
      }
    }
  }
  static inline __m128i load(const uint8_t* p, const uint8_t* end) {
    if (p + 16 <= end) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    alignas(16) uint8_t part[16] = {};
    std::memcpy(part, p, size_t(std::max<int64_t>(0, std::min<int64_t>(16, end - p))));
    return _mm_load_si128(reinterpret_cast<const __m128i*>(part));
  }
  inline __m512i shifted(__m128i raw) const {
    const __m512i lanes = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(raw), _mm512_load_si512(shuf));
    return _mm512_srlv_epi32(lanes, _mm512_load_si512(shift));
  }
};

// Panel writer for the AMX tile GEMM (amx_gemm.h, RowScalePanel's layout): weight rows
// n0..n0+31, k in [k0, k1) as bf16 in steps of 32 k, out[((k - k0) / 32 * 32 + r) * 32 + k % 32];
// each value (q - o) * s (+ z) in float32 as IntxRows computes it, then rounded to bf16. A step at
// a time over the 32 rows, so that the stores fill each step's 2 KB in order; each half step (16
// codes, one group: groups are a multiple of 16 columns, K of 32) decoded by Codes16. For b <= 4
// a group's 2^b values are a table of 16 float32 lanes, (i mod 2^b - o) * s (+ z) for index i,
// made per row and step with the same multiply and add (one table where both halves of the step
// are in one group), and each code's value is one permute by its shifted lane (whose low 4 bits
// are the code and, above it, bits of the next code, which the table's repeats ignore). The rows'
// bytes are asked for ahead as RowScalePanel's are: with `ahead`, the next block's beside each
// row's, else by amx_linear_tiles (bytes()).
template <int B>
struct IntxRowsPanel {
  static constexpr bool kWeightRows = true;
  static constexpr bool kAsksAhead = true;
  static constexpr int64_t kPieceK = 0;  // each call computes its 32 rows' scales for all of K
  using Elem = uint16_t;
  const IntxWeight& w;
  AmxWeightBytes bytes(int64_t n0, int64_t k0, int64_t k1) const {
    return {w.q + n0 * w.row_bytes + k0 / 8 * B, kAmxBlockN, w.row_bytes, (k1 - k0) / 8 * B};
  }
  void operator()(int64_t n0, int64_t k0, int64_t k1, uint16_t* out, bool ahead) const {
    static const Codes16<B> codes16;
    const uint8_t* const q = w.q;
    const int64_t row_bytes = w.row_bytes, G = w.G, g = w.g;
    const uint8_t* const qend = q + w.N * row_bytes;
    const bool has_zero = w.has_zero();
    const int64_t ahead_bytes = kAmxBlockN * row_bytes;
    // The 32 rows' scales and zeros, each row's as row_params gives them (the same values as
    // group_params), before the steps: one group's pair is then two loads.
    thread_local std::vector<float> params;
    params.assign(size_t(2 * kAmxBlockN * G), 0.f);
    float* const sp = params.data();
    float* const zp = sp + kAmxBlockN * G;
    for (int r = 0; r < kAmxBlockN; ++r) w.row_params(n0 + r, sp + r * G, zp + r * G);
    alignas(64) float base[16];  // i mod 2^b - o, exact
    for (int i = 0; i < 16; ++i) base[i] = static_cast<float>(i & ((1 << B) - 1)) - w.off;
    const __m512 vbase = _mm512_load_ps(base), vo = _mm512_set1_ps(w.off);
    // Group j's table (b <= 4) or its scale and zero.
    struct Group {
      __m512 t, s, z;
    };
    const auto group = [&](int64_t j) {
      Group p;
      p.s = _mm512_set1_ps(sp[j]);
      p.z = _mm512_set1_ps(zp[j]);
      if constexpr (B <= 4) p.t = has_zero ? _mm512_add_ps(_mm512_mul_ps(vbase, p.s), p.z) : _mm512_mul_ps(vbase, p.s);
      return p;
    };
    // The values of the 16 codes in `raw` (Codes16's bytes) in group p.
    const auto values = [&](__m128i raw, const Group& p) {
      if constexpr (B <= 4) {
        return _mm512_permutexvar_ps(codes16.shifted(raw), p.t);
      } else {
        const __m512i c = _mm512_and_si512(codes16.shifted(raw), _mm512_set1_epi32((1 << B) - 1));
        const __m512 f = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(c), vo), p.s);
        return has_zero ? _mm512_add_ps(f, p.z) : f;
      }
    };
    // Every read checked against the tensor's end only where the block's last one passes it.
    const auto steps = [&](auto checked) {
      for (int64_t k = k0; k < k1; k += 32) {
        uint16_t* o = out + (k - k0) * 32;
        const int64_t j0 = k / g, j1 = (k + 16) / g;
        const uint8_t* row = q + n0 * row_bytes + k / 8 * B;
        for (int r = 0; r < kAmxBlockN; ++r, row += row_bytes) {
          if (ahead) _mm_prefetch(reinterpret_cast<const char*>(row + ahead_bytes), _MM_HINT_T1);
          __m128i raw[2];
          for (int h = 0; h < 2; ++h) {
            const uint8_t* p = row + 2 * B * h;
            if constexpr (decltype(checked)::value)
              raw[h] = Codes16<B>::load(p, qend);
            else
              raw[h] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
          }
          const Group p0 = group(r * G + j0);
          const Group p1 = j1 == j0 ? p0 : group(r * G + j1);
          _mm512_storeu_si512(o + r * 32, bf16_pack(values(raw[0], p0), values(raw[1], p1)));
        }
      }
    };
    if (q + (n0 + kAmxBlockN - 1) * row_bytes + (k1 - 16) / 8 * B + 16 <= qend)
      steps(std::false_type());
    else
      steps(std::true_type());
  }
};
#endif

template <class F>
void dispatch_bits(int64_t bits, F f) {
  switch (bits) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    case 8: f(std::integral_constant<int, 8>()); break;
    default: TORCH_CHECK(false, "bits: 1..8, got ", bits);
  }
}

// Activation codes for the GEMV: int16 codes [M, Kx] with the sums of int4_pairs.h's Int16Rows
// (sx, xs per row and sub-group of `a` columns, NS of them), the codes permuted per block.
struct Acts {
  std::vector<int16_t> xp;   // [M, Kx], permuted
  std::vector<float> sx, xs; // [M, NSp], zero past NS
  int64_t Kx, NS, NSp, a;
};

// The sub-group size for groups of g columns: g for g = 32, 64, 128, 256, else 256 (where g is a
// multiple of 256, or one group covers the row: gemv_supports).
inline bool small_group(int64_t g) { return g == 32 || g == 64 || g == 128 || g == 256; }
inline int64_t sub_group(int64_t g) { return small_group(g) ? g : 256; }
inline bool gemv_supports(int64_t g, int64_t K) { return small_group(g) || g % 256 == 0 || g >= K; }

// Int8Tensor's per-token activation codes of one row (int8_per_token.h) into c[0..K). Returns the
// scale (NaN for a row holding NaN, whose codes are then 0).
inline float int8_codes(const float* x, int64_t K, int16_t* c) {
  const float scale = int8_row_scale(x, K);
  if (std::isnan(scale)) return scale;
  for (int64_t k = 0; k < K; ++k) c[k] = static_cast<int16_t>(int8_code(x[k], scale));
  return scale;
}

// x: float32 [M, K]. int8: Int8Tensor's per-token codes (scale = max(amax / 127, 1e-12), code =
// clamp(round(x / scale), -127, 127)), else int16 codes per sub-group (quantize_rows16).
Acts make_acts(const float* x, int64_t M, int64_t K, int64_t a, int64_t block, bool int8) {
  Acts r;
  r.a = a;
  const int64_t L = std::max(a, block);
  r.Kx = (K + L - 1) / L * L;
  const int64_t NSx = r.Kx / a;
  r.NS = (K + a - 1) / a;
  r.NSp = (r.NS + 15) / 16 * 16;
  std::vector<int16_t> codes;
  std::vector<float> sx(M * NSx), xs(M * NSx);
  if (!int8) {
    std::vector<float> xpad(M * r.Kx, 0.f);
    for (int64_t m = 0; m < M; ++m) std::memcpy(xpad.data() + m * r.Kx, x + m * K, K * sizeof(float));
    Int16Rows q = quantize_rows16(xpad.data(), M, r.Kx, a);
    codes = std::move(q.codes);
    sx = std::move(q.sx);
    xs = std::move(q.xs);
  } else {
    codes.assign(M * r.Kx, 0);
    for (int64_t m = 0; m < M; ++m) {
      const int16_t* c = codes.data() + m * r.Kx;
      const float scale = int8_codes(x + m * K, K, codes.data() + m * r.Kx);
      for (int64_t j = 0; j < NSx; ++j) {
        int32_t total = 0;
        for (int64_t k = j * a; k < (j + 1) * a; ++k) total += c[k];
        sx[m * NSx + j] = scale;
        xs[m * NSx + j] = float(total) * scale;
      }
    }
  }
  r.sx.assign(M * r.NSp, 0.f);
  r.xs.assign(M * r.NSp, 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < r.NS; ++j) {
      r.sx[m * r.NSp + j] = sx[m * NSx + j];
      r.xs[m * r.NSp + j] = xs[m * NSx + j];
    }
  // Per block of `block` columns, P = block / 32 vectors of 32 codes: vector t, lane L <- column P * L + t.
  const int64_t P = block / 32;
  r.xp.resize(M * r.Kx);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b0 = 0; b0 < r.Kx; b0 += block) {
      const int16_t* s = codes.data() + m * r.Kx + b0;
      int16_t* d = r.xp.data() + m * r.Kx + b0;
      for (int64_t t = 0; t < P; ++t)
        for (int64_t l = 0; l < 32; ++l) d[t * 32 + l] = s[P * l + t];
    }
  return r;
}

#if defined(__AVX2__)

// Software prefetch in the GEMV: each block asks for the bytes kPrefetchAhead further on in the
// weight (the rows a thread reads are consecutive). The L2's own prefetcher restarts at every 4 KB
// page, about five rows of a 2048-column 3-bit weight.
constexpr int64_t kPrefetchAhead = 2048;

// A block whose READ bytes would run past the tensor's end (qend; the last row's last blocks):
// its bytes copied into `tail`, zeros after. Out of line and cold, so that the block loop's
// accumulators stay in registers (a call clobbers every vector register).
__attribute__((noinline, cold)) const uint8_t* tail_block(uint8_t* tail, int64_t read, const uint8_t* p,
                                                         const uint8_t* qend) {
  std::memset(tail, 0, size_t(read));
  std::memcpy(tail, p, size_t(std::max<int64_t>(0, std::min<int64_t>(read, qend - p))));
  return tail;
}

// Dot products of weight row `row` with MB activation rows (codes xp[i], per-sub-group scales
// t[i] = s * sx), as float32 vector sums from init[i] (the zero term's lanes), summed into out[i].
// Where a block holds several sub-groups, alternate blocks add into two accumulators, so that
// consecutive blocks' multiply-adds do not wait on each other.
template <int B, int MB>
void row_dots(const Spread<B>& sp, const LaneScale& ls, const uint8_t* row, const uint8_t* qend, int64_t K, int64_t a,
              const int16_t* const* xp, const float* const* t, const vfloat* init, float* out) {
  using Lay = Layout<B>;
  constexpr int64_t BLK = Lay::BLOCK, BYTES = 4 * Lay::P * B;
  const int64_t NB = (K + BLK - 1) / BLK;
  alignas(64) uint8_t tail[Lay::READ];
  // The block's bytes: in place, or for the tensor's last blocks copied into `tail` (zeros after).
  auto block_ptr = [&](int64_t b) -> const uint8_t* {
    const uint8_t* p = row + b * BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
    if (p + Lay::READ <= qend) return p;
    std::memset(tail, 0, sizeof tail);
    std::memcpy(tail, p, size_t(std::max<int64_t>(0, std::min<int64_t>(Lay::READ, qend - p))));
    return tail;
  };
  // The same with the copy out of line and cold, for the inlined block step below: a call clobbers
  // every vector register, and the accumulators stay in registers only if none is on the hot path.
  auto block_ptr_hot = [&](int64_t b) __attribute__((always_inline)) -> const uint8_t* {
    const uint8_t* p = row + b * BYTES;
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead), _MM_HINT_T0);
    if (__builtin_expect(p + Lay::READ <= qend, 1)) return p;
    return tail_block(tail, Lay::READ, p, qend);
  };
  vfloat f[MB], f2[MB];
  for (int i = 0; i < MB; ++i) f[i] = init[i], f2[i] = vzero();
  const auto seq = std::make_integer_sequence<int, Lay::P>();
  if (a >= BLK) {  // whole blocks per sub-group: int32 sums over the sub-group, one broadcast scale
    const int64_t spb = a / BLK, NS = (NB + spb - 1) / spb;
    for (int64_t j = 0; j < NS; ++j) {
      vi32 acc[MB];
      for (int i = 0; i < MB; ++i) acc[i] = izero();
      for (int64_t b = j * spb; b < std::min(NB, (j + 1) * spb); ++b) {
        const vi16 v = sp.load(block_ptr(b));
        const int16_t* xs[MB];
        for (int i = 0; i < MB; ++i) xs[i] = xp[i] + b * BLK;
        block_dots<B, MB>(v, xs, acc, seq);
      }
      for (int i = 0; i < MB; ++i) f[i] = vfma(to_vfloat(acc[i]), vbroadcast(t[i][j]), f[i]);
    }
  } else {  // several sub-groups per block: each int32 lane scaled by its own
    const int64_t spb = BLK / a;
    // Block b's step from its bytes at p, into the accumulators g.
    auto step = [&](int64_t b, vfloat* g, const uint8_t* p) __attribute__((always_inline)) {
      vi32 acc[MB];
      for (int i = 0; i < MB; ++i) acc[i] = izero();
      const vi16 v = sp.load(p);
      const int16_t* xs[MB];
      for (int i = 0; i < MB; ++i) xs[i] = xp[i] + b * BLK;
      block_dots<B, MB>(v, xs, acc, seq);
      for (int i = 0; i < MB; ++i) g[i] = vfma(to_vfloat(acc[i]), ls.get(t[i] + b * spb), g[i]);
    };
    int64_t b = 0;
    // Inlined where it measured faster: left to itself GCC kept the step out of line for 2- and
    // 3-bit codes at every tile and for every width at 2-4 rows, so that each block passed its
    // pointers and accumulators through memory (inlined, in the AVX-512 build: 3-bit codes 1.2-1.6x
    // as fast at 1-16 rows, 4- to 8-bit 1.2-1.8x at 2-16, 2-bit 1.1-1.3x at one row; 3-bit 1.3-1.4x
    // in the AVX2 build; docs/performance.md "The Intx GEMV's block step inlined"). Where a lane
    // holds 16 codes (1-bit), or 8 (2-bit) with several activation rows, GCC's choice stays: inlined
    // there, beside that many code vectors, it measured 0.7-0.9x as fast.
    if constexpr (Lay::P <= 4 || (Lay::P == 8 && MB == 1)) {
      for (; b + 2 <= NB; b += 2) {
        step(b, f, block_ptr_hot(b));
        step(b + 1, f2, block_ptr_hot(b + 1));
      }
      if (b < NB) step(b, f, block_ptr_hot(b));
    } else {
      auto one = [&](int64_t b, vfloat* g) { step(b, g, block_ptr(b)); };
      for (; b + 2 <= NB; b += 2) {
        one(b, f);
        one(b + 1, f2);
      }
      if (b < NB) one(b, f);
    }
  }
  for (int i = 0; i < MB; ++i) out[i] = vsum(vadd(f[i], f2[i]));
}

#if HF_AOQ_INTX_ZMM
constexpr int kMaxTile = 4;
#else
constexpr int kMaxTile = 2;
#endif

// y [M, N] float32 = x W^T through the integer GEMV.
template <int B>
void intx_gemv(const IntxWeight& w, const Acts& xa, int64_t M, float* y) {
  using Lay = Layout<B>;
  static const Spread<B> sp;
  const int64_t K = w.K, a = xa.a, NS = xa.NS, NSp = xa.NSp;
  const int64_t NB = (K + Lay::BLOCK - 1) / Lay::BLOCK;
  const int64_t spb_lanes = a < Lay::BLOCK ? Lay::BLOCK / a : 1;
  const int64_t tlen = std::max(NSp, NB * spb_lanes) + 16;
  LaneScale ls{};
  if (a < Lay::BLOCK) {
    for (int j = 0; j < 16; ++j) ls.idx[j] = static_cast<int32_t>(2 * Lay::P * j / a);
    ls.h = 16 * Lay::P / a;
  }
  std::vector<int64_t> group_of(NS);  // the weight group of each sub-group
  for (int64_t j = 0; j < NS; ++j) group_of[j] = j * a / w.g;
  const float off = w.off;
  const uint8_t* qend = w.q + w.N * w.row_bytes;
  at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) {
    const int64_t GP = std::max(w.G, NSp);
    std::vector<float> sg(GP, 0.f), zg(GP, 0.f), ss(NSp, 0.f), zs(NSp, 0.f), tb(kMaxTile * tlen, 0.f);
    const bool same = a == w.g;  // sub-groups are the weight's groups (then G == NS)
    // Row n's scales and zeros of groups j..j+15 (zero past G): IntxDQTensor's decoded from its
    // 4-bit indices (as group_params, 16 at a time), IntxTensor's from sg and zg.
    auto group16 = [&](int64_t n, int64_t j, vfloat& s, vfloat& z) {
      if (!w.gp) {
        s = vload(sg.data() + j);
        z = vload(zg.data() + j);
        return;
      }
      const int64_t have = w.G - j;
      const uint8_t* p = w.gp + n * w.G + j;
      alignas(16) uint8_t part[16] = {};
      if (have < 16) {
        if (have > 0) std::memcpy(part, p, size_t(have));
        p = part;
      }
      vfloat lo, hi;
      nibbles16(p, lo, hi);
      const float* r = w.rows + n * 4;
      s = vadd(vbroadcast(r[0]), vmul(lo, vbroadcast(r[1])));
      z = vadd(vbroadcast(r[2]), vmul(hi, vbroadcast(r[3])));
      if (have < 16) {
        alignas(64) float ts[16], tz[16];
        vstore(ts, s);
        vstore(tz, z);
        for (int64_t l = std::max<int64_t>(have, 0); l < 16; ++l) ts[l] = tz[l] = 0.f;
        s = vload(ts);
        z = vload(tz);
      }
    };
    for (int64_t n = n0; n < n1; ++n) {
      if (!(same && w.gp)) w.row_params(n, sg.data(), zg.data());
      // Per sub-group: the scale and the zero term's factor z - o * s (where the sub-groups are
      // the groups, in the one pass below).
      if (!same) {
        for (int64_t j = 0; j < NS; ++j) {
          const int64_t gi = group_of[j];
          ss[j] = sg[gi];
          zs[j] = zg[gi] - off * sg[gi];
        }
      }
      const uint8_t* row = w.q + n * w.row_bytes;
      for (int64_t m0 = 0; m0 < M; m0 += kMaxTile) {
        const int mb = static_cast<int>(std::min<int64_t>(kMaxTile, M - m0));
        const int16_t* xp[kMaxTile];
        const float* tp[kMaxTile];
        float d[kMaxTile];
        vfloat za[kMaxTile];  // the zero term's lanes, sum_j (z - o * s)[j] * xs_i[j]
        for (int i = 0; i < mb; ++i) {
          xp[i] = xa.xp.data() + (m0 + i) * xa.Kx;
          tp[i] = tb.data() + i * tlen;
        }
        if (same) {
          // One pass over the groups, 16 at a time: t_i = s * sx_i and the zero term.
          for (int i = 0; i < mb; ++i) za[i] = vzero();
          for (int64_t j = 0; j < NSp; j += kLanes) {
            vfloat sv, zv;
            group16(n, j, sv, zv);
            const vfloat zsv = vsub(zv, vscale(sv, off));
            for (int i = 0; i < mb; ++i) {
              const int64_t m = m0 + i;
              vstore(tb.data() + i * tlen + j, vmul(sv, vload(xa.sx.data() + m * NSp + j)));
              za[i] = vfma(zsv, vload(xa.xs.data() + m * NSp + j), za[i]);
            }
          }
        } else {
          for (int i = 0; i < mb; ++i) {
            const int64_t m = m0 + i;
            float* ti = tb.data() + i * tlen;
            const float* sxm = xa.sx.data() + m * NSp;
            for (int64_t j = 0; j < NSp; ++j) ti[j] = ss[j] * sxm[j];
            za[i] = vzero();
            const float* xsm = xa.xs.data() + m * NSp;
            for (int64_t j = 0; j < NSp; j += kLanes) za[i] = vfma(vload(zs.data() + j), vload(xsm + j), za[i]);
          }
        }
        switch (mb) {
#if HF_AOQ_INTX_ZMM
          case 4: row_dots<B, 4>(sp, ls, row, qend, K, a, xp, tp, za, d); break;
          case 3: row_dots<B, 3>(sp, ls, row, qend, K, a, xp, tp, za, d); break;
#endif
          case 2: row_dots<B, 2>(sp, ls, row, qend, K, a, xp, tp, za, d); break;
          default: row_dots<B, 1>(sp, ls, row, qend, K, a, xp, tp, za, d); break;
        }
        for (int i = 0; i < mb; ++i) y[(m0 + i) * w.N + n] = d[i];
      }
    }
  });
}
#endif  // __AVX2__

// The codes' fields both types share (bit streams of `bits`-bit codes, groups of group_size
// along k): the weight's q, N, K, row_bytes, G and g, the rest left for the caller.
IntxWeight check_codes(const torch::Tensor& qdata, int64_t bits, int64_t group_size, int64_t k) {
  TORCH_CHECK(bits >= 1 && bits <= 8, "bits: 1..8, got ", bits);
  TORCH_CHECK(k > 0 && group_size > 0, "k and group_size must be positive");
  const int64_t row_bytes = (k * bits + 7) / 8, G = (k + group_size - 1) / group_size;
  TORCH_CHECK(qdata.dtype() == torch::kUInt8 && qdata.dim() == 2 && qdata.size(1) == row_bytes && qdata.is_contiguous(),
              "qdata: contiguous uint8 [N, ", row_bytes, "], got ", qdata.dtype(), " ", qdata.sizes());
  return IntxWeight{qdata.data_ptr<uint8_t>(), qdata.size(0), k, row_bytes, G, group_size, nullptr, nullptr,
                    torch::kFloat32, float(1 << (bits - 1))};
}

IntxWeight check_weight(const torch::Tensor& qdata, const torch::Tensor& scale, const c10::optional<torch::Tensor>& zero,
                        int64_t bits, int64_t group_size, int64_t k) {
  IntxWeight w = check_codes(qdata, bits, group_size, k);
  const int64_t N = w.N, G = w.G;
  const auto st = scale.scalar_type();
  TORCH_CHECK(st == torch::kFloat32 || st == torch::kBFloat16 || st == torch::kFloat16,
              "scale: float32, bfloat16 or float16");
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N && scale.size(1) == G && scale.is_contiguous(),
              "scale: contiguous [", N, ", ", G, "], got ", scale.sizes());
  const bool has_zero = zero.has_value() && zero->defined();
  if (has_zero)
    TORCH_CHECK(zero->scalar_type() == st && zero->sizes() == scale.sizes() && zero->is_contiguous(),
                "zero: contiguous, scale's shape and dtype");
  w.scale = scale.data_ptr();
  w.zero = has_zero ? zero->data_ptr() : nullptr;
  w.dtype = st;
  return w;
}

// IntxDQTensor's fields; `table` receives the decoded row table (float32 [N, 4]): the CPU
// packing's, after T_d and T_c in tparams ([2 + 4N]), else decoded from rparams and tparams here.
IntxWeight check_dq_weight(const torch::Tensor& qdata, const torch::Tensor& gparams, const torch::Tensor& rparams,
                           const torch::Tensor& tparams, int64_t bits, int64_t group_size, int64_t k,
                           torch::Tensor& table) {
  IntxWeight w = check_codes(qdata, bits, group_size, k);
  w.off = float((1 << bits) - 1) / 2.f;
  const int64_t N = w.N, G = w.G;
  TORCH_CHECK(gparams.dtype() == torch::kUInt8 && gparams.dim() == 2 && gparams.size(0) == N && gparams.size(1) == G &&
                  gparams.is_contiguous(),
              "gparams: contiguous uint8 [", N, ", ", G, "], got ", gparams.dtype(), " ", gparams.sizes());
  TORCH_CHECK(rparams.dim() == 2 && rparams.size(0) == N, "rparams: [", N, ", 4], got ", rparams.sizes());
  if (tparams.numel() == 2 + 4 * N) {  // the CPU packing's: T_d, T_c, then the decoded row table
    TORCH_CHECK(tparams.dtype() == torch::kFloat32 && tparams.dim() == 1 && tparams.is_contiguous(),
                "tparams: contiguous float32 [2] or [2 + 4N] (T_d, T_c and the CPU packing's row table), got ",
                tparams.dtype(), " ", tparams.sizes());
    table = tparams.narrow(0, 2, 4 * N);
  } else {
    table = int4dq_decode(rparams, tparams);  // checks rparams and tparams
  }
  w.gp = gparams.data_ptr<uint8_t>();
  w.rows = table.data_ptr<float>();
  return w;
}

// F.linear(x, w, bias) for either type (see intx_linear_io).
torch::Tensor linear_io(const IntxWeight& w, torch::Tensor x, const c10::optional<torch::Tensor>& bias, int64_t bits,
                        int64_t group_size, int64_t k, int64_t gemv_max_rows, bool int8_activations) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == w.N, "bias: expected ", w.N, " values, got ", bias->numel());
  auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0), N = w.N;
  auto y = torch::empty({M, N}, x2.options());
  if (M > 0) {
    bool done = false;
#if defined(__AVX2__)
    if (M <= gemv_max_rows && gemv_supports(group_size, k)) {
      dispatch_bits(bits, [&](auto bc) {
        constexpr int B = decltype(bc)::value;
        const Acts xa = make_acts(x2.data_ptr<float>(), M, k, sub_group(group_size), Layout<B>::BLOCK, int8_activations);
        intx_gemv<B>(w, xa, M, y.data_ptr<float>());
      });
      done = true;
    }
#endif
    if (!done) {
      if (int8_activations) {  // the activation the integer kernel sees: codes * scale, in float32
        auto xq = torch::empty({M, k}, x2.options());
        std::vector<int16_t> c(k);
        for (int64_t m = 0; m < M; ++m) {
          std::fill(c.begin(), c.end(), int16_t(0));
          const float scale = int8_codes(x2.data_ptr<float>() + m * k, k, c.data());
          for (int64_t j = 0; j < k; ++j) xq.data_ptr<float>()[m * k + j] = float(c[j]) * scale;
        }
        x2 = xq;
      }
      dispatch_bits(bits, [&](auto bc) {
        constexpr int B = decltype(bc)::value;
        dequant_gemm(x2, y, N, k, 1, /*transposed=*/false, IntxRows<B>{w});
      });
    }
  }
  if (has_bias) y.add_(bias->reshape({N}).to(torch::kFloat32));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}

// The weight [N, k] in dtype, as IntxRows decodes it (see intx_dequantize).
torch::Tensor dequantize(const IntxWeight& w, int64_t bits, int64_t k, torch::ScalarType dtype) {
  torch::Tensor out;
  dispatch_bits(bits, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    const IntxRows<B> rows{w};
    if (dtype == torch::kFloat32) {
      out = torch::empty({w.N, k}, torch::TensorOptions().dtype(torch::kFloat32));
      float* o = out.data_ptr<float>();
      at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) { rows(n0, n1, o + n0 * k); });
    } else {
      out = dequant_weight(w.N, k, k, 1, /*transposed=*/false, dtype, rows);
    }
  });
  return out;
}

// F.linear(x, w, bias) on AMX tiles or AVX512-BF16's dot products (see intx_amx_linear).
torch::Tensor amx_linear(const IntxWeight& w, const torch::Tensor& x, const c10::optional<torch::Tensor>& bias,
                         int64_t bits, bool tiles) {
  check_panel_gemm_usable(tiles);
  TORCH_CHECK(w.N % 32 == 0 && w.K % 32 == 0 && w.g % 16 == 0,
              "the panel GEMM takes N and K multiples of 32 and groups of a multiple of 16, got ", w.N, " x ", w.K,
              ", groups of ", w.g);
  const torch::Tensor xa = amx_input(x, w.K), b = amx_bias(bias, w.N);
  auto y = torch::empty({xa.size(0), w.N}, xa.options());
#if HF_AOQ_AMX
  dispatch_bits(bits, [&](auto bc) {
    constexpr int B = decltype(bc)::value;
    amx_linear_bf16(reinterpret_cast<const uint16_t*>(xa.data_ptr()), w.K, xa.size(0), w.N, w.K, 32,
                    b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
                    IntxRowsPanel<B>{w}, tiles);
  });
#endif
  return y;
}

}  // namespace

// x: bfloat16 [M, k]; the IntxTensor weight's fields as for intx_linear_io, N and k multiples of
// 32, groups of a multiple of 16. F.linear in bf16 on AMX tiles (tiles) or AVX512-BF16's dot
// products (amx_gemm.h), the weight written 32 rows at a time as bf16 panels whose values are the
// reference's dequantize(bfloat16), bit for bit. Returns bfloat16 [M, N].
torch::Tensor intx_amx_linear(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, c10::optional<torch::Tensor> zero,
                              int64_t bits, int64_t group_size, c10::optional<torch::Tensor> bias, bool tiles) {
  const IntxWeight w = check_weight(qdata, scale, zero, bits, group_size, x.size(-1));
  return amx_linear(w, x, bias, bits, tiles);
}

// The same for IntxDQTensor's fields (as for intxdq_linear_io).
torch::Tensor intxdq_amx_linear(torch::Tensor x, torch::Tensor qdata, torch::Tensor gparams, torch::Tensor rparams,
                                torch::Tensor tparams, int64_t bits, int64_t group_size, c10::optional<torch::Tensor> bias,
                                bool tiles) {
  torch::Tensor table;
  const IntxWeight w = check_dq_weight(qdata, gparams, rparams, tparams, bits, group_size, x.size(-1), table);
  return amx_linear(w, x, bias, bits, tiles);
}

// F.linear(x, IntxTensor weight, bias): x float32 / bfloat16 / float16 [..., k]; qdata uint8 [N,
// ceil(k * bits / 8)] (the canonical bit streams); scale and zero (optional) [N, ceil(k /
// group_size)] of one float dtype; bias optional [N]. int8_activations: Int8Tensor's per-token
// int8 activations (act_quant "per_token"). At up to gemv_max_rows rows (and a group size the
// GEMV takes: 32, 64, 128, 256, a multiple of 256, or k), the integer GEMV; else the weight
// dequantized in float32 chunks and float32 GEMM. Computed in float32, bias added in float32,
// returned in x's dtype as [..., N].
torch::Tensor intx_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, c10::optional<torch::Tensor> zero,
                             int64_t bits, int64_t group_size, int64_t k, c10::optional<torch::Tensor> bias,
                             int64_t gemv_max_rows, bool int8_activations) {
  const IntxWeight w = check_weight(qdata, scale, zero, bits, group_size, k);
  return linear_io(w, x, bias, bits, group_size, k, gemv_max_rows, int8_activations);
}

// The weight [N, k] in dtype (float32, bfloat16 or float16), bit for bit the reference's
// dequantize(dtype): (q - 2^(bits-1)) * scale (+ zero) in float32, rounded once.
torch::Tensor intx_dequantize(torch::Tensor qdata, torch::Tensor scale, c10::optional<torch::Tensor> zero, int64_t bits,
                              int64_t group_size, int64_t k, torch::ScalarType dtype) {
  return dequantize(check_weight(qdata, scale, zero, bits, group_size, k), bits, k, dtype);
}

// F.linear(x, IntxDQTensor weight, bias), weight-only: its canonical fields (qdata as IntxTensor's
// bit streams, gparams uint8 [N, ceil(k / group_size)], rparams uint8 [N, 4], tparams float32
// [2], or the CPU packing's [2 + 4N]: T_d and T_c, then the row table int4dq_row_params
// decodes, made once when the weight was packed by kernels/cpu_intx.py; from [2] the table is
// decoded per call). The same paths as intx_linear_io's, with o = (2^bits - 1) / 2 and each
// group's (d, c) as (scale, zero).
torch::Tensor intxdq_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor gparams, torch::Tensor rparams,
                               torch::Tensor tparams, int64_t bits, int64_t group_size, int64_t k,
                               c10::optional<torch::Tensor> bias, int64_t gemv_max_rows) {
  torch::Tensor table;
  const IntxWeight w = check_dq_weight(qdata, gparams, rparams, tparams, bits, group_size, k, table);
  return linear_io(w, x, bias, bits, group_size, k, gemv_max_rows, false);
}

// The IntxDQTensor weight [N, k] in dtype, bit for bit the reference's dequantize(dtype):
// (q - (2^bits - 1) / 2) * d + c in float32, rounded once.
torch::Tensor intxdq_dequantize(torch::Tensor qdata, torch::Tensor gparams, torch::Tensor rparams, torch::Tensor tparams,
                                int64_t bits, int64_t group_size, int64_t k, torch::ScalarType dtype) {
  torch::Tensor table;
  const IntxWeight w = check_dq_weight(qdata, gparams, rparams, tparams, bits, group_size, k, table);
  return dequantize(w, bits, k, dtype);
}
