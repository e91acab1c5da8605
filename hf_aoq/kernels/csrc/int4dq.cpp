// Int4DQTensor: the int4 codes of int4_pairs.h (the same pairs layout, with code 8 padding) whose per-group
// scale d and centre c are 4-bit codes a, b (gparams: a low nibble, b high nibble) between
// per-row ends decoded from 8-bit log codes (rparams: kd_lo, kd_hi, kc_lo, kc_hi) and two
// per-tensor values (tparams: T_d, T_c):
//   LUT[j] = float32(2^(-j/32)), j = 0..31
//   dval(k) = 0 if k == 255 else (T_d * LUT[k % 32]) * 2^-(k / 32)
//   cval(k) = 0 if (k & 127) == 127 else +-(T_c * LUT[2 * (m % 16)]) * 2^-(m / 16), m = k & 127,
//             negative when k >= 128
//   dstep = (dhi - dlo) / 15, cstep = (chi - clo) / 15
//   d = dlo + a * dstep, c = clo + b * cstep, w = (q - 7.5) * d + c
// all in float32, each multiply and add rounded on its own.
#include <torch/types.h>
#include <cmath>
#include <numeric>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_gemm.h"
#include "hf_aoq_cpu.h"
#include "int4_pairs.h"
#include "int4dq_rows.h"

namespace {

// (dlo, dstep, clo, cstep) of N rows from rparams [N, 4] into out [N, 4].
void int4dq_decode_rows(const uint8_t* rp, float td, float tc, float* out, int64_t N) {
  float lut[32], pow2[8];
  for (int j = 0; j < 32; ++j) lut[j] = static_cast<float>(std::exp2(-j / 32.0));
  // 2^-e for e = 0..7: multiplying by it is exact, as ldexp is, and much cheaper per row.
  for (int e = 0; e < 8; ++e) pow2[e] = std::ldexp(1.f, -e);
  auto dval = [&](int k) -> float { return k == 255 ? 0.f : (td * lut[k & 31]) * pow2[k >> 5]; };
  auto cval = [&](int k) -> float {
    const int m = k & 127;
    if (m == 127) return 0.f;
    const float v = (tc * lut[2 * (m & 15)]) * pow2[m >> 4];
    return (k >> 7) ? -v : v;
  };
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* r = rp + n * 4;
    const float dlo = dval(r[0]), dhi = dval(r[1]), clo = cval(r[2]), chi = cval(r[3]);
    out[n * 4 + 0] = dlo;
    out[n * 4 + 1] = (dhi - dlo) / 15.f;
    out[n * 4 + 2] = clo;
    out[n * 4 + 3] = (chi - clo) / 15.f;
  }
}

// The int4 kernels' parameter provider for Int4DQTensor: d and c of rows [n0, n0 + rows) in
// group g from gparams_t [G, N] (one group's bytes contiguous over rows) and the decoded rows,
// held as four arrays (dlo, dstep, clo, cstep) so that the loop over rows vectorizes.
struct DQParams {
  static constexpr float offset = 7.5f;
  const uint8_t* gp;  // [G, N]
  const float* dlo;
  const float* dstep;
  const float* clo;
  const float* cstep;
  int64_t N;
  // dlo, dstep, clo, cstep again (4 arrays N apart), rows [64c, 64c + 64) in int4_pairs512.h's
  // 64-row lane order; for block64.
  const float* rows64;
  void operator()(int64_t g, int64_t n0, int64_t rows, float* __restrict d, float* __restrict c) const {
    const uint8_t* __restrict p = gp + g * N + n0;
    const float* __restrict l0 = dlo + n0;
    const float* __restrict s0 = dstep + n0;
    const float* __restrict l1 = clo + n0;
    const float* __restrict s1 = cstep + n0;
#if defined(__AVX2__)
    if (rows == BLOCK_N) {  // the same multiply and add, eight rows at a time
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
        const __m256 a = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        const __m256 b = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        _mm256_storeu_ps(d + 8 * j, _mm256_add_ps(_mm256_loadu_ps(l0 + 8 * j), _mm256_mul_ps(a, _mm256_loadu_ps(s0 + 8 * j))));
        _mm256_storeu_ps(c + 8 * j, _mm256_add_ps(_mm256_loadu_ps(l1 + 8 * j), _mm256_mul_ps(b, _mm256_loadu_ps(s1 + 8 * j))));
      }
      return;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      const float a = static_cast<float>(p[r] & 15), b = static_cast<float>(p[r] >> 4);
      d[r] = l0[r] + a * s0[r];
      c[r] = l1[r] + b * s1[r];
    }
  }
  // Brings group g's parameter bytes of rows n0..n0+63 towards the core (int4_prefetch_params).
  void prefetch64(int64_t g, int64_t n0) const { int4_prefetch(gp + g * N + n0); }
