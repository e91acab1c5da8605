// 2:4 sparse float8 (Float8SemiSparseTensor) weight x float activation on CPU.
//
// The weight is read as stored: per row, K/2 kept e4m3 values and their 2-bit positions (four
// per byte, value j's position in bits 2(j % 4) of byte j / 4, so 32 bits hold the positions of
// 16 consecutive values). Value j sits in column 4 * (j / 2) + position(j). The GEMV multiplies
// each kept value with the activation element at its column: K/2 multiply-adds per row and
// activation row instead of K, and no zero is read or multiplied. The elements are not gathered
// (vgatherdps is slow, and far slower under the Gather Data Sampling microcode mitigation: a
// first version with gathers took 17 ms at batch 1 on 2048x5632 where dense fp8 takes 0.65): the
// 32 (AVX-512; AVX2: 16) activation columns of 16 (8) consecutive values are loaded as they are and
// a two-source lane permute (vpermt2ps; AVX2: two vpermps and a blend) picks each value's one.
//
// Decoding an e4m3 code: its exponent and mantissa bits placed at the top of a float32's
// exponent and mantissa give value * 2^-120 (normal and subnormal codes alike, the fp8.cpp trick);
// the codes are then multiplied by 2^60 (exact) so that partial sums stay away from float32's
// subnormals, and the row's dot product is multiplied by 2^60 (exact) and then by the row's scale
// (the one rounding the scale brings). Denormals are neither flushed nor treated as zero.
// The NaN code (0x7F / 0xFF) reads as a finite number: the loader refuses weights holding it
// (core/primitives.py check_float8_codes_finite).
//
// fp8_sparse_dequantize: the dense weight in bf16/fp16/fp32, bit for bit the reference's
// dequantize(dtype): float32 value * scale, rounded once to dtype, zeros at the pruned columns.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__SSE__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hf_aoq_cpu.h"
#include "simd.h"

namespace {

inline float e4m3_scaled(uint8_t b) {  // value * 2^-120
  const uint32_t bits = (uint32_t(b & 0x80) << 24) | (uint32_t(b & 0x7F) << 20);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct DenormalsKept {
#if defined(__SSE__) || defined(__AVX2__)
  unsigned int saved;
  DenormalsKept() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }  // clear FTZ and DAZ
  ~DenormalsKept() { _mm_setcsr(saved); }
#endif
};

inline int64_t column(const uint8_t* pos, int64_t j) {
  return 4 * (j / 2) + ((pos[j / 4] >> (2 * (j % 4))) & 3);
}

// The 32 bits of positions of values j .. j + 15 (j a multiple of 16, j + 16 <= K/2: the bytes
// exist). A constant-size copy: a variable-size one became a library call, several times the
// cost of the rest of the loop.
inline uint32_t position_word(const uint8_t* pos, int64_t j) {
  uint32_t w;
  std::memcpy(&w, pos + j / 4, sizeof(w));
  return w;
}

// Dot products of one sparse weight row (V = K/2 values) with MB activation rows (x, K floats
// apart), each scaled by 2^-60 relative to the true sum of value * x.
template <int MB>
inline void row_dots(const uint8_t* val, const uint8_t* pos, int64_t V, int64_t pos_bytes, const float* x, int64_t K,
                     float* acc) {
  const float lift = std::ldexp(1.f, 60);
  int64_t j = 0;
#if defined(__AVX512F__)
  {
    const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
    const __m512i three = _mm512_set1_epi32(3), mask = _mm512_set1_epi32(int(0x87F00000u));
    const __m512 vlift = _mm512_set1_ps(lift);
    __m512 a[MB], c[MB];  // two chains per activation row: one would wait on the FMA latency
    for (int i = 0; i < MB; ++i) a[i] = c[i] = _mm512_setzero_ps();
    auto step = [&](int64_t j0, __m512* into) {
      const __m512i f = _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(int(position_word(pos, j0))), shifts), three);
      const __m512i idx = _mm512_add_epi32(f, base);  // column within the 32
      const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(val + j0)));
      const __m512 w = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), mask)), vlift);
      const float* xc = x + 2 * j0;  // the 32 columns of these 16 values
      for (int i = 0; i < MB; ++i) {
        const __m512 lo = _mm512_loadu_ps(xc + i * K), hi = _mm512_loadu_ps(xc + i * K + 16);
        into[i] = _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, idx, hi), w, into[i]);
      }
    };
    for (; j + 32 <= V; j += 32) {
      step(j, a);
      step(j + 16, c);
    }
    for (; j + 16 <= V; j += 16) step(j, a);
    for (int i = 0; i < MB; ++i) a[i] = _mm512_add_ps(a[i], c[i]);
    for (int i = 0; i < MB; ++i) acc[i] = _mm512_reduce_add_ps(a[i]);
  }
