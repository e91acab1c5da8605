// An int8 weight as the entries that take its codes whole (int8.cpp's dequantizing and bf16 panel
// entries, int8dyn.cpp's integer ones) check and read it. Internal linkage, as in every header here.
#pragma once
#include <torch/types.h>

namespace {

// q int8 [N, K] contiguous, its scale ([N] or [N, 1], any float dtype) as contiguous float32 [N].
struct Int8Weight {
  const int8_t* q;
  int64_t N, K;
  torch::Tensor scale;
};

inline Int8Weight check_int8_weight(const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous(), "q: contiguous int8 [N, K]");
  const auto s = scale.reshape({-1}).to(torch::kFloat32).contiguous();
  TORCH_CHECK(s.numel() == q.size(0), "scale: one value per row");
  return Int8Weight{q.data_ptr<int8_t>(), q.size(0), q.size(1), s};
}

}  // namespace
