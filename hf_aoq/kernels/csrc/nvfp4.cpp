// NVFP4 (e2m1 elements two per byte, one float8 e4m3 scale per 16 elements along K, one float32
// scale per tensor) weight x float activation on CPU for few rows: F.linear(x, w, bias) in
// float32, reading the packed weight directly (fp4.h's lane layout and exact table decode).
//
// A 64-element chunk holds four blocks of 16: lanes 2b and 2b + 1 are block b. The chunk's four
// e4m3 scale bytes are decoded in registers: (byte & 0x7F) << 20 puts exponent and mantissa
// where float32 has them, read as a float that is the value times 2^-120 (e4m3 subnormals
// become float32 subnormals, exactly), so one multiply by 2^120 gives the value; the sign is bit
// 7 moved to bit 31, and 0x7F / 0xFF are NaN. Times the per-tensor scale (float32, the
// reference's block_scales), spread to the lane pairs, it multiplies each lane's partial sums.
// Denormals are neither flushed nor treated as zero during the call (the decode needs them).
// The AVX-512 build reads 64 bytes at a time and decodes codes by the whole 16-entry e2m1 table.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>

#include "fp4.h"
#include "hf_aoq_cpu.h"
#include "simd.h"

namespace {

using namespace hf_aoq_fp4;
constexpr int64_t BLOCK = 16;

// float32 value of an e4m3fn byte (scalar: the generic build, and the tests' meaning of the code).
inline float e4m3(uint8_t b) {
  if ((b & 0x7F) == 0x7F) return std::nanf("");
  const float mag = bits_to_float(uint32_t(b & 0x7F) << 20) * 0x1p120f;
  return (b & 0x80) ? -mag : mag;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// AVX-512: 64 bytes (128 elements, eight blocks) per load, sixteen 32-bit lanes; lane j holds
// elements 8j .. 8j + 7 and blocks are lane pairs, as in fp4.h's 32-byte layout. vpermps on zmm
// reads four index bits, so the whole 16-entry e2m1 table (signs included) decodes a code in one
// instruction. The scale decode is the AVX2 one on eight bytes.
constexpr int64_t CHUNK_BYTES = 64;

inline __m512 chunk_scales(const uint8_t* sc, int64_t c, int64_t B, __m256 pts) {
  const int64_t left = std::min<int64_t>(8, B - 8 * c);
  const __m128i bytes = _mm_maskz_loadu_epi8(__mmask16((1u << left) - 1), sc + 8 * c);
  const __m256i b = _mm256_cvtepu8_epi32(bytes);
  const __m256i low = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(low, 20)), _mm256_set1_ps(0x1p120f));
  v = _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24)));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cmpeq_epi32(low, _mm256_set1_epi32(0x7F)));
  v = _mm256_blendv_ps(v, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
  v = _mm256_mul_ps(v, pts);
  const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  return _mm512_permutexvar_ps(spread, _mm512_castps256_ps512(v));
}

template <int MB>
inline void row_dots(const uint8_t* row, const uint8_t* sc, int64_t K, float pts, const float* xp, int64_t stride,
                     float* acc) {
  const __m512 table = _mm512_loadu_ps(E2M1);
  const __m256 p = _mm256_set1_ps(pts);
  const int64_t B = (K + BLOCK - 1) / BLOCK, row_bytes = K / 2, chunks = (row_bytes + CHUNK_BYTES - 1) / CHUNK_BYTES;
  __m512 total[MB];
  for (int i = 0; i < MB; ++i) total[i] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t left = std::min<int64_t>(CHUNK_BYTES, row_bytes - c * CHUNK_BYTES);
    const __mmask64 mask = left == 64 ? ~__mmask64(0) : (__mmask64(1) << left) - 1;
    const __m512i v = _mm512_maskz_loadu_epi8(mask, row + c * CHUNK_BYTES);
    const __m512 scale = chunk_scales(sc, c, B, p);
    __m512 a[MB], b[MB];
    for (int i = 0; i < MB; ++i) a[i] = b[i] = _mm512_setzero_ps();
    const float* xc = xp + c * 2 * CHUNK_BYTES;
#define HF_AOQ_NVFP4_STEP(T, ACC)                                                                     \
  {                                                                                                   \
    const __m512 w = _mm512_permutexvar_ps(T ? _mm512_srli_epi32(v, 4 * T) : v, table);               \
    for (int i = 0; i < MB; ++i) ACC[i] = _mm512_fmadd_ps(_mm512_loadu_ps(xc + i * stride + 16 * T), w, ACC[i]); \
  }
    HF_AOQ_NVFP4_STEP(0, a) HF_AOQ_NVFP4_STEP(1, b) HF_AOQ_NVFP4_STEP(2, a) HF_AOQ_NVFP4_STEP(3, b)
    HF_AOQ_NVFP4_STEP(4, a) HF_AOQ_NVFP4_STEP(5, b) HF_AOQ_NVFP4_STEP(6, a) HF_AOQ_NVFP4_STEP(7, b)
#undef HF_AOQ_NVFP4_STEP
    for (int i = 0; i < MB; ++i) total[i] = _mm512_fmadd_ps(_mm512_add_ps(a[i], b[i]), scale, total[i]);
  }
  for (int i = 0; i < MB; ++i) acc[i] = _mm512_reduce_add_ps(total[i]);
}
#elif defined(__AVX2__)
constexpr int64_t CHUNK_BYTES = 32;