#elif defined(__AVX2__)
  {
    const __m256i shifts = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i base = _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12);
    const __m256i three = _mm256_set1_epi32(3), mask = _mm256_set1_epi32(int(0x87F00000u));
    const __m256 vlift = _mm256_set1_ps(lift);
    __m256 a[MB];
    for (int i = 0; i < MB; ++i) a[i] = _mm256_setzero_ps();
    for (; j + 8 <= V; j += 8) {
      uint32_t word = 0;
      std::memcpy(&word, pos + j / 4, 2);
      const __m256i f = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(int(word)), shifts), three);
      const __m256i idx = _mm256_add_epi32(f, base);  // column within the 16 (its low 3 bits pick the lane)
      const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(val + j)));
      const __m256 w = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), mask)), vlift);
      const float* xc = x + 2 * j;  // the 16 columns of these 8 values: 0-3 in the first 8, 4-7 in the next
      for (int i = 0; i < MB; ++i) {
        const __m256 lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xc + i * K), idx);
        const __m256 hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(xc + i * K + 8), idx);
        a[i] = _mm256_fmadd_ps(_mm256_blend_ps(lo, hi, 0xF0), w, a[i]);
      }
    }
    for (int i = 0; i < MB; ++i) acc[i] = hsum(a[i]);
  }
#else
  for (int i = 0; i < MB; ++i) acc[i] = 0.f;
#endif
  for (; j < V; ++j) {
    const float w = e4m3_scaled(val[j]) * lift;
    const int64_t c = column(pos, j);
    for (int i = 0; i < MB; ++i) acc[i] += x[i * K + c] * w;
  }
}

// Rows [n0, n1) of the dense weight as float32 into o (K floats per row): value * scale (the
// first factor 2^120 is exact) at each value's column, zero elsewhere.
void dense_rows(const uint8_t* val, const uint8_t* pos, const float* scale, int64_t n, int64_t K, float* o) {
  const int64_t V = K / 2, pos_bytes = (K + 7) / 8;
  const float exact = std::ldexp(1.f, 120);
  std::fill(o, o + K, 0.f);
  const uint8_t* v = val + n * V;
  const uint8_t* p = pos + n * pos_bytes;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512i shifts = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i base = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  const __m512i three = _mm512_set1_epi32(3), mask = _mm512_set1_epi32(int(0x87F00000u)), one = _mm512_set1_epi32(1);
  const __m512 vexact = _mm512_set1_ps(exact), vscale = _mm512_set1_ps(scale[n]);
  for (; j + 16 <= V; j += 16) {
    const __m512i idx = _mm512_add_epi32(
        _mm512_and_si512(_mm512_srlv_epi32(_mm512_set1_epi32(int(position_word(p, j))), shifts), three), base);
    const uint32_t cols = uint32_t(_mm512_reduce_or_epi32(_mm512_sllv_epi32(one, idx)));  // 16 of the 32 columns
    const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(v + j)));
    const __m512 w = _mm512_mul_ps(_mm512_mul_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), mask)),
                                                 vexact), vscale);
    // Columns 0-15 hold values 0-7 (four groups), columns 16-31 values 8-15, in order: expand.
    _mm512_storeu_ps(o + 2 * j, _mm512_maskz_expand_ps(__mmask16(cols & 0xFFFF), w));
    _mm512_storeu_ps(o + 2 * j + 16, _mm512_maskz_expand_ps(__mmask16(cols >> 16), _mm512_shuffle_f32x4(w, w, 0xEE)));
  }
#endif
  for (; j < V; ++j) o[column(p, j)] = (e4m3_scaled(v[j]) * exact) * scale[n];
}

// A float32 row rounded once to T, as .to(dtype) does (c10's conversions), 16 at a time where
// AVX-512 has the same rounding: bf16 by c10's round-to-nearest-even on the bits (NaN -> 0x7FC0),
// fp16 by vcvtps2ph (round to nearest even, subnormals kept). The scalar conversions cost more
// than the rest of the dequantization.
template <typename T>
inline void narrow_row(const float* r, T* o, int64_t K) {
  for (int64_t c = 0; c < K; ++c) o[c] = static_cast<T>(r[c]);
}

#if defined(__AVX512F__)
template <>
inline void narrow_row<c10::BFloat16>(const float* r, c10::BFloat16* o, int64_t K) {
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), qnan = _mm512_set1_epi32(0x7FC0);
  int64_t c = 0;
  for (; c + 16 <= K; c += 16) {
    const __m512 v = _mm512_loadu_ps(r + c);
    const __m512i b = _mm512_castps_si512(v);
    __m512i h = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(b, bias), _mm512_and_si512(_mm512_srli_epi32(b, 16), one)), 16);
    h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), qnan);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), _mm512_cvtepi32_epi16(h));
  }
  for (; c < K; ++c) o[c] = static_cast<c10::BFloat16>(r[c]);
}

