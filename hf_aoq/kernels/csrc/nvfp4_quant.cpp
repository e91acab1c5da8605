// NVFP4 quantization on CPU, equal bit for bit to tensors/nvfp4.py: activation rows' codes and
// block scales (nvfp4_quantize), their decoded values in the activation dtype with the per-tensor
// scale taken from the activations (simulate_input_quantization), and a weight dequantized to
// float32 / bfloat16 / float16 (nvfp4_dequantize), which the many-rows path hands to aten's GEMM
// (kernels/cpu_nvfp4.py). The e2m1 rounding, the e2m1 and e4m3 decoding and the lane layouts are
// mx_common.h's.
//
// A block V of 16 (fewer at the end of a row) with the per-tensor scale p, every step a float32
// operation as the reference's: amax = max |V|; inf or NaN in V gives the e4m3 NaN scale (0x7F) and
// +0 elements; else s = e4m3(clamp((amax / 6) / p, 2^-6, 448)) (c10's conversion: torch's cast,
// nearest even), d = p * s, q_i = clamp(V_i / d, -6, 6) rounded to e2m1 (nearest, ties to even,
// the sign kept: -0 stays -0). The decoded value is e2m1(q_i) * d, rounded once to the dtype.
// The activations' p = max(amax / 2688, 2^-126) over all their finite |values|.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "dequant_gemm.h"
#include "hf_aoq_cpu.h"
#include "mx_common.h"

namespace {

constexpr int64_t NV_BLOCK = 16;
constexpr uint8_t E4M3_NAN = 0x7F;
const MxElem kE2m1 = {2, 0, 1, 6.f};  // mx_elem(MX_E2M1)

// float32 value of an e4m3fn byte (NaN for 0x7F / 0xFF).
inline float e4m3_value(uint8_t b) { return (b & 0x7F) == 0x7F ? std::nanf("") : fp8_value(b, 20); }

// One block of n (<= 16) floats with per-tensor scale p: its e4m3 scale byte, and in elem[i] each
// element's rounded e2m1 value (before the scale).
inline uint8_t nvfp4_quantize_block(const float* v, int64_t n, float p, float* elem) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(v[i]);
    finite = finite && std::isfinite(a);
    amax = std::max(amax, a);
  }
  if (!finite) {
    std::fill(elem, elem + n, 0.f);
    return E4M3_NAN;
  }
  const float s = std::min(std::max(amax / 6.f / p, 0x1p-6f), 448.f);
  const uint8_t code = c10::Float8_e4m3fn(s).x;
  const float d = p * fp8_value(code, 20);
  for (int64_t i = 0; i < n; ++i) elem[i] = mx_round_elem(std::min(std::max(v[i] / d, -6.f), 6.f), kE2m1);
  return code;
}

#if defined(__AVX512F__)
// A whole block of finite values as nvfp4_quantize_block, and each value decoded: out[i] =
// e2m1(q_i) * d in float32. The rounding is mx_round_elem's, lane by lane. Returns false (and
// writes nothing) for a block holding inf or NaN, which the scalar code takes.
inline bool nvfp4_fake_block16(const float* v, float p, float* out) {
  const __m512 x = _mm512_loadu_ps(v), a = _mm512_abs_ps(x);
  if (_mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_LT_OQ) != 0xFFFF) return false;
  const float amax = _mm512_reduce_max_ps(a);
  const float s = std::min(std::max(amax / 6.f / p, 0x1p-6f), 448.f);
  const __m512 d = _mm512_set1_ps(p * fp8_value(c10::Float8_e4m3fn(s).x, 20));
  const __m512 q = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(x, d), _mm512_set1_ps(-6.f)), _mm512_set1_ps(6.f));
  const __m512i bits = _mm512_castps_si512(q);
  // magic = 1.5 * 2^(exp - 1 + 23), exp = max(unbiased exponent of q, 0): its ulp is e2m1's spacing.
  const __m512i exp = _mm512_max_epi32(
      _mm512_sub_epi32(_mm512_and_si512(_mm512_srli_epi32(bits, 23), _mm512_set1_epi32(0xFF)), _mm512_set1_epi32(127)),
      _mm512_setzero_si512());
  const __m512 magic = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_slli_epi32(_mm512_add_epi32(exp, _mm512_set1_epi32(149)), 23), _mm512_set1_epi32(0x400000)));
  const __m512 mag = _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF)));
  const __m512 r = _mm512_min_ps(_mm512_sub_ps(_mm512_add_ps(mag, magic), magic), _mm512_set1_ps(6.f));
  const __m512 signed_r = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_castps_si512(r), _mm512_and_si512(bits, _mm512_set1_epi32(int(0x80000000u)))));
  _mm512_storeu_ps(out, _mm512_mul_ps(signed_r, d));
  return true;
}
#endif

