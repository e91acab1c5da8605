// The activation dtypes the kernels take (float32, bfloat16, float16): f called with a value of
// the matching C++ type, or a clear error for any other dtype.
#pragma once
#include <torch/types.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

namespace {

template <class F>
void dispatch_float(torch::ScalarType t, F f) {
  switch (t) {
    case torch::kFloat32: f(float()); break;
    case torch::kBFloat16: f(c10::BFloat16()); break;
    case torch::kFloat16: f(c10::Half()); break;
    default: TORCH_CHECK(false, "x: float32, bfloat16 or float16, got ", t);
  }
}

}  // namespace
