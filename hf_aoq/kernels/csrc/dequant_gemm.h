// The many-rows path shared by the int4, int8, float8 and Int4DQ CPU kernels: y = x @ W^T with
// W dequantized to float32 chunk by chunk, never whole.
//
// One parallel region per call. Each thread takes whole chunks of output columns: it
// dequantizes its chunk into its own buffer (sized to stay in its core's L2 cache) and
// multiplies it with a GEMM that runs on that thread alone (BLAS called inside a parallel region
// does not start threads of its own), writing straight into its columns of y. So the
// dequantization is spread over every thread and overlaps the other threads' GEMMs, where
// dequantizing serially between multi-threaded GEMMs left all but one core idle for it (a
// third of a 256-token prefill), and dequantizing in parallel regions of its own between the
// GEMM's regions was 3-4x slower on a shared machine (spinning OpenMP workers).
// Internal linkage (an anonymous namespace), as in every header here.
#pragma once
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// Output columns per chunk: a float32 buffer of about `kBufferFloats` (1 MB), a multiple of
// `align` (the int4 row block), between 2 and 8 blocks of 32.
constexpr int64_t kBufferFloats = int64_t(1) << 18;

inline int64_t gemm_chunk_columns(int64_t K, int64_t align) {
  const int64_t c = std::clamp<int64_t>(kBufferFloats / std::max<int64_t>(K, 1), 64, 256);
  return std::max<int64_t>(align, c / align * align);
}

// x: float32 [M, K] contiguous; y: float32 [M, N] contiguous, filled. `dequant(n0, n1, buf)`
// writes weight rows [n0, n1) as float32: transposed ([K, n1 - n0], for the int4 layouts) when
// `transposed`, else row-major ([n1 - n0, K]). Chunk starts are multiples of `align`.
template <class Dequant>
void dequant_gemm(const torch::Tensor& x, torch::Tensor& y, int64_t N, int64_t K, int64_t align, bool transposed,
                  const Dequant& dequant) {
  const int64_t C = std::min(N, gemm_chunk_columns(K, align));
  const int64_t chunks = (N + C - 1) / C;
  // The workers run ATen ops: they take the caller's thread-local state (inference mode,
  // grad mode), which OpenMP threads do not inherit.
  const at::ThreadLocalState state;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    at::ThreadLocalStateGuard guard(state);
    auto buf = torch::empty({C * K}, x.options());
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * C, n1 = std::min(N, n0 + C), cols = n1 - n0;
      float* bp = buf.data_ptr<float>();
      dequant(n0, n1, bp);
      auto w = transposed ? buf.narrow(0, 0, cols * K).view({K, cols}) : buf.narrow(0, 0, cols * K).view({cols, K}).t();
      auto out = y.narrow(1, n0, cols);
      at::mm_out(out, x, w);
    }
  });
}

// float32 -> T, one value: bfloat16 to nearest, ties to even (c10::BFloat16's conversion, as
// torch's .to(bfloat16) rounds), float16 likewise.
#if defined(__AVX2__)
// Eight float32 values as bfloat16 (their bits, in the low 128 bits), rounded as c10::BFloat16
// rounds: to nearest, ties to even; NaN -> 0x7FC0.
inline __m128i bf16_round8(__m256 v) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF), qnan = _mm256_set1_epi32(0x7FC0);
  const __m256i b = _mm256_castps_si256(v);
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(bias, _mm256_and_si256(_mm256_srli_epi32(b, 16), one))), 16);
  r = _mm256_blendv_epi8(qnan, r, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_ORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
#endif

template <typename T>
inline void narrow_floats(const float* src, T* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX2__)
  if constexpr (std::is_same<T, c10::BFloat16>::value)
    for (; i + 8 <= n; i += 8) _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), bf16_round8(_mm256_loadu_ps(src + i)));
#endif
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