// One activation row quantized and decoded in float32 (before the rounding to its dtype).
void nvfp4_fake_row(const float* x, int64_t K, float p, float* out) {
  float elem[NV_BLOCK];
  for (int64_t k0 = 0; k0 < K; k0 += NV_BLOCK) {
    const int64_t n = std::min(NV_BLOCK, K - k0);
#if defined(__AVX512F__)
    if (n == NV_BLOCK && nvfp4_fake_block16(x + k0, p, out + k0)) continue;
#endif
    const float d = p * e4m3_value(nvfp4_quantize_block(x + k0, n, p, elem));
    for (int64_t i = 0; i < n; ++i) out[k0 + i] = elem[i] * d;
  }
}

// The activations' per-tensor scale: max(amax / 2688, 2^-126), amax over the finite |x|.
float act_per_tensor_scale(const float* x, int64_t n) {
  const float amax = at::parallel_reduce(
      0, n, int64_t(1) << 16, 0.f,
      [&](int64_t i0, int64_t i1, float m) {
        int64_t i = i0;
#if defined(__AVX512F__)
        __m512 mv = _mm512_setzero_ps();
        for (; i + 16 <= i1; i += 16) {
          const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i));
          mv = _mm512_mask_max_ps(mv, _mm512_cmp_ps_mask(a, _mm512_set1_ps(INFINITY), _CMP_LT_OQ), mv, a);
        }
        m = std::max(m, _mm512_reduce_max_ps(mv));
#endif
        for (; i < i1; ++i) {
          const float a = std::fabs(x[i]);
          if (std::isfinite(a)) m = std::max(m, a);
        }
        return m;
      },
      [](float a, float b) { return std::max(a, b); });
  return std::max(amax / 2688.f, 0x1p-126f);
}

torch::Tensor as_float_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0 && x.size(-1) % 2 == 0, "x: [..., K] with K even and positive, got ",
              x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16, got ", x.scalar_type());
  return x.reshape({-1, x.size(-1)}).to(torch::kFloat32).contiguous();
}

// Weight row `row` (K/2 bytes) with its block scales sf (float32, the per-tensor scale included)
// as K float32 values, each e2m1 value times its block's scale (one rounding).
void dequant_row(const uint8_t* row, const float* sf, int64_t K, float* o) {
  int64_t k = 0;
#if defined(__AVX2__)
  const Fp4Table table = fp4_table(1.f);
  for (; k + 32 <= K; k += 32) {  // two blocks: lanes 0-7 of each vector are block g's, 8-15 g + 1's
    const float s0 = sf[k / NV_BLOCK], s1 = sf[k / NV_BLOCK + 1];
    vfloat w0, w1;
    fp4_decode(row + k / 2, table, w0, w1);
#if defined(__AVX512F__)
    const __m512 sv = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
    store_interleaved(o + k, _mm512_mul_ps(w0, sv), _mm512_mul_ps(w1, sv));
#else
    const __m256 a = _mm256_set1_ps(s0), b = _mm256_set1_ps(s1);
    store_interleaved(o + k, {_mm256_mul_ps(w0.lo, a), _mm256_mul_ps(w0.hi, b)},
                      {_mm256_mul_ps(w1.lo, a), _mm256_mul_ps(w1.hi, b)});
#endif
  }
#endif
  for (; k < K; ++k) o[k] = mx_elem_value(row, MX_E2M1, k) * sf[k / NV_BLOCK];
}

