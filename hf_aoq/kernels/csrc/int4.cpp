// Int4Tensor's CPU kernels: F.linear on the pairs layout (int4_pairs.h) with the format's
// scale and zero ([groups, N, 2]; the weight is (q - 8) * scale + zero), and the repacking of
// the canonical codes into that layout.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <numeric>
#include <type_traits>

#include "amx_gemm.h"
#include "hf_aoq_cpu.h"
#include "int4_pairs.h"
#include "int4_scale_zero.h"

// x: float32 [M, K] contiguous, K a multiple of group_size; packed: uint8 [N, K/2] in the pairs
// layout (int4_repack_pairs); scale_zero: [K/group_size, N, 2] float32, bfloat16 or float16.
// int16_activations: x holds half-precision values (see int4_pairs.h); else the float32
// GEMV at up to gemv_max_rows rows, dequantize + GEMM above. Returns float32 [M, N].
torch::Tensor int4pack_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size,
                              int64_t gemv_max_rows, bool int16_activations) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.is_contiguous() && packed.numel() * 2 == N * K,
              "packed: contiguous uint8 [N, K/2]");
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  with_scale_zero(scale_zero, N, K, group_size,
                  [&](const auto& params) { int4_linear(x, w, params, y, N, group_size, gemv_max_rows, int16_activations); });
  return y;
}

// The weight [N, k] in dtype (bfloat16 or float16) from the pairs layout, bit for bit the
// reference's dequantize(dtype): for aten's GEMM in that dtype at many rows. packed and
// scale_zero as for int4pack_linear (K: packed's columns times two, k <= K).
torch::Tensor int4pack_dequantize(torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size, int64_t k,
                                  torch::ScalarType dtype) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(), "packed: contiguous uint8 [N, K/2]");
  const uint8_t* w = packed.data_ptr<uint8_t>();
  torch::Tensor out;
  with_scale_zero(scale_zero, N, K, group_size,
                  [&](const auto& params) { out = int4_dequant_weight(w, params, N, K, group_size, k, dtype); });
  return out;
}

// x: bfloat16 [M, k], k <= K; packed and scale_zero as for int4pack_linear, N a multiple of 32,
// K of 32. F.linear in bf16 on AMX tiles (tiles) or AVX512-BF16's dot products (amx_gemm.h): the
// weight's bf16 values are the reference's dequantize(bfloat16), bit for bit. Returns bfloat16 [M, N].
torch::Tensor int4pack_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale_zero, int64_t group_size,
                                  c10::optional<torch::Tensor> bias, bool tiles) {
  check_panel_gemm_usable(tiles);
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(), "packed: contiguous uint8 [N, K/2]");
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "the panel GEMM takes N and K multiples of 32, got ", N, " x ", K);
  const torch::Tensor xa = amx_input(x, K), b = amx_bias(bias, N);
  auto y = torch::empty({xa.size(0), N}, xa.options());
#if HF_AOQ_AMX
  const uint8_t* w = packed.data_ptr<uint8_t>();
  with_scale_zero(scale_zero, N, K, group_size, [&](const auto& params) {
    using P = std::decay_t<decltype(params)>;
    amx_linear_bf16(reinterpret_cast<const uint16_t*>(xa.data_ptr()), K, xa.size(0), N, K, std::lcm<int64_t>(32, group_size),
                    b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
                    Int4PairsPanel<P>{w, params, K, group_size}, tiles);
  });
#endif
  return y;
}

// Canonical int4 bytes (uint8 [N, K/2], code of column k in the low nibble of byte k/2 for even
// k, the high nibble for odd k) -> the pairs layout (int4_pairs.h), for K padded to
// `padded_k` with code 8 (the padding the kernels' zero input columns meet). uint8 [N, padded_k/2].
// Placing a weight for the CPU kernels at load; cpu.py's pairs_int4pack_bytes is the same
// mapping in torch ops (and its test).
torch::Tensor int4_repack_pairs(torch::Tensor canonical, int64_t padded_k) {
  TORCH_CHECK(canonical.dtype() == torch::kUInt8 && canonical.dim() == 2 && canonical.is_contiguous(),
              "canonical: contiguous uint8 [N, K/2]");
  const int64_t N = canonical.size(0), half = canonical.size(1), K = 2 * half;
  TORCH_CHECK(N % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(padded_k >= K && padded_k % 2 == 0, "padded_k: even, at least K");
  auto out = torch::empty({N, padded_k / 2}, canonical.options());
  const uint8_t* c = canonical.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  const int64_t pairs = padded_k / 2;
  // Canonical byte j of a row holds both codes of column pair j: column 2j low, 2j + 1 high.
  auto byte_at = [&](int64_t n, int64_t j) -> uint8_t { return j < half ? c[n * half + j] : uint8_t(0x88); };
  at::parallel_for(0, (N + BLOCK_N - 1) / BLOCK_N, 1, [&](int64_t b0, int64_t b1) {
    uint8_t src[BLOCK_N];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * BLOCK_N, rows = std::min(BLOCK_N, N - n0), lanes = rows / 4;
      uint8_t* dst = o + n0 * pairs;  // `rows` bytes per column pair
      for (int64_t j = 0; j < pairs; ++j) {
        for (int64_t r = 0; r < rows; ++r) src[r] = byte_at(n0 + r, j);
        uint8_t* d = dst + j * rows;
        for (int64_t i = 0; i < lanes; ++i)
          for (int p = 0; p < 2; ++p)      // column 2j + p: word 2i + p
            for (int h = 0; h < 2; ++h) {  // byte h of the word: nibbles t = 2h (low), 2h + 1 (high)
              const int lo = (src[(2 * h) * lanes + i] >> (4 * p)) & 15;
              const int hi = (src[(2 * h + 1) * lanes + i] >> (4 * p)) & 15;
              d[4 * i + 2 * p + h] = static_cast<uint8_t>(lo | (hi << 4));
            }
      }
    }
  });
  return out;
}