// The whole scales of blocks 4c .. 4c + 3 of a row (0 past its B blocks), lane-pair spread.
inline __m256 chunk_scales(const uint8_t* sc, int64_t c, int64_t B, __m128 pts) {
  uint32_t four = 0;
  std::memcpy(&four, sc + 4 * c, size_t(std::min<int64_t>(4, B - 4 * c)));
  const __m128i b = _mm_cvtepu8_epi32(_mm_cvtsi32_si128(int(four)));
  const __m128i low = _mm_and_si128(b, _mm_set1_epi32(0x7F));
  __m128 v = _mm_mul_ps(_mm_castsi128_ps(_mm_slli_epi32(low, 20)), _mm_set1_ps(0x1p120f));
  v = _mm_or_ps(v, _mm_castsi128_ps(_mm_slli_epi32(_mm_and_si128(b, _mm_set1_epi32(0x80)), 24)));
  const __m128 nan = _mm_castsi128_ps(_mm_cmpeq_epi32(low, _mm_set1_epi32(0x7F)));
  v = _mm_blendv_ps(v, _mm_castsi128_ps(_mm_set1_epi32(0x7FC00000)), nan);
  v = _mm_mul_ps(v, pts);
  return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(v), _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
}

// Dot products of one weight row (bytes `row`, scale bytes `sc`, K elements) with MB permuted
// activation rows (xp, `stride` floats apart); acc gets them.
template <int MB>
inline void row_dots(const uint8_t* row, const uint8_t* sc, int64_t K, float pts, const float* xp, int64_t stride,
                     float* acc) {
  const __m256 table = e2m1_table();
  const __m128 p = _mm_set1_ps(pts);
  const int64_t B = (K + BLOCK - 1) / BLOCK, chunks = (K + CHUNK - 1) / CHUNK, row_bytes = K / 2;
  __m256 total[MB];
  for (int i = 0; i < MB; ++i) total[i] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const __m256i v = load_chunk(row, c, row_bytes);
    const __m256 scale = chunk_scales(sc, c, B, p);
    __m256 a[MB], b[MB];
    for (int i = 0; i < MB; ++i) a[i] = b[i] = _mm256_setzero_ps();
    const float* xc = xp + c * CHUNK;
#define HF_AOQ_NVFP4_STEP(T, ACC)                                                                   \
  {                                                                                                 \
    const __m256 w = e2m1_decode<T>(v, table);                                                      \
    for (int i = 0; i < MB; ++i) ACC[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xc + i * stride + 8 * T), w, ACC[i]); \
  }
    HF_AOQ_NVFP4_STEP(0, a) HF_AOQ_NVFP4_STEP(1, b) HF_AOQ_NVFP4_STEP(2, a) HF_AOQ_NVFP4_STEP(3, b)
    HF_AOQ_NVFP4_STEP(4, a) HF_AOQ_NVFP4_STEP(5, b) HF_AOQ_NVFP4_STEP(6, a) HF_AOQ_NVFP4_STEP(7, b)
