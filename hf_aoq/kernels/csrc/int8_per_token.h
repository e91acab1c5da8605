// Int8Tensor's per-token activation codes, the rule of kernels/common.py quantize_int8_per_token
// in the same float32 operations: a row's scale s = max(max|x| / 127, 1e-12) (NaN for a row
// holding a NaN, as torch's amax keeps it), each code round(x / s) (a true division, ties to even)
// clamped to [-127, 127]. The scalar form for the kernels that quantize a row at a time; int8dyn.cpp
// has the AVX-512 form of the same operations (int8dyn_quantize_rows).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

// The scale of the row x[0..K).
inline float int8_row_scale(const float* x, int64_t K) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t k = 0; k < K; ++k) {
    amax = std::max(amax, std::fabs(x[k]));
    nan = nan || std::isnan(x[k]);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : std::max(amax / 127.f, 1e-12f);
}

// The code of x on scale s, as a float (NaN where x / s is NaN).
inline float int8_code(float x, float s) { return std::min(std::max(std::nearbyint(x / s), -127.f), 127.f); }

}  // namespace