// Rows [n0, n1) of one 2-D weight into out (row-major, K floats a row).
void dequant_rows(const uint8_t* q, const uint8_t* sc, float pts, int64_t K, int64_t n0, int64_t n1, float* out) {
  MxDenormalsKept keep;
  const int64_t B = (K + NV_BLOCK - 1) / NV_BLOCK;
  std::vector<float> sf(B);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t g = 0; g < B; ++g) sf[g] = e4m3_value(sc[n * B + g]) * pts;
    dequant_row(q + n * (K / 2), sf.data(), K, out + (n - n0) * K);
  }
}

}  // namespace

// The NVFP4 codes of x (float32 / bfloat16 / float16 [..., K], K even) in blocks of 16 along K
// with the given per-tensor scale (one float32 value), as tensors/nvfp4.py's nvfp4_quantize:
// qdata uint8 [..., K/2] (two e2m1 codes a byte, the even element low) and scale float8_e4m3fn
// [..., ceil(K/16)].
std::vector<torch::Tensor> nvfp4_quantize_rows(torch::Tensor x, torch::Tensor per_tensor_scale) {
  TORCH_CHECK(per_tensor_scale.scalar_type() == torch::kFloat32 && per_tensor_scale.numel() == 1,
              "per_tensor_scale: one float32 value, got ", per_tensor_scale.dtype(), " ", per_tensor_scale.sizes());
  const auto x2 = as_float_rows(x);
  const int64_t M = x2.size(0), K = x2.size(1), B = (K + NV_BLOCK - 1) / NV_BLOCK;
  const float p = per_tensor_scale.item<float>();
  auto qdata = torch::empty({M, K / 2}, torch::TensorOptions().dtype(torch::kUInt8));
  auto scale = torch::empty({M, B}, torch::TensorOptions().dtype(torch::kUInt8));
  const float* xp = x2.data_ptr<float>();
  uint8_t* qp = qdata.data_ptr<uint8_t>();
  uint8_t* sp = scale.data_ptr<uint8_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    MxDenormalsKept keep;
    float elem[NV_BLOCK];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < B; ++g) {
        const int64_t k0 = g * NV_BLOCK, n = std::min(NV_BLOCK, K - k0);  // n even: K is
        sp[m * B + g] = nvfp4_quantize_block(xp + m * K + k0, n, p, elem);
        for (int64_t i = 0; i < n; i += 2)
          qp[m * (K / 2) + (k0 + i) / 2] = uint8_t(e2m1_code(elem[i]) | (e2m1_code(elem[i + 1]) << 4));
      }
  });
  auto qs = x.sizes().vec(), ss = x.sizes().vec();
  qs.back() = K / 2;
  ss.back() = B;
  return {qdata.view(qs), scale.view(torch::kFloat8_e4m3fn).view(ss)};
}

// x quantized to NVFP4 with its own per-tensor scale and decoded in x's dtype: tensors/nvfp4.py's
// NVFP4Tensor.simulate_input_quantization for the dynamic-activation variant, bit for bit.
torch::Tensor nvfp4_fake_quantize(torch::Tensor x) {
  if (x.numel() == 0) return x;
  const auto x2 = as_float_rows(x);
  const int64_t M = x2.size(0), K = x2.size(1);
  const float* xp = x2.data_ptr<float>();
  const float p = act_per_tensor_scale(xp, M * K);
  auto out = torch::empty({M, K}, torch::TensorOptions().dtype(x.scalar_type()));
  float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* op = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      MxDenormalsKept keep;
      std::vector<float> row(K);
      for (int64_t m = m0; m < m1; ++m) {
        nvfp4_fake_row(xp + m * K, K, p, row.data());
        narrow_floats(row.data(), op + m * K, K);  // one rounding to T, nearest even
      }
    });
  });
  return out.view(x.sizes());
}