template <>
inline void narrow_row<c10::Half>(const float* r, c10::Half* o, int64_t K) {
  int64_t c = 0;
  for (; c + 16 <= K; c += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c),
                        _mm512_cvtps_ph(_mm512_loadu_ps(r + c), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  for (; c < K; ++c) o[c] = static_cast<c10::Half>(r[c]);
}
#endif

template <typename T>
void dequantize_rows(const uint8_t* val, const uint8_t* pos, const float* scale, int64_t N, int64_t K, T* out) {
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    DenormalsKept keep;
    std::vector<float> row(std::is_same<T, float>::value ? 0 : K);
    for (int64_t n = n0; n < n1; ++n) {
      if constexpr (std::is_same<T, float>::value) {
        dense_rows(val, pos, scale, n, K, out + n * K);
      } else {
        dense_rows(val, pos, scale, n, K, row.data());
        narrow_row(row.data(), out + n * K, K);  // one rounding, as .to(dtype)
      }
    }
  });
}

void check_weight(const torch::Tensor& qdata, const torch::Tensor& positions, const torch::Tensor& scale, int64_t k) {
  TORCH_CHECK(k > 0 && k % 4 == 0, "k: a positive multiple of 4, got ", k);
  TORCH_CHECK(qdata.dtype() == torch::kUInt8 && qdata.dim() == 2 && qdata.size(1) == k / 2 && qdata.is_contiguous(),
              "qdata: contiguous uint8 [N, ", k / 2, "] (the e4m3 bytes), got ", qdata.dtype(), " ", qdata.sizes());
  const int64_t N = qdata.size(0);
  TORCH_CHECK(positions.dtype() == torch::kUInt8 && positions.dim() == 2 && positions.size(0) == N &&
                  positions.size(1) == (k + 7) / 8 && positions.is_contiguous(),
              "positions: contiguous uint8 [", N, ", ", (k + 7) / 8, "], got ", positions.dtype(), " ", positions.sizes());
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.numel() == N && scale.is_contiguous(), "scale: float32 [N]");
}

}  // namespace

// F.linear(x, 2:4 sparse float8 weight, bias): x float32 / bfloat16 / float16 [..., k] (already
// fake-quantized where the weight quantizes activations); qdata uint8 [N, k/2] (e4m3 bytes);
// positions uint8 [N, ceil(k/8)]; scale float32 [N]; bias optional, any float dtype, [N].
// Computed in float32 on the exact weight, bias added in float32, returned in x's dtype as
// [..., N]. Meant for few rows: each weight row is decoded once per four activation rows.
torch::Tensor fp8_sparse_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor positions, torch::Tensor scale,
                                   int64_t k, c10::optional<torch::Tensor> bias) {
  check_weight(qdata, positions, scale, k);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16");
  const int64_t N = qdata.size(0), V = k / 2, pos_bytes = (k + 7) / 8;
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == N, "bias: expected ", N, " values, got ", bias->numel());
  const auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0);
  auto y = torch::empty({M, N}, x2.options());
  const uint8_t* vp = qdata.data_ptr<uint8_t>();
  const uint8_t* pp = positions.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* xp = x2.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float lift = std::ldexp(1.f, 60);
  at::parallel_for(0, N, 8, [&](int64_t n0, int64_t n1) {
    DenormalsKept keep;
    float acc[4];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* val = vp + n * V;
      const uint8_t* pos = pp + n * pos_bytes;
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m);
        const float* xm = xp + m * k;
        switch (rows) {
          case 4: row_dots<4>(val, pos, V, pos_bytes, xm, k, acc); break;
          case 3: row_dots<3>(val, pos, V, pos_bytes, xm, k, acc); break;
          case 2: row_dots<2>(val, pos, V, pos_bytes, xm, k, acc); break;
          default: row_dots<1>(val, pos, V, pos_bytes, xm, k, acc); break;
        }
        for (int64_t i = 0; i < rows; ++i) yp[(m + i) * N + n] = (acc[i] * lift) * sp[n];
      }
    }
  });
  if (has_bias) y.add_(bias->reshape({N}).to(torch::kFloat32));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}

// The dense weight [N, k] in dtype (float32, bfloat16 or float16), bit for bit the reference's
// dequantize(dtype); for aten's GEMM at many rows.
torch::Tensor fp8_sparse_dequantize(torch::Tensor qdata, torch::Tensor positions, torch::Tensor scale, int64_t k,
                                    torch::ScalarType dtype) {
  check_weight(qdata, positions, scale, k);
  const int64_t N = qdata.size(0);
  auto out = torch::empty({N, k}, qdata.options().dtype(dtype));
  const uint8_t* vp = qdata.data_ptr<uint8_t>();
  const uint8_t* pp = positions.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  switch (dtype) {
    case torch::kFloat32: dequantize_rows(vp, pp, sp, N, k, out.data_ptr<float>()); break;
    case torch::kBFloat16: dequantize_rows(vp, pp, sp, N, k, out.data_ptr<c10::BFloat16>()); break;
    case torch::kFloat16: dequantize_rows(vp, pp, sp, N, k, out.data_ptr<c10::Half>()); break;
    default: TORCH_CHECK(false, "dtype: float32, bfloat16 or float16");
  }
  return out;
}
