// The eager entry points: F.linear(x, weight, bias) for each weight format in one call.
//
// Each does the linear's input and output handling here rather than in Python, where its
// handful of small ops cost more than a small layer's kernel at batch 1. The kernels themselves
// are in int4.cpp, int4dq.cpp, int8.cpp and fp8.cpp (declared in hf_aoq_cpu.h). Eager calls
// and torch.compile's graphs (as opaque ops) both come here. Row-count crossovers (gemv_max_rows)
// are passed in from kernels/cpu.py, where each is defined; only the C++ compares rows with them.
#include <torch/types.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "float_dtypes.h"
#include "hf_aoq_cpu.h"
#include "int8_per_token.h"

namespace {

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

// Rows of x (contiguous, [M, k], dtype T) as float32 [M, padded_k], zero past k: one allocation
// and a loop, where reshape + to + pad are several dispatched ops (a few microseconds each,
// twice per linear and per token).
template <typename T>
void widen_rows(const T* src, float* dst, int64_t M, int64_t k, int64_t padded_k) {
  for (int64_t m = 0; m < M; ++m) {
    const T* s = src + m * k;
    float* d = dst + m * padded_k;
    for (int64_t i = 0; i < k; ++i) d[i] = to_float(s[i]);
    for (int64_t i = k; i < padded_k; ++i) d[i] = 0.f;
  }
}

// out = T(y + bias) elementwise (bias may be null): float32 add, then one rounding to T, as
// (y + bias.float()).to(T) does.
template <typename T>
void narrow_rows(const float* y, const float* bias, T* out, int64_t M, int64_t n) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < n; ++j) out[m * n + j] = static_cast<T>(bias ? y[m * n + j] + bias[j] : y[m * n + j]);
}

// x of any float dtype and shape [..., k] becomes float32 [M, padded_k] (zero columns past k),
// `core` maps that to float32 [M, n], the bias (any float dtype) is added in float32 and the
// result returns in x's dtype as [..., n]. The numbers are those of x.float(), padding, the
// kernel, + bias.float(), .to(dtype).
template <class Core>
torch::Tensor linear_io(const torch::Tensor& x, int64_t k, int64_t padded_k, int64_t n,
                        const c10::optional<torch::Tensor>& bias, Core core) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == n, "bias: expected ", n, " values, got ", bias->numel());
  const auto xc = x.contiguous();
  const int64_t M = k ? xc.numel() / k : 0;
  torch::Tensor x2;
  if (x.scalar_type() == torch::kFloat32 && padded_k == k) {
    x2 = xc.view({M, k});
  } else {
    x2 = torch::empty({M, padded_k}, x.options().dtype(torch::kFloat32));
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      widen_rows(xc.template data_ptr<T>(), x2.data_ptr<float>(), M, k, padded_k);
    });
  }
  const torch::Tensor y = core(x2).contiguous();
  torch::Tensor b;
  if (has_bias) b = bias->reshape({n}).to(torch::kFloat32).contiguous();
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  torch::Tensor out = x.scalar_type() == torch::kFloat32 ? y : torch::empty({M, n}, x.options());
  dispatch_float(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (std::is_same<T, float>::value && !has_bias) return;
    narrow_rows(y.data_ptr<float>(), has_bias ? b.data_ptr<float>() : nullptr, out.template data_ptr<T>(), M, n);
  });
  return out.view(sizes);
}

}  // namespace

// F.linear(x, int4 weight, bias) in one call; see linear_io and int4pack_linear.
torch::Tensor int4pack_linear_io(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size,
                                 int64_t k, c10::optional<torch::Tensor> bias, int64_t gemv_max_rows) {
  const int64_t padded_k = (k + group_size - 1) / group_size * group_size;
  return linear_io(x, k, padded_k, packed.size(0), bias, [&](const torch::Tensor& x2) {
    return int4pack_linear(x2, packed, scale_zero, group_size, gemv_max_rows, x.scalar_type() != torch::kFloat32);
  });
}