#undef HF_AOQ_NVFP4_STEP
    for (int i = 0; i < MB; ++i) total[i] = _mm256_fmadd_ps(_mm256_add_ps(a[i], b[i]), scale, total[i]);
  }
  for (int i = 0; i < MB; ++i) acc[i] = hsum(total[i]);
}
#else
constexpr int64_t CHUNK_BYTES = 32;
#endif

// The same sums in plain C++ (the generic build), block by block.
inline void row_dots_scalar(const uint8_t* row, const uint8_t* sc, int64_t K, float pts, const float* xp,
                            int64_t stride, int64_t rows, float* acc) {
  const int64_t B = (K + BLOCK - 1) / BLOCK;
  for (int64_t i = 0; i < rows; ++i) {
    float total = 0.f;
    for (int64_t blk = 0; blk < B; ++blk) {
      float part = 0.f;
      for (int64_t k = blk * BLOCK; k < std::min(K, (blk + 1) * BLOCK); ++k) {
        const uint8_t byte = row[k / 2];
        part += permuted(xp + i * stride, k, 2 * CHUNK_BYTES) * E2M1[(k % 2) ? byte >> 4 : byte & 15];
      }
      total += part * (pts * e4m3(sc[blk]));
    }
    acc[i] = total;
  }
}

}  // namespace

// F.linear(x, NVFP4 weight, bias): x float32 / bfloat16 / float16 [..., k]; qdata uint8 [N, k/2]
// (two e2m1 codes per byte, the even element low); scale float8_e4m3fn [N, ceil(k/16)];
// per_tensor_scale float32, one value; bias optional, any float dtype, [N]. Computed in float32
// (the weight decoded exactly), bias added in float32, returned in x's dtype as [..., N]. Meant
// for few rows: each weight row is decoded once per four activation rows.
torch::Tensor nvfp4_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale,
                              torch::Tensor per_tensor_scale, int64_t k, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(k > 0 && k % 2 == 0, "k: a positive even number, got ", k);
  TORCH_CHECK(qdata.dtype() == torch::kUInt8 && qdata.dim() == 2 && qdata.size(1) == k / 2,
              "qdata: uint8 [N, ", k / 2, "], got ", qdata.dtype(), " ", qdata.sizes());
  const int64_t N = qdata.size(0), B = (k + BLOCK - 1) / BLOCK;
  TORCH_CHECK(scale.scalar_type() == torch::kFloat8_e4m3fn && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == B,
              "scale: float8_e4m3fn [", N, ", ", B, "], got ", scale.dtype(), " ", scale.sizes());
  TORCH_CHECK(per_tensor_scale.scalar_type() == torch::kFloat32 && per_tensor_scale.numel() == 1,
              "per_tensor_scale: one float32 value, got ", per_tensor_scale.dtype(), " ", per_tensor_scale.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == N, "bias: expected ", N, " values, got ", bias->numel());
  const float pts = per_tensor_scale.item<float>();
  const auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t chunk = 2 * CHUNK_BYTES;  // elements per load of the build's vector width
  const int64_t M = x2.size(0), chunks = (k + chunk - 1) / chunk, stride = chunks * chunk;
  auto xperm = torch::empty({M, stride}, x2.options());
  permute_rows(x2.data_ptr<float>(), xperm.data_ptr<float>(), M, k, chunks, chunk);
  const auto q = qdata.contiguous();
  const auto s = scale.contiguous();
  auto y = torch::empty({M, N}, x2.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* sp = static_cast<const uint8_t*>(s.data_ptr());
  const float* xp = xperm.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    DenormalsKept keep;
    float acc[4];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = qp + n * (k / 2);
      const uint8_t* sc = sp + n * B;
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m);
        const float* xm = xp + m * stride;
#if defined(__AVX2__) || defined(__AVX512F__)
        switch (rows) {
          case 4: row_dots<4>(row, sc, k, pts, xm, stride, acc); break;
          case 3: row_dots<3>(row, sc, k, pts, xm, stride, acc); break;
          case 2: row_dots<2>(row, sc, k, pts, xm, stride, acc); break;
          default: row_dots<1>(row, sc, k, pts, xm, stride, acc); break;
        }
#else
        row_dots_scalar(row, sc, k, pts, xm, stride, rows, acc);
#endif
        for (int64_t i = 0; i < rows; ++i) yp[(m + i) * N + n] = acc[i];
      }
    }
  });
  if (has_bias) y.add_(bias->reshape({N}).to(torch::kFloat32));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}