#if HF_AOQ_INT4_512
  // d and c of rows n0..n0+63 (n0 a multiple of 64) in the 64-row lane order, by the same
  // multiply and add.
  void block64(int64_t g, int64_t n0, __m512* d, __m512* c) const {
    const uint8_t* p = gp + g * N + n0;
    const float* r = rows64 + n0;
    for (int t = 0; t < 4; ++t) {
      const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * t)),
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32 + 8 * t)));
      const __m512i v = _mm512_cvtepu8_epi32(bytes);
      const __m512 a = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
      const __m512 b = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      const float* q = r + 16 * t;
      d[t] = _mm512_add_ps(_mm512_loadu_ps(q), _mm512_mul_ps(a, _mm512_loadu_ps(q + N)));
      c[t] = _mm512_add_ps(_mm512_loadu_ps(q + 2 * N), _mm512_mul_ps(b, _mm512_loadu_ps(q + 3 * N)));
    }
  }
#endif
};

}  // namespace

// See int4dq_rows.h.
torch::Tensor int4dq_decode(const torch::Tensor& rparams, const torch::Tensor& tparams) {
  TORCH_CHECK(rparams.dtype() == torch::kUInt8 && rparams.dim() == 2 && rparams.size(1) == 4,
              "rparams: uint8 [N, 4]");
  TORCH_CHECK(tparams.dtype() == torch::kFloat32 && tparams.numel() == 2, "tparams: float32 [2]");
  auto rp = rparams.contiguous();
  auto tp = tparams.contiguous();
  const int64_t N = rp.size(0);
  auto out = torch::empty({N, 4}, tp.options());
  const float* t = tp.data_ptr<float>();
  int4dq_decode_rows(rp.data_ptr<uint8_t>(), t[0], t[1], out.data_ptr<float>(), N);
  return out;
}

namespace {

// The decoded row parameters the kernels read, float32 [8, N]: dlo, dstep, clo, cstep by row, then
// the same in the 64-row lane order (rows past the last whole 64 in order).
torch::Tensor dq_row_table(const torch::Tensor& rparams, const torch::Tensor& tparams) {
  const torch::Tensor dec = int4dq_decode(rparams, tparams);
  const int64_t N = dec.size(0);
  auto rows = torch::empty({8, N}, dec.options());
  const float* d = dec.data_ptr<float>();
  float* rp = rows.data_ptr<float>();
  const int64_t n64 = N / 64 * 64;
  for (int64_t n = 0; n < N; ++n) {
    const int64_t at = n < n64 ? n / 64 * 64 + int4_lane64(n % 64) : n;
    for (int f = 0; f < 4; ++f) {
      rp[f * N + n] = d[n * 4 + f];
      rp[(4 + f) * N + at] = d[n * 4 + f];
    }
  }
  return rows;
}

// The checked parameter provider of a packed Int4DQ weight (Kp = packed's columns times two);
// `rows` keeps the decoded row parameters it points into alive: the caller's `table`
// (int4dq_cpu_rows, made once per weight) where given, else decoded here, per call (8-9 ns a row
// on the Xeon: 3.4 ms of a 22-layer TinyLlama decode token).
DQParams dq_params(const torch::Tensor& packed, const torch::Tensor& gparams_t, const torch::Tensor& rparams,
                   const torch::Tensor& tparams, int64_t group_size, torch::Tensor& rows,
                   const c10::optional<torch::Tensor>& table = c10::nullopt) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(),
              "packed: contiguous uint8 [N, Kp/2]");
  TORCH_CHECK(N % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0, "Kp must be a multiple of an even group_size");
  TORCH_CHECK(gparams_t.dtype() == torch::kUInt8 && gparams_t.dim() == 2 && gparams_t.size(0) == K / group_size &&
                  gparams_t.size(1) == N && gparams_t.is_contiguous(),
              "gparams_t: contiguous uint8 [Kp/group_size, N]");
  TORCH_CHECK(rparams.dim() == 2 && rparams.size(0) == N, "rparams: uint8 [N, 4]");
  if (table.has_value() && table->defined()) {
    TORCH_CHECK(table->dtype() == torch::kFloat32 && table->dim() == 2 && table->size(0) == 8 && table->size(1) == N &&
                    table->is_contiguous(),
                "rows: contiguous float32 [8, N] (int4dq_cpu_rows)");
    rows = *table;
  } else {
    rows = dq_row_table(rparams, tparams);
  }
  float* rp = rows.data_ptr<float>();
  return DQParams{gparams_t.data_ptr<uint8_t>(), rp, rp + N, rp + 2 * N, rp + 3 * N, N, rp + 4 * N};
}

}  // namespace