// The NVFP4 weight dequantized to dtype (float32, bfloat16 or float16): qdata uint8 [N, k/2] or
// experts [E, N, k/2], scale float8_e4m3fn [..., N, ceil(k/16)], per_tensor_scale float32 [] or [E]
// (one per expert). tensors/nvfp4.py's nvfp4_dequantize bit for bit (float32 products, one
// rounding to dtype; NaN where the scale byte is NaN). bfloat16 / float16 go through float32
// chunks of about 1 MB (dequant_gemm.h), never a whole float32 copy.
torch::Tensor nvfp4_dequantize(torch::Tensor qdata, torch::Tensor scale, torch::Tensor per_tensor_scale, int64_t k,
                               torch::ScalarType dtype) {
  TORCH_CHECK(k > 0 && k % 2 == 0, "k: a positive even number, got ", k);
  TORCH_CHECK(qdata.dtype() == torch::kUInt8 && (qdata.dim() == 2 || qdata.dim() == 3) && qdata.size(-1) == k / 2,
              "qdata: uint8 [N, ", k / 2, "] or [E, N, ", k / 2, "], got ", qdata.dtype(), " ", qdata.sizes());
  const bool experts = qdata.dim() == 3;
  const int64_t E = experts ? qdata.size(0) : 1, N = qdata.size(-2), B = (k + NV_BLOCK - 1) / NV_BLOCK;
  auto want = qdata.sizes().vec();
  want.back() = B;
  TORCH_CHECK(scale.scalar_type() == torch::kFloat8_e4m3fn && scale.sizes().vec() == want,
              "scale: float8_e4m3fn ", c10::IntArrayRef(want), ", got ", scale.dtype(), " ", scale.sizes());
  TORCH_CHECK(per_tensor_scale.scalar_type() == torch::kFloat32 && per_tensor_scale.dim() == (experts ? 1 : 0) &&
                  per_tensor_scale.numel() == E,
              "per_tensor_scale: float32 ", experts ? "[E]" : "[]", " with E = ", E, ", got ", per_tensor_scale.dtype(),
              " ", per_tensor_scale.sizes());
  TORCH_CHECK(dtype == torch::kFloat32 || dtype == torch::kBFloat16 || dtype == torch::kFloat16,
              "dtype: float32, bfloat16 or float16, got ", dtype);
  const auto q = qdata.contiguous();
  const auto s = scale.contiguous();
  const auto pts = per_tensor_scale.contiguous();
  auto out_sizes = qdata.sizes().vec();
  out_sizes.back() = k;
  auto out = torch::empty(out_sizes, torch::TensorOptions().dtype(dtype));
  for (int64_t e = 0; e < E; ++e) {
    const uint8_t* qe = q.data_ptr<uint8_t>() + e * N * (k / 2);
    const uint8_t* se = static_cast<const uint8_t*>(s.data_ptr()) + e * N * B;
    const float p = pts.data_ptr<float>()[e];
    const auto rows = [&](int64_t n0, int64_t n1, float* buf) { dequant_rows(qe, se, p, k, n0, n1, buf); };
    if (dtype == torch::kFloat32) {
      float* o = out.data_ptr<float>() + e * N * k;
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows(n0, n1, o + n0 * k); });
    } else if (dtype == torch::kBFloat16) {
      dequant_weight_into(out.data_ptr<c10::BFloat16>() + e * N * k, N, k, k, 1, false, rows);
    } else {
      dequant_weight_into(out.data_ptr<c10::Half>() + e * N * k, N, k, k, 1, false, rows);
    }
  }
  return out;
}