// F.linear(x, Int4DQ weight, bias) in one call; see linear_io and int4dq_linear (tparams: [2], or
// the CPU packing's [2 + 8N] with the row table). k: the true input size (the kernel sees it
// padded to whole groups).
torch::Tensor int4dq_linear_io(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams, torch::Tensor rparams,
                               torch::Tensor tparams, int64_t group_size, int64_t k, c10::optional<torch::Tensor> bias,
                               int64_t gemv_max_rows) {
  TORCH_CHECK(group_size > 0, "group_size must be positive");
  const int64_t padded_k = (k + group_size - 1) / group_size * group_size;
  return linear_io(x, k, padded_k, packed.size(0), bias, [&](const torch::Tensor& x2) {
    return int4dq_linear(x2, packed, gparams, rparams, tparams, group_size, gemv_max_rows,
                         x.scalar_type() != torch::kFloat32);
  });
}

// F.linear(x, int8 weight, bias) in one call; scale: [N] or [N, 1] of any float dtype. Half-precision
// x meets the codes as int16 codes at any number of rows (int8_linear).
torch::Tensor int8_linear_io(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                             int64_t gemv_max_rows) {
  const int64_t k = q.size(1);
  auto s = scale.reshape({-1}).to(torch::kFloat32).contiguous();
  return linear_io(x, k, k, q.size(0), bias, [&](const torch::Tensor& x2) {
    return int8_linear(x2, q, s, gemv_max_rows, x.scalar_type() != torch::kFloat32);
  });
}

// F.linear(x, w, bias) for a plain bf16 weight [N, K] (contiguous) at few rows (dense.cpp); x of
// any float dtype, returned in its dtype.
torch::Tensor dense_linear_io(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(w.dim() == 2, "w: [N, K], got ", w.sizes());
  return linear_io(x, w.size(1), w.size(1), w.size(0), bias, [&](const torch::Tensor& x2) { return bf16_linear(x2, w); });
}

// F.linear(x, int8 weight, bias) for dynamic per-token int8 activations in one call: each row of x
// fake-quantized as the reference does (common.quantize_int8_per_token on x.float(), then codes x
// scale rounded to x's dtype), then int8_linear. The same numbers as Int8Tensor's
// simulate_input_quantization followed by int8_linear_io, without its half-dozen aten calls.
torch::Tensor int8dyn_linear_io(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                                int64_t gemv_max_rows) {
  const int64_t k = q.size(1);
  auto s = scale.reshape({-1}).to(torch::kFloat32).contiguous();
  return linear_io(x, k, k, q.size(0), bias, [&](const torch::Tensor& x2) {
    torch::Tensor xq = torch::empty_like(x2);
    const int64_t M = x2.size(0);
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      for (int64_t m = 0; m < M; ++m) {
        const float* r = x2.data_ptr<float>() + m * k;
        float* o = xq.data_ptr<float>() + m * k;
        const float sc = int8_row_scale(r, k);
        for (int64_t i = 0; i < k; ++i) {
          const float c = int8_code(r[i], sc);
          // The reference's codes are int8: a NaN code (a NaN row's) becomes some integer there,
          // and times the NaN scale a NaN either way.
          o[i] = to_float(static_cast<T>((std::isnan(c) ? 0.f : c) * sc));
        }
      }
    });
    return int8_linear(xq, q, s, gemv_max_rows, false);
  });
}

// F.linear(x, float8 weight, bias) in one call: the GEMV at up to gemv_max_rows rows, else chunks
// dequantized exactly and float32 GEMM. codes: the float8 weight [N, K]; scale: per row ([N] or
// [N, 1]) or per tensor (one value), any float dtype.
torch::Tensor fp8_linear_io(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, int64_t shift,
                            c10::optional<torch::Tensor> bias, int64_t gemv_max_rows) {
  const int64_t N = codes.size(0), k = codes.size(1);
  auto bytes = codes.view(torch::kUInt8);
  auto s = scale.reshape({-1}).to(torch::kFloat32);
  TORCH_CHECK(s.numel() == N || s.numel() == 1, "scale: one value per row or one in all");
  s = s.expand({N}).contiguous();
  return linear_io(x, k, k, N, bias, [&](const torch::Tensor& x2) {
    return x2.size(0) <= gemv_max_rows ? fp8_linear(x2, bytes, s, shift) : fp8_dequant_linear(x2, bytes, s, shift);
  });
}
