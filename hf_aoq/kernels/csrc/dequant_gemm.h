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
#include <algorithm>

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

}  // namespace
