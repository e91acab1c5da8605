// MXFP4 (OCP MX, e2m1 elements two per byte, one e8m0 scale per 32 elements along K) weight x
// float activation on CPU for few rows: F.linear(x, w, bias) in float32, reading the packed
// weight directly.
//
// Decoding without shuffling bytes: 32 bytes of a row (64 elements, blocks 2c and 2c + 1) load as
// eight 32-bit lanes; lane j holds elements 8j .. 8j + 7, element 8j + t in nibble t (the even
// element in the low nibble, little endian). So (lane >> 4t) has element 8j + t's code in its low
// four bits, for every lane at once. Its magnitude comes from an 8-entry table by the low three
// bits (vpermps ignores the others), its sign is the code's bit 3 moved to bit 31 by (lane >> 4t) << 28.
// That shift also moves the magnitude bits to bits 28..30, so the table holds each magnitude's
// bits XOR (index << 28), which the same XOR cancels: exact e2m1 values, no rounding. The
// activation row is permuted once per call to match (vector t of chunk c holds x[64c + 8j + t]),
// with zeros past K; a last partial chunk of the weight is copied into a zeroed buffer. Each
// block's partial sums are multiplied by its scale 2^(s - 127) (built from the bits: s = 0 is the
// float32 subnormal 2^-127, s = 255 NaN, as the reference's e8m0_to_float) and accumulated in
// float32. Denormals are neither flushed nor treated as zero during the call.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__SSE__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hf_aoq_cpu.h"
#include "simd.h"

namespace {

constexpr int64_t BLOCK = 32;
constexpr int64_t CHUNK = 64;  // elements per 32-byte load: two blocks
const float E2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float bits_to_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

inline float e8m0(uint8_t s) {
  return bits_to_float(s == 255 ? 0x7FC00000u : s == 0 ? 0x00400000u : uint32_t(s) << 23);
}

struct DenormalsKept {
#if defined(__SSE__) || defined(__AVX2__)
  unsigned int saved;
  DenormalsKept() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }  // clear FTZ and DAZ
  ~DenormalsKept() { _mm_setcsr(saved); }
#endif
};

// Activation rows [M, K] (float32) as [M, chunks, 8 (t), 8 (j)]: x[64c + 8j + t], zero past K.
void permute_rows(const float* x, float* xp, int64_t M, int64_t K, int64_t chunks) {
  for (int64_t m = 0; m < M; ++m) {
    const float* s = x + m * K;
    float* d = xp + m * chunks * CHUNK;
    for (int64_t c = 0; c < chunks; ++c)
      for (int64_t t = 0; t < 8; ++t)
        for (int64_t j = 0; j < 8; ++j) {
          const int64_t k = c * CHUNK + 8 * j + t;
          d[c * CHUNK + 8 * t + j] = k < K ? s[k] : 0.f;
        }
  }
}

#if defined(__AVX2__)
// Dot products of one weight row (bytes `row`, scales `sc`, K elements) with MB permuted activation
// rows (xp, `stride` floats apart); acc gets them.
template <int MB>
inline void row_dots(const uint8_t* row, const uint8_t* sc, int64_t K, const float* xp, int64_t stride,
                     float* acc) {
  alignas(32) static const uint32_t table_bits[8] = {
      0x00000000u ^ (0u << 28), 0x3F000000u ^ (1u << 28), 0x3F800000u ^ (2u << 28), 0x3FC00000u ^ (3u << 28),
      0x40000000u ^ (4u << 28), 0x40400000u ^ (5u << 28), 0x40800000u ^ (6u << 28), 0x40C00000u ^ (7u << 28)};
  const __m256 table = _mm256_load_ps(reinterpret_cast<const float*>(table_bits));
  const int64_t B = (K + BLOCK - 1) / BLOCK, chunks = (K + CHUNK - 1) / CHUNK, full = K / CHUNK;
  const int64_t row_bytes = K / 2;
  __m256 total[MB];
  for (int i = 0; i < MB; ++i) total[i] = _mm256_setzero_ps();
  alignas(32) uint8_t tail[32];
  for (int64_t c = 0; c < chunks; ++c) {
    __m256i v;
    if (c < full) {
      v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c * 32));
    } else {
      std::memset(tail, 0, sizeof(tail));
      std::memcpy(tail, row + c * 32, size_t(row_bytes - c * 32));
      v = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
    }
    const float s0 = e8m0(sc[2 * c]), s1 = 2 * c + 1 < B ? e8m0(sc[2 * c + 1]) : 0.f;
    const __m256 scale = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(s0)), _mm_set1_ps(s1), 1);
    __m256 a[MB], b[MB];
    for (int i = 0; i < MB; ++i) a[i] = b[i] = _mm256_setzero_ps();
