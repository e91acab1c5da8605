// A plain bf16 weight (an nn.Linear that hf_aoq left unquantized, such as the lm_head) against a
// few activation rows: the decode step's GEMV, read at the memory's rate.
//
// aten's bf16 GEMV (oneDNN) read a [32000, 2048] bf16 weight at 15-18 GB/s on a 2-core AMD EPYC
// Zen 4 (2 threads, 3 weights cycled from DRAM): a quarter of an int4 model's decode token went to
// its bf16 lm_head. Here each weight row is read once, widened to float32 in registers (a bf16 is
// the top half of a float32: exact) and dotted with the float32 activation rows (simd.h dot_rows
// and tiled_dots, as the int8 and float8 GEMVs): 26-28 GB/s at one row in the same runs.
// The sums are float32 in simd.h's lane order, the same in the AVX2 and AVX-512 builds, so both
// give the same bits; against aten's GEMV only the order of the float32 sums differs.
#include <torch/types.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hf_aoq_cpu.h"
#include "simd.h"

namespace {

// y [M, N] = x [M, K] (float32) w^T, w bf16 [N, K] as raw uint16: one activation row kDotRows weight
// rows at a time, more rows in tiles of four weight rows by several activation rows; without AVX2,
// one product at a time.
void bf16_gemv(const float* x, const uint16_t* w, float* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX2__)
  const auto lanes = [](const uint16_t* p) { return bf16_lanes(p); };
  const auto one = [](uint16_t c) { return bf16_to_float(c); };
  // Four rows at a time, the next four's lines asked for into L2 as they are read (simd.h): 26-27
  // GB/s against 22-23 for eight rows asked for into L1, Zen 4, [32000, 2048], three runs.
  constexpr int kRows = 4;
  if (M == 1 && N >= kRows) {  // the last block starts kRows from the end
    at::parallel_for(0, (N + kRows - 1) / kRows, 4, [&](int64_t b0, int64_t b1) {
      float d[kRows];
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t n = std::min(kRows * b, N - kRows);
        dot_rows<kRows>(x, w + n * K, K, lanes, one, d);
        for (int j = 0; j < kRows; ++j) y[n + j] = d[j];
      }
    });
    return;
  }
  at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t b0, int64_t b1) {
    tiled_dots(x, w, M, N, K, b0, b1, lanes, one, [&](int64_t m, int64_t n, float d) { y[m * N + n] = d; });
  });
#else
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        float acc = 0.f;
        for (int64_t k = 0; k < K; ++k) acc += x[m * K + k] * bf16_to_float(w[n * K + k]);
        y[m * N + n] = acc;
      }
  });
#endif
}

}  // namespace

// x: float32 [M, K] contiguous; w: bfloat16 [N, K] contiguous. Returns float32 [M, N] = x w^T.
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.is_contiguous(),
              "w: contiguous bfloat16 [N, K], got ", w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous() && x.size(1) == w.size(1),
              "x: contiguous float32 [M, ", w.size(1), "], got ", x.scalar_type(), " ", x.sizes());
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M > 0 && N > 0)
    bf16_gemv(x.data_ptr<float>(), reinterpret_cast<const uint16_t*>(w.data_ptr()), y.data_ptr<float>(), M, N, K);
  return y;
}