// x: float32 [M, Kp] contiguous (Kp: K padded to whole groups, zero input columns past K);
// packed: uint8 [N, Kp/2] in the pairs layout (int4_repack_pairs of the canonical codes);
// gparams_t: uint8 [Kp/group_size, N] contiguous (the canonical gparams transposed); rparams:
// uint8 [N, 4]; tparams: float32 [2]. Returns float32 [M, N]: through int16 activation codes
// when int16_activations, else the float32 GEMV at up to gemv_max_rows rows and above them chunks
// dequantized exactly as the format defines and float32 GEMM.
torch::Tensor int4dq_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams_t, torch::Tensor rparams,
                            torch::Tensor tparams, int64_t group_size, int64_t gemv_max_rows, bool int16_activations) {
  return int4dq_linear_rows(x, packed, gparams_t, rparams, tparams, group_size, gemv_max_rows, int16_activations,
                            c10::nullopt);
}

// int4dq_linear with the decoded row table (int4dq_cpu_rows) when given.
torch::Tensor int4dq_linear_rows(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams_t, torch::Tensor rparams,
                                 torch::Tensor tparams, int64_t group_size, int64_t gemv_max_rows, bool int16_activations,
                                 c10::optional<torch::Tensor> table) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, Kp]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.numel() * 2 == N * K, "packed: [N, Kp/2] for x's Kp");
  torch::Tensor rows;
  const DQParams params = dq_params(packed, gparams_t, rparams, tparams, group_size, rows, table);
  auto y = torch::empty({M, N}, x.options());
  int4_linear(x, packed.data_ptr<uint8_t>(), params, y, N, group_size, gemv_max_rows, int16_activations);
  return y;
}

// The row table the kernels read (float32 [8, N], see dq_row_table), for the caller to keep with
// the weight and pass to int4dq_linear_io: decoding it on every call cost 8-9 ns a row.
torch::Tensor int4dq_cpu_rows(torch::Tensor rparams, torch::Tensor tparams) { return dq_row_table(rparams, tparams); }

// The weight [N, k] in dtype (bfloat16 or float16), bit for bit the reference's dequantize(dtype):
// for aten's GEMM in that dtype at many rows. Arguments as for int4dq_linear; k <= Kp.
torch::Tensor int4dq_dequantize(torch::Tensor packed, torch::Tensor gparams_t, torch::Tensor rparams,
                                torch::Tensor tparams, int64_t group_size, int64_t k, torch::ScalarType dtype) {
  torch::Tensor rows;
  const DQParams params = dq_params(packed, gparams_t, rparams, tparams, group_size, rows);
  return int4_dequant_weight(packed.data_ptr<uint8_t>(), params, packed.size(0), packed.size(1) * 2, group_size, k, dtype);
}

// x: bfloat16 [M, k], k <= Kp; the weight's arguments as for int4dq_linear, N a multiple of 32,
// Kp of 32. F.linear in bf16 on AMX tiles (amx_gemm.h): the weight's bf16 values are the
// reference's dequantize(bfloat16), bit for bit. Returns bfloat16 [M, N].
torch::Tensor int4dq_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams_t, torch::Tensor rparams,
                                torch::Tensor tparams, int64_t group_size, c10::optional<torch::Tensor> bias) {
  check_amx_usable();
  torch::Tensor rows;
  const DQParams params = dq_params(packed, gparams_t, rparams, tparams, group_size, rows);
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "the AMX kernel takes N and Kp multiples of 32, got ", N, " x ", K);
  const torch::Tensor xa = amx_input(x, K), b = amx_bias(bias, N);
  auto y = torch::empty({xa.size(0), N}, xa.options());
#if HF_AOQ_AMX
  amx_linear_bf16(reinterpret_cast<const uint16_t*>(xa.data_ptr()), K, xa.size(0), N, K, std::lcm<int64_t>(32, group_size),
                  b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
                  Int4PairsPanel<DQParams>{packed.data_ptr<uint8_t>(), params, K, group_size});
#endif
  return y;
}
