// Float8 weight x float activation on CPU, reading the float8 weight directly.
//
// aten has no fused float8 CPU kernel: upcasting the whole weight on every call costs more
// than the bf16 matmul it replaces. Here each weight row is read once, widened to float32 with
// a bit trick in registers, and dotted with every activation row.
//
// The bit trick: place a float8 code's exponent and mantissa bits at the top of a float32's
// exponent and mantissa (sign stays the sign). The float32 then equals the float8 value times
// 2^-(127 - bias8) for normal and subnormal codes alike, so one multiply (folded into the
// per-row scale) restores it: e4m3fn shift 20, factor 2^120; e5m2 shift 21, factor 2^112.
// Subnormal float32 inputs must not be flushed, so DAZ is cleared for the call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline float code_to_scaled_float(uint8_t b, int shift) {
  uint32_t bits = (uint32_t(b & 0x80) << 24) | (uint32_t(b & 0x7F) << shift);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct DenormalsKept {
#if defined(__SSE__) || defined(__AVX2__)
  unsigned int saved;
  DenormalsKept() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x0040u); }  // clear DAZ
  ~DenormalsKept() { _mm_setcsr(saved); }
#endif
};

#if defined(__AVX2__)
inline __m256 codes_to_scaled_floats(const uint8_t* p, int shift) {
  __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  __m256i b = _mm256_cvtepu8_epi32(bytes);
  __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  __m256i em = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  __m256i body = shift == 20 ? _mm256_slli_epi32(em, 20) : _mm256_slli_epi32(em, 21);
  return _mm256_castsi256_ps(_mm256_or_si256(sign, body));
}
#endif

}  // namespace

// x: float32 [M, K]; codes: uint8 [N, K] (float8 bits); row_scale: float32 [N] (already times
// the 2^120 / 2^112 factor). Returns float32 [M, N].
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor row_scale, int64_t shift) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: contiguous uint8 [N, K]");
  TORCH_CHECK(row_scale.dtype() == torch::kFloat32 && row_scale.numel() == codes.size(0), "row_scale: float32 [N]");
  TORCH_CHECK(shift == 20 || shift == 21, "shift: 20 (e4m3fn) or 21 (e5m2)");
  TORCH_CHECK(x.size(1) == codes.size(1), "x and codes disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = row_scale.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int s = static_cast<int>(shift);
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    DenormalsKept keep;
    constexpr int64_t MB = 4;  // activation rows per pass over a weight row
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = cp + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = std::min<int64_t>(MB, M - m0);
        float acc[MB] = {0.f, 0.f, 0.f, 0.f};
        int64_t k = 0;
#if defined(__AVX2__)
        __m256 vacc[MB] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
        for (; k + 8 <= K; k += 8) {
          __m256 w = codes_to_scaled_floats(row + k, s);
          for (int64_t i = 0; i < mb; ++i)
            vacc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + (m0 + i) * K + k), w, vacc[i]);
        }
        for (int64_t i = 0; i < mb; ++i) {
          __m128 lo = _mm256_castps256_ps128(vacc[i]), hi = _mm256_extractf128_ps(vacc[i], 1);
          __m128 v = _mm_add_ps(lo, hi);
          v = _mm_hadd_ps(v, v);
          v = _mm_hadd_ps(v, v);
          acc[i] = _mm_cvtss_f32(v);
        }
#endif
        for (; k < K; ++k) {
          const float w = code_to_scaled_float(row[k], s);
          for (int64_t i = 0; i < mb; ++i) acc[i] += xp[(m0 + i) * K + k] * w;
        }
        for (int64_t i = 0; i < mb; ++i) op[(m0 + i) * N + n] = acc[i] * sp[n];
      }
    }
  });
  return out;
}
