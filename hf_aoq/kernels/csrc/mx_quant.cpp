// MX quantization on CPU, equal bit for bit to tensors/mx.py: the activation rows' codes and
// scales (mx_quantize), their decoded values in the activation dtype (simulate_input_quantization),
// and a weight dequantized to float32 / bfloat16 / float16 (mx_dequantize), which the many-rows
// path hands to aten's GEMM (kernels/cpu_mx.py). The rules are mx_common.h's.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "dequant_gemm.h"
#include "hf_aoq_cpu.h"
#include "mx_common.h"

namespace {

// Weight row `row` (its bytes, its B scale codes) as float32 values, B * 32 of them (the last
// block's padding decodes to zeros times its scale): element value times scale, one rounding.
void dequant_row(const uint8_t* row, const uint8_t* sc, int64_t kind, int64_t K, int64_t B, float* o) {
  const int64_t bb = kind == MX_E2M1 ? 16 : 32, row_bytes = kind == MX_E2M1 ? K / 2 : K, full = row_bytes / bb;
  alignas(64) uint8_t tail[32] = {0};
  if (full < B) std::memcpy(tail, row + full * bb, size_t(row_bytes - full * bb));
  for (int64_t g = 0; g < B; ++g) {
    const uint8_t* p = g < full ? row + g * bb : tail;
    const float s = e8m0_value(sc[g]);
    float* og = o + g * MX_BLOCK;
#if defined(__AVX2__)
    if (kind == MX_E2M1) {
      vfloat w0, w1;
      fp4_decode(p, fp4_table(s), w0, w1);
      store_interleaved(og, w0, w1);
    } else {
      const int shift = kind == MX_E4M3 ? 20 : 21;
      const float f = kind == MX_E4M3 ? 0x1p120f : 0x1p112f;
#if defined(__AVX512F__)
      const __m512 fv = _mm512_set1_ps(f), sv = _mm512_set1_ps(s);
#else
      const __m256 fv = _mm256_set1_ps(f), sv = _mm256_set1_ps(s);
#endif
      vstore(og, fp8_decode16(p, shift, fv, sv));
      vstore(og + 16, fp8_decode16(p + 16, shift, fv, sv));
    }
#else
    for (int64_t j = 0; j < MX_BLOCK; ++j) {
      const int64_t k = g * MX_BLOCK + j;
      og[j] = k < K ? mx_elem_value(row, kind, k) * s : 0.f;
    }
#endif
  }
}

}  // namespace

// The MX codes of x (float32 / bfloat16 / float16 [..., K]) in blocks of 32 along K, as
// tensors/mx.py's mx_quantize: qdata (kind 0: uint8 [..., K/2], two e2m1 codes a byte, the even
// element low; 1 / 2: float8_e4m3fn / float8_e5m2 [..., K]) and scale (uint8 [..., ceil(K/32)]).
std::vector<torch::Tensor> mx_quantize_rows(torch::Tensor x, int64_t kind) {
  const MxElem e = mx_elem(kind);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x: [..., K] with K > 0, got ", x.sizes());
  const int64_t K = x.size(-1), B = (K + MX_BLOCK - 1) / MX_BLOCK;
  TORCH_CHECK(kind != MX_E2M1 || K % 2 == 0, "e2m1 needs an even K, got ", K);
  const auto x2 = x.reshape({-1, K}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0);
  auto opts = torch::TensorOptions().dtype(torch::kUInt8);
  auto qdata = kind == MX_E2M1 ? torch::empty({M, K / 2}, opts)
                               : torch::empty({M, K}, opts.dtype(kind == MX_E4M3 ? torch::kFloat8_e4m3fn : torch::kFloat8_e5m2));
  auto scale = torch::empty({M, B}, opts);
  const float* xp = x2.data_ptr<float>();
  uint8_t* qp = reinterpret_cast<uint8_t*>(qdata.data_ptr());
  uint8_t* sp = scale.data_ptr<uint8_t>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    MxDenormalsKept keep;
    float elem[MX_BLOCK];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < B; ++g) {
        const int64_t k0 = g * MX_BLOCK, n = std::min(MX_BLOCK, K - k0);
        const float* v = xp + m * K + k0;
        const MxBlockScale s = mx_quantize_block(v, n, e, elem);
        sp[m * B + g] = s.code;
        for (int64_t i = 0; i < n; ++i) {
          const int64_t k = k0 + i;
          if (kind == MX_E2M1) {
            // A non-finite block's elements are +0 (mx.py zeroes q before the sign is taken).
            const uint8_t c = e2m1_code(elem[i]);
            uint8_t& b = qp[m * (K / 2) + k / 2];
            b = (k & 1) ? uint8_t((b & 0x0F) | (c << 4)) : c;
          } else if (kind == MX_E4M3) {
            qp[m * K + k] = c10::Float8_e4m3fn(elem[i]).x;
          } else {
            qp[m * K + k] = c10::Float8_e5m2(elem[i]).x;
          }
        }
      }
  });
  auto lead = x.sizes().vec();
  lead.pop_back();
  auto qs = lead, ss = lead;
  qs.push_back(qdata.size(1));
  ss.push_back(B);
  return {qdata.view(qs), scale.view(ss)};
}

