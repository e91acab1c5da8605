// The eager entry points: F.linear(x, weight, bias) for each weight format in one call.
//
// Each does the linear's input and output handling here rather than in Python, where its
// handful of small ops cost more than a small layer's kernel at batch 1. The kernels themselves
// are in int_cpu.cpp and fp8_cpu.cpp (built into the same module, before this file).
#include <torch/extension.h>

namespace {

// x of any float dtype and shape [..., k] becomes float32 [M, padded_k] (zero columns past k),
// `core` maps that to float32 [M, n], the bias (any float dtype) is added in float32 and the
// result returns in x's dtype as [..., n]. The numbers are those of x.float(), padding, the
// kernel, + bias.float(), .to(dtype): what the Python composition (used under torch.compile) does.
template <class Core>
torch::Tensor linear_io(const torch::Tensor& x, int64_t k, int64_t padded_k, int64_t n,
                        const c10::optional<torch::Tensor>& bias, Core core) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16");
  auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  if (padded_k != k) x2 = at::constant_pad_nd(x2, {0, padded_k - k});
  auto y = core(x2);
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bias: expected ", n, " values, got ", bias->numel());
    y.add_(bias->reshape({n}));
  }
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return y.to(x.scalar_type()).view(sizes);
}

}  // namespace

// F.linear(x, int4 weight, bias) in one call; see linear_io and int4pack_linear.
torch::Tensor int4pack_linear_io(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size,
                                 int64_t k, c10::optional<torch::Tensor> bias, int64_t gemv_max_rows) {
  const int64_t padded_k = (k + group_size - 1) / group_size * group_size;
  return linear_io(x, k, padded_k, packed.size(0), bias, [&](const torch::Tensor& x2) {
    return int4pack_linear(x2, packed, scale_zero, group_size, gemv_max_rows);
  });
}

// F.linear(x, Int4DQ weight, bias) in one call; see linear_io and int4dq_linear. k: the true input
// size (the kernel sees it padded to whole groups).
torch::Tensor int4dq_linear_io(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams_t, torch::Tensor rparams,
                               torch::Tensor tparams, int64_t group_size, int64_t k, c10::optional<torch::Tensor> bias,
                               int64_t gemv_max_rows) {
  TORCH_CHECK(group_size > 0, "group_size must be positive");
  const int64_t padded_k = (k + group_size - 1) / group_size * group_size;
  return linear_io(x, k, padded_k, packed.size(0), bias, [&](const torch::Tensor& x2) {
    return int4dq_linear(x2, packed, gparams_t, rparams, tparams, group_size, gemv_max_rows);
  });
}

// F.linear(x, int8 weight, bias) in one call; scale: [N] or [N, 1] of any float dtype.
torch::Tensor int8_linear_io(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                             int64_t gemv_max_rows) {
  const int64_t k = q.size(1);
  auto s = scale.reshape({-1}).to(torch::kFloat32).contiguous();
  return linear_io(x, k, k, q.size(0), bias, [&](const torch::Tensor& x2) { return int8_linear(x2, q, s, gemv_max_rows); });
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
