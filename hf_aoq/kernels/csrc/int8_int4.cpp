// Int4Tensor with integer activations (act_dtype int8 or int4) on CPU: the activations arrive
// as the int8 codes and per-token float32 scales that Int4Tensor.quantize_input made (the
// reference fake-quantizes with the same ones), and meet the int4 codes of the pairs layout in
// exact integer multiply-adds (int4_pairs.h's int4_linear_codes: vpmaddwd on AVX2, VNNI's
// vpdpwssd on the AVX-512 build, the same int32 sums on both). Per token m and group g the
// epilogue adds (scale * sx[m]) * sum(code_x * code_w) + (zero - 8 * scale) * sx[m] * sum(code_x).
// F.linear in one call: padding to whole groups, bias and the output dtype here too.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "hf_aoq_cpu.h"
#include "int4_pairs.h"
#include "int4_scale_zero.h"

namespace {

// The activation codes [M, k] as the int16 rows int4_linear_codes reads: [M, K] with zero
// columns past k, each group's scale the token's, and xs the activations each group's codes
// stand for (scale times their sum).
Int16Rows int8_rows(const int8_t* codes, const float* scale, int64_t M, int64_t k, int64_t K, int64_t gs) {
  const int64_t G = K / gs;
  Int16Rows q{std::vector<int16_t>(M * K, 0), std::vector<float>(M * G), std::vector<float>(M * G)};
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int8_t* src = codes + m * k;
      int16_t* dst = q.codes.data() + m * K;
      for (int64_t i = 0; i < k; ++i) dst[i] = src[i];
      for (int64_t g = 0; g < G; ++g) {
        int32_t total = 0;
        for (int64_t i = g * gs; i < (g + 1) * gs; ++i) total += dst[i];
        q.sx[m * G + g] = scale[m];
        q.xs[m * G + g] = float(total) * scale[m];
      }
    }
  });
  return q;
}

template <typename T>
void store_rows(const float* y, const float* bias, T* out, int64_t M, int64_t n) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < n; ++j) out[m * n + j] = static_cast<T>(bias ? y[m * n + j] + bias[j] : y[m * n + j]);
}

}  // namespace

// codes: int8 [M, k] contiguous (activation codes, |code| <= 127); act_scale: float32 [M] or
// [M, 1]; packed: uint8 [N, K/2] in the pairs layout, K = k rounded up to whole groups;
// scale_zero: [K/group_size, N, 2]. Returns [M, N] in dtype (float32, bfloat16 or float16):
// the float32 result plus the bias (in float32), rounded once.
torch::Tensor int8_int4_linear_io(torch::Tensor codes, torch::Tensor act_scale, torch::Tensor packed,
                                  torch::Tensor scale_zero, int64_t group_size, int64_t k,
                                  c10::optional<torch::Tensor> bias, torch::ScalarType dtype) {
  TORCH_CHECK(codes.dtype() == torch::kInt8 && codes.dim() == 2 && codes.is_contiguous() && codes.size(1) == k,
              "codes: contiguous int8 [M, k]");
  const int64_t M = codes.size(0), N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous() && K >= k,
              "packed: contiguous uint8 [N, K/2], K >= k");
  TORCH_CHECK(group_size <= kMaxInt16Group, "group_size too large for exact int32 sums");
  const auto s = act_scale.reshape({-1}).to(torch::kFloat32).contiguous();
  TORCH_CHECK(s.numel() == M, "act_scale: one value per row of codes");
  const bool has_bias = bias.has_value() && bias->defined();
  torch::Tensor b;
  if (has_bias) {
    TORCH_CHECK(bias->numel() == N, "bias: expected ", N, " values, got ", bias->numel());
    b = bias->reshape({N}).to(torch::kFloat32).contiguous();
  }
  auto y = torch::empty({M, N}, codes.options().dtype(torch::kFloat32));
  if (M > 0) {
    const Int16Rows xq = int8_rows(codes.data_ptr<int8_t>(), s.data_ptr<float>(), M, k, K, group_size);
    const uint8_t* w = packed.data_ptr<uint8_t>();
    with_scale_zero(scale_zero, N, K, group_size, [&](const auto& params) {
      int4_linear_codes(xq, w, params, y.data_ptr<float>(), M, N, K, group_size);
    });
  }
  if (dtype == torch::kFloat32 && !has_bias) return y;
  auto out = torch::empty({M, N}, codes.options().dtype(dtype));
  const float* bp = has_bias ? b.data_ptr<float>() : nullptr;
  switch (dtype) {
    case torch::kFloat32: store_rows(y.data_ptr<float>(), bp, out.data_ptr<float>(), M, N); break;
    case torch::kBFloat16: store_rows(y.data_ptr<float>(), bp, out.data_ptr<c10::BFloat16>(), M, N); break;
    case torch::kFloat16: store_rows(y.data_ptr<float>(), bp, out.data_ptr<c10::Half>(), M, N); break;
    default: TORCH_CHECK(false, "dtype: float32, bfloat16 or float16");
  }
  return out;
}
