// Int4Tensor's per-group parameters for the int4 kernels (int4_pairs.h): scale and zero from
// scale_zero [groups, N, 2] in float32, bfloat16 or float16; the weight is (q - 8) * scale + zero.
// Shared by int4.cpp (float activations) and int8_int4.cpp (integer activation codes).
#pragma once
#include <torch/types.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace {

template <typename T>
struct ScaleZeroParams {
  static constexpr float offset = 8.f;
  const T* sz;
  int64_t N;
  void operator()(int64_t g, int64_t n0, int64_t rows, float* s, float* z) const {
    const T* p = sz + (g * N + n0) * 2;
    for (int64_t r = 0; r < rows; ++r) {
      s[r] = static_cast<float>(p[2 * r]);
      z[r] = static_cast<float>(p[2 * r + 1]);
    }
  }
};

// Checks scale_zero against K, N and group_size, then calls f(params) with the provider for its dtype.
template <class F>
void with_scale_zero(const torch::Tensor& scale_zero, int64_t N, int64_t K, int64_t group_size, F f) {
  TORCH_CHECK(N % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0, "K must be a multiple of an even group_size");
  TORCH_CHECK(scale_zero.dim() == 3 && scale_zero.size(0) == K / group_size && scale_zero.size(1) == N &&
                  scale_zero.size(2) == 2 && scale_zero.is_contiguous(),
              "scale_zero: contiguous [K/group_size, N, 2]");
  switch (scale_zero.scalar_type()) {
    case torch::kFloat32: f(ScaleZeroParams<float>{scale_zero.data_ptr<float>(), N}); break;
    case torch::kBFloat16: f(ScaleZeroParams<c10::BFloat16>{scale_zero.data_ptr<c10::BFloat16>(), N}); break;
    case torch::kFloat16: f(ScaleZeroParams<c10::Half>{scale_zero.data_ptr<c10::Half>(), N}); break;
    default: TORCH_CHECK(false, "scale_zero: float32, bfloat16 or float16");
  }
}

}  // namespace