#define HF_AOQ_MX_STEP(T, ACC)                                                                                 \
  {                                                                                                            \
    const __m256i idx = T ? _mm256_srli_epi32(v, 4 * T) : v;                                                   \
    const __m256 mag = _mm256_permutevar8x32_ps(table, idx);                                                   \
    const __m256 w = _mm256_xor_ps(mag, _mm256_castsi256_ps(_mm256_slli_epi32(idx, 28)));              \
    for (int i = 0; i < MB; ++i) ACC[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i * stride + c * CHUNK + 8 * T), w, ACC[i]); \
  }
    HF_AOQ_MX_STEP(0, a) HF_AOQ_MX_STEP(1, b) HF_AOQ_MX_STEP(2, a) HF_AOQ_MX_STEP(3, b)
    HF_AOQ_MX_STEP(4, a) HF_AOQ_MX_STEP(5, b) HF_AOQ_MX_STEP(6, a) HF_AOQ_MX_STEP(7, b)
#undef HF_AOQ_MX_STEP
    for (int i = 0; i < MB; ++i) total[i] = _mm256_fmadd_ps(_mm256_add_ps(a[i], b[i]), scale, total[i]);
  }
  for (int i = 0; i < MB; ++i) acc[i] = hsum(total[i]);
}
#endif

// The same sums in plain C++ (the generic build), block by block.
inline void row_dots_scalar(const uint8_t* row, const uint8_t* sc, int64_t K, const float* xp, int64_t stride,
                            int64_t rows, float* acc) {
  const int64_t B = (K + BLOCK - 1) / BLOCK;
  for (int64_t i = 0; i < rows; ++i) {
    float total = 0.f;
    for (int64_t blk = 0; blk < B; ++blk) {
      float part = 0.f;
      for (int64_t k = blk * BLOCK; k < std::min(K, (blk + 1) * BLOCK); ++k) {
        const uint8_t byte = row[k / 2];
        const int64_t c = k / CHUNK, r = k % CHUNK;
        part += xp[i * stride + c * CHUNK + 8 * (r % 8) + r / 8] * E2M1[(k % 2) ? byte >> 4 : byte & 15];
      }
      total += part * e8m0(sc[blk]);
    }
    acc[i] = total;
  }
}

}  // namespace

// F.linear(x, MXFP4 weight, bias): x float32 / bfloat16 / float16 [..., k]; qdata uint8 [N, k/2]
// (two e2m1 codes per byte, the even element low); scale uint8 [N, ceil(k/32)] (e8m0 codes);
// bias optional, any float dtype, [N]. Computed in float32 (the weight decoded exactly), bias
// added in float32, returned in x's dtype as [..., N]. Meant for few rows: each weight row is
// decoded once per four activation rows.
torch::Tensor mxfp4_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, int64_t k,
                              c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(k > 0 && k % 2 == 0, "k: a positive even number, got ", k);
  TORCH_CHECK(qdata.dtype() == torch::kUInt8 && qdata.dim() == 2 && qdata.size(1) == k / 2,
              "qdata: uint8 [N, ", k / 2, "], got ", qdata.dtype(), " ", qdata.sizes());
  const int64_t N = qdata.size(0), B = (k + BLOCK - 1) / BLOCK;
  TORCH_CHECK(scale.dtype() == torch::kUInt8 && scale.dim() == 2 && scale.size(0) == N && scale.size(1) == B,
              "scale: uint8 [", N, ", ", B, "], got ", scale.dtype(), " ", scale.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == N, "bias: expected ", N, " values, got ", bias->numel());
  const auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0), chunks = (k + CHUNK - 1) / CHUNK, stride = chunks * CHUNK;
  auto xperm = torch::empty({M, stride}, x2.options());
  permute_rows(x2.data_ptr<float>(), xperm.data_ptr<float>(), M, k, chunks);
  const auto q = qdata.contiguous();
  const auto s = scale.contiguous();
  auto y = torch::empty({M, N}, x2.options());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const uint8_t* sp = s.data_ptr<uint8_t>();
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
#if defined(__AVX2__)
        switch (rows) {
          case 4: row_dots<4>(row, sc, k, xm, stride, acc); break;
          case 3: row_dots<3>(row, sc, k, xm, stride, acc); break;
          case 2: row_dots<2>(row, sc, k, xm, stride, acc); break;
          default: row_dots<1>(row, sc, k, xm, stride, acc); break;
        }
#else
        row_dots_scalar(row, sc, k, xm, stride, rows, acc);
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