// x quantized as mx_quantize_rows and decoded in x's dtype: tensors/mx.py's
// simulate_input_quantization (mx_dequantize(mx_quantize(x), x.dtype)), bit for bit.
torch::Tensor mx_fake_quantize(torch::Tensor x, int64_t kind) {
  const MxElem e = mx_elem(kind);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x: [..., K] with K > 0, got ", x.sizes());
  const int64_t K = x.size(-1);
  TORCH_CHECK(kind != MX_E2M1 || K % 2 == 0, "e2m1 needs an even K, got ", K);
  const auto x2 = x.reshape({-1, K}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0);
  auto out = torch::empty({M, K}, x2.options());
  const float* xp = x2.data_ptr<float>();
  float* op = out.data_ptr<float>();
  float_dtype(x.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
      MxDenormalsKept keep;
      for (int64_t m = m0; m < m1; ++m) mx_fake_quantize_row<T>(xp + m * K, K, e, op + m * K);
    });
  });
  return out.to(x.scalar_type()).view(x.sizes());
}

// The MX weight (qdata, scale as mx_linear_io takes them) dequantized to dtype (float32, bfloat16
// or float16) [N, k]: tensors/mx.py's mx_dequantize, bit for bit (float32 products, one rounding
// to dtype, NaN as torch's conversion gives it).
torch::Tensor mx_dequantize(torch::Tensor qdata, torch::Tensor scale, int64_t kind, int64_t k, torch::ScalarType dtype) {
  const int64_t N = mx_check_weight(qdata, scale, kind, k), B = (k + MX_BLOCK - 1) / MX_BLOCK;
  const auto q = qdata.contiguous();
  const auto s = scale.contiguous();
  const uint8_t* qp = reinterpret_cast<const uint8_t*>(q.data_ptr());
  const uint8_t* sp = s.data_ptr<uint8_t>();
  const int64_t row_bytes = kind == MX_E2M1 ? k / 2 : k;
  auto out = torch::empty({N, k}, torch::TensorOptions().dtype(dtype));
  float_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    T* op = reinterpret_cast<T*>(out.data_ptr());
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      MxDenormalsKept keep;
      std::vector<float> buf(B * MX_BLOCK);
      for (int64_t n = n0; n < n1; ++n) {
        float* dst = std::is_same<T, float>::value ? reinterpret_cast<float*>(op + n * k) : buf.data();
        if (std::is_same<T, float>::value && B * MX_BLOCK != k) dst = buf.data();  // room for the padding
        dequant_row(qp + n * row_bytes, sp + n * B, kind, k, B, dst);
        if constexpr (std::is_same<T, float>::value) {
          if (dst == buf.data()) std::memcpy(op + n * k, buf.data(), size_t(k) * sizeof(float));
        } else {
          narrow_floats(buf.data(), op + n * k, k);
        }
      }
    });
  });
  return out;
}
