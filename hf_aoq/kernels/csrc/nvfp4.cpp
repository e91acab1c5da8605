// NVFP4 (e2m1 elements two per byte, one float8 e4m3 scale per 16 elements along K, one float32
// scale per tensor) weight x float activation on CPU for few rows: F.linear(x, w, bias) in
// float32 on the exact weight, reading the packed bytes directly. Weight-only, or with the
// activations first quantized to NVFP4 and decoded in x's dtype exactly as the reference's
// simulate_input_quantization (nvfp4_quant.cpp), so both see the same values.
//
// The loop is MXFP4's (mx_common.h fp4_tile): chunks of 128 elements as 16 32-bit lanes, a block
// of 16 being two lanes (16 floats over the chunk's eight decoded vectors), the e2m1 table decode
// by vpermps, per chunk and lane a partial sum of the eight products times the block's scale (one
// FMA), 4x2 register tiles on AVX-512, and the AVX2 build running the same lanes in two halves,
// so both builds give the same outputs. A block's scale is its e4m3 value times the per-tensor
// scale in float32 (the reference's block_scales), decoded once per weight row: the byte's
// exponent and mantissa bits shifted into a float32's give the value times 2^-120 exactly (e4m3
// subnormals become float32 subnormals), times 2^120; 0x7F / 0xFF are NaN. Denormals are neither
// flushed nor treated as zero during the call (the decode needs them).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "hf_aoq_cpu.h"
#include "mx_common.h"

namespace {

constexpr int64_t BLOCK = 16;
constexpr int64_t BPC = FP4_CHUNK / BLOCK;  // blocks per chunk
#if defined(__AVX512F__)
constexpr int kNR = 4, kMB = 2;  // weight rows x activation rows per register tile
#else
constexpr int kNR = 1, kMB = 1;
#endif

// float32 value of an e4m3fn byte.
inline float e4m3(uint8_t b) { return (b & 0x7F) == 0x7F ? std::nanf("") : fp8_value(b, 20); }

// y [M, N] = x W^T for activations xp (fp4_layout_rows, or in order for the generic build), rows
// ld floats apart; q [N, K/2] codes, sc [N, B] e4m3 bytes, pts the per-tensor scale.
void nvfp4_gemv(const float* xp, int64_t ld, int64_t M, const uint8_t* q, const uint8_t* sc, float pts, float* y,
                int64_t N, int64_t K) {
  const int64_t B = (K + BLOCK - 1) / BLOCK, row_bytes = K / 2;
  const int64_t chunks = (K + FP4_CHUNK - 1) / FP4_CHUNK, full = row_bytes / 64, per_row = chunks * BPC;
  const int64_t groups = (N + kNR - 1) / kNR;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    MxDenormalsKept keep;
    std::vector<float> sf(kNR * per_row);
    alignas(64) uint8_t tail[kNR][64];
    float out[kNR * kMB];
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t n0 = grp * kNR;
      const int nr = static_cast<int>(std::min<int64_t>(kNR, N - n0));
      RowView rows[kNR];
      for (int r = 0; r < kNR; ++r) {
        const int64_t n = std::min(n0 + r, N - 1);  // rows past N repeat the last, not stored
        const uint8_t* row = q + n * row_bytes;
        float* f = sf.data() + r * per_row;
        for (int64_t g = 0; g < B; ++g) f[g] = e4m3(sc[n * B + g]) * pts;
        std::fill(f + B, f + per_row, 0.f);  // blocks past the row's end
        std::memset(tail[r], 0, sizeof(tail[r]));
        if (full < chunks) std::memcpy(tail[r], row + full * 64, size_t(row_bytes - full * 64));
        rows[r] = {row, tail[r], f};
      }
      for (int64_t m0 = 0; m0 < M; m0 += kMB) {
        const int mb = static_cast<int>(std::min<int64_t>(kMB, M - m0));
#if defined(__AVX2__)
#if defined(__AVX512F__)
        if (mb == 2) fp4_tile<kNR, 2, BPC>(rows, chunks, full, xp + m0 * ld, ld, out);
        else
#endif
          fp4_tile<kNR, 1, BPC>(rows, chunks, full, xp + m0 * ld, ld, out);
#else
        {  // plain C++: block by block, x in order
          float total = 0.f;
          for (int64_t g = 0; g < B; ++g) {
            float part = 0.f;
            for (int64_t k = g * BLOCK; k < std::min(K, (g + 1) * BLOCK); ++k)
              part += xp[m0 * ld + k] * mx_elem_value(rows[0].row, MX_E2M1, k);
            total += part * rows[0].sf[g];
          }
          out[0] = total;
        }
#endif
        for (int i = 0; i < mb; ++i)
          for (int r = 0; r < nr; ++r) y[(m0 + i) * N + n0 + r] = out[i * kNR + r];
      }
    }
  });
}

}  // namespace

// F.linear(x, NVFP4 weight, bias): x float32 / bfloat16 / float16 [..., k]; qdata uint8 [N, k/2]
// (two e2m1 codes per byte, the even element low); scale float8_e4m3fn [N, ceil(k/16)];
// per_tensor_scale float32, one value; bias optional, any float dtype, [N]; act_quant: x is
// replaced by nvfp4_fake_quantize(x) first (the `nvfp4` scheme's dynamic activations). Computed
// in float32 (the weight decoded exactly), bias added in float32, returned in x's dtype as
// [..., N]. Meant for few rows: each weight row is decoded once per kMB activation rows.
torch::Tensor nvfp4_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale,
                              torch::Tensor per_tensor_scale, int64_t k, c10::optional<torch::Tensor> bias,
                              bool act_quant) {
  TORCH_CHECK(k > 0 && k % 2 == 0, "k: a positive even number, got ", k);
  TORCH_CHECK(qdata.dtype() == torch::kUInt8 && qdata.dim() == 2 && qdata.size(1) == k / 2,
              "qdata: uint8 [N, ", k / 2, "], got ", qdata.dtype(), " ", qdata.sizes());
  const int64_t N = qdata.size(0), B = (k + BLOCK - 1) / BLOCK;
  TORCH_CHECK(scale.scalar_type() == torch::kFloat8_e4m3fn && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == B,
              "scale: float8_e4m3fn [", N, ", ", B, "], got ", scale.dtype(), " ", scale.sizes());
  TORCH_CHECK(per_tensor_scale.scalar_type() == torch::kFloat32 && per_tensor_scale.numel() == 1,
              "per_tensor_scale: one float32 value, got ", per_tensor_scale.dtype(), " ", per_tensor_scale.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16");
  if (act_quant) x = nvfp4_fake_quantize(x);
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == N, "bias: expected ", N, " values, got ", bias->numel());
  const float pts = per_tensor_scale.item<float>();
  const auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0), ld = (k + FP4_CHUNK - 1) / FP4_CHUNK * FP4_CHUNK;
  auto xp = torch::empty({M, ld}, x2.options());
#if defined(__AVX2__)
  fp4_layout_rows(x2.data_ptr<float>(), xp.data_ptr<float>(), M, k, ld);
#else
  xp.narrow(1, 0, k).copy_(x2);  // the plain loop reads x in order
#endif
  const auto q = qdata.contiguous();
  const auto s = scale.contiguous();
  auto y = torch::empty({M, N}, x2.options());
  nvfp4_gemv(xp.data_ptr<float>(), ld, M, q.data_ptr<uint8_t>(), static_cast<const uint8_t*>(s.data_ptr()), pts,
             y.data_ptr<float>(), N, k);
  if (has_bias) y.add_(bias->reshape({N}).to(torch::kFloat32));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}