#if defined(__AVX2__)
// v[a][b] -> v[b][a] for an 8x8 float32 tile.
inline void transpose8x8(__m256* v) {
  __m256 t[8], u[8];
  for (int a = 0; a < 8; a += 2) {
    t[a] = _mm256_unpacklo_ps(v[a], v[a + 1]);
    t[a + 1] = _mm256_unpackhi_ps(v[a], v[a + 1]);
  }
  for (int a = 0; a < 8; a += 4) {
    u[a] = _mm256_shuffle_ps(t[a], t[a + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[a + 1] = _mm256_shuffle_ps(t[a], t[a + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[a + 2] = _mm256_shuffle_ps(t[a + 1], t[a + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[a + 3] = _mm256_shuffle_ps(t[a + 1], t[a + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int a = 0; a < 4; ++a) {
    v[a] = _mm256_permute2f128_ps(u[a], u[a + 4], 0x20);
    v[a + 4] = _mm256_permute2f128_ps(u[a], u[a + 4], 0x31);
  }
}
#endif

// The whole weight as [N, k] in `dtype` (bfloat16 or float16), for a GEMM in that dtype (aten's,
// which reaches oneDNN and AMX): each chunk is dequantized to float32 by the same `dequant` as
// dequant_gemm's (exactly as the reference computes it) and rounded once to `dtype`, as the
// reference's `.to(dtype)` rounds (to nearest, ties to even). So the result equals the
// reference's weight.dequantize(dtype) bit for bit (NaN aside). Columns past k (group padding)
// are dropped.
template <typename T, class Dequant>
void dequant_weight_into(T* out, int64_t N, int64_t K, int64_t k, int64_t align, bool transposed, const Dequant& dequant) {
  const int64_t C = std::min(N, gemm_chunk_columns(K, align));
  const int64_t chunks = (N + C - 1) / C;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> buf(transposed ? C * K : K), rows(transposed ? 8 * k : 0);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * C, n1 = std::min(N, n0 + C), cols = n1 - n0;
      if (!transposed) {  // a row at a time: its float32 buffer stays in L1 (a chunk's did not)
        for (int64_t n = n0; n < n1; ++n) {
          dequant(n, n + 1, buf.data());
          narrow_floats(buf.data(), out + n * k, k);
        }
        continue;
      }
      dequant(n0, n1, buf.data());
      // buf is [K, cols]: 8 output rows at a time transposed into `rows` ([8, k], 8x8 tiles in
      // registers), then narrowed.
      for (int64_t r0 = 0; r0 < cols; r0 += 8) {
        const int64_t nr = std::min<int64_t>(8, cols - r0);
        int64_t i = 0;
#if defined(__AVX2__)
        if (nr == 8)
          for (; i + 8 <= k; i += 8) {
            __m256 v[8];
            for (int a = 0; a < 8; ++a) v[a] = _mm256_loadu_ps(buf.data() + (i + a) * cols + r0);
            transpose8x8(v);
            for (int b = 0; b < 8; ++b) _mm256_storeu_ps(rows.data() + b * k + i, v[b]);
          }
#endif
        for (; i < k; ++i)
          for (int64_t b = 0; b < nr; ++b) rows[b * k + i] = buf[i * cols + r0 + b];
        for (int64_t b = 0; b < nr; ++b) narrow_floats(rows.data() + b * k, out + (n0 + r0 + b) * k, k);
      }
    }
  });
}

template <class Dequant>
torch::Tensor dequant_weight(int64_t N, int64_t K, int64_t k, int64_t align, bool transposed, torch::ScalarType dtype,
                             const Dequant& dequant) {
  TORCH_CHECK(dtype == torch::kBFloat16 || dtype == torch::kFloat16, "dtype: bfloat16 or float16");
  TORCH_CHECK(k <= K, "k must not exceed the weight's (padded) columns");
  auto out = torch::empty({N, k}, torch::TensorOptions().dtype(dtype));
  if (dtype == torch::kBFloat16)
    dequant_weight_into(out.data_ptr<c10::BFloat16>(), N, K, k, align, transposed, dequant);
  else
    dequant_weight_into(out.data_ptr<c10::Half>(), N, K, k, align, transposed, dequant);
  return out;
}

}  // namespace
