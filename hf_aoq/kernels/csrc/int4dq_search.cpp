// Int4DQTensor's quantize-time C++ (not kernels): the decoded per-row parameters and the
// per-group search of tensors/int4dq.py.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hf_aoq_cpu.h"
#include "int4dq_rows.h"
#include "simd.h"

// (dlo, dstep, clo, cstep) per row, float32 [N, 4], as the Int4DQTensor kernels decode them.
torch::Tensor int4dq_row_params(torch::Tensor rparams, torch::Tensor tparams) { return int4dq_decode(rparams, tparams); }

// Int4DQTensor's quantizer search (int4dq.py `_quantize_rows`), the same arithmetic in C++; with
// L = `levels` the largest code (15; IntxDQTensor's 3- and 2-bit codes: 7 and 3).
// For each group, the 3x3 (scale index, centre index) candidates around (a0, b0), in the
// Python order (scale outer, centre inner; the first of equal errors wins): codes
// q = clamp(round((x - c) / d + L/2), 0, L) ((L + 1) / 2 where d <= 0) and the squared error
// sum(((q - L/2) * d + c - x)^2) over the group's real columns. Only the error's summation order
// differs from the Python path (which sums with torch), so a near tie can go the other way.
// x: float32 [N, G * g] contiguous, the last group padded; k: real columns; a0, b0: uint8
// [N, G]; rows: float32 [N, 4] (dlo, dstep, clo, cstep). Returns (codes uint8 [N, G * g], a, b).
namespace {

#if defined(__AVX2__)
// Codes of 8 values and their squared errors (as the scalar code below computes them).
inline __m256 dq_codes8(const float* xp, __m256 d, __m256 c, bool dpos, float top, __m256* qout) {
  const __m256 x = _mm256_loadu_ps(xp), half = _mm256_set1_ps(top / 2.f);
  __m256 q;
  if (dpos) {
    q = _mm256_add_ps(_mm256_div_ps(_mm256_sub_ps(x, c), d), half);
    q = _mm256_round_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm256_min_ps(_mm256_max_ps(q, _mm256_setzero_ps()), _mm256_set1_ps(top));
  } else {
    q = _mm256_set1_ps(std::floor((top + 1.f) / 2.f));
  }
  *qout = q;
  const __m256 r = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(q, half), d), c), x);
  return _mm256_mul_ps(r, r);
}
#endif

inline float dq_code1(float x, float d, float c, float top) {
  if (!(d > 0.f)) return std::floor((top + 1.f) / 2.f);
  float q = std::nearbyint((x - c) / d + top / 2.f);
  return std::min(std::max(q, 0.f), top);
}

}  // namespace

std::vector<torch::Tensor> int4dq_search(torch::Tensor x, torch::Tensor a0, torch::Tensor b0, torch::Tensor rows,
                                         int64_t g, int64_t k, int64_t levels) {
  TORCH_CHECK(levels >= 1 && levels <= 255, "levels: the largest code, 1..255, got ", levels);
  const float top = static_cast<float>(levels);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [N, G*g]");
  const int64_t N = x.size(0), W = x.size(1);
  TORCH_CHECK(g > 0 && W % g == 0 && k > W - g && k <= W, "x: [N, G*g] with k real columns in its last group");
  const int64_t G = W / g;
  TORCH_CHECK(a0.dtype() == torch::kUInt8 && b0.dtype() == torch::kUInt8 && a0.is_contiguous() && b0.is_contiguous() &&
                  a0.numel() == N * G && b0.numel() == N * G,
              "a0, b0: contiguous uint8 [N, G]");
  TORCH_CHECK(rows.dtype() == torch::kFloat32 && rows.is_contiguous() && rows.numel() == N * 4, "rows: float32 [N, 4]");
  auto codes = torch::empty({N, W}, x.options().dtype(torch::kUInt8));
  auto a_out = torch::empty({N, G}, a0.options()), b_out = torch::empty({N, G}, b0.options());
  const float* xp = x.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  const uint8_t *ap = a0.data_ptr<uint8_t>(), *bp = b0.data_ptr<uint8_t>();
  uint8_t *cp = codes.data_ptr<uint8_t>(), *aop = a_out.data_ptr<uint8_t>(), *bop = b_out.data_ptr<uint8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> q(g), best_q(g);
    for (int64_t n = n0; n < n1; ++n) {
      const float dlo = rp[4 * n], dstep = rp[4 * n + 1], clo = rp[4 * n + 2], cstep = rp[4 * n + 3];
      for (int64_t j = 0; j < G; ++j) {
        const float* xg = xp + n * W + j * g;
        const int64_t real = std::min(g, k - j * g);
        float best_err = 0.f;
        int best_a = -1, best_b = -1;
        for (int da = -1; da <= 1; ++da) {
          for (int db = -1; db <= 1; ++db) {
            const int a = std::min(std::max(int(ap[n * G + j]) + da, 0), 15);
            const int b = std::min(std::max(int(bp[n * G + j]) + db, 0), 15);
            const float d = dlo + float(a) * dstep, c = clo + float(b) * cstep;
            float err = 0.f;
            int64_t i = 0;
#if defined(__AVX2__)
            if (real == g) {
              __m256 acc = _mm256_setzero_ps();
              const __m256 dv = _mm256_set1_ps(d), cv = _mm256_set1_ps(c);
              for (; i + 8 <= g; i += 8) {
                __m256 qv;
                acc = _mm256_add_ps(acc, dq_codes8(xg + i, dv, cv, d > 0.f, top, &qv));
                _mm256_storeu_ps(q.data() + i, qv);
              }
              err = hsum(acc);
            }
#endif
            for (; i < g; ++i) {
              q[i] = dq_code1(xg[i], d, c, top);
              if (i < real) {
                const float r = ((q[i] - top / 2.f) * d + c) - xg[i];
                err += r * r;
              }
            }
            if (best_a < 0 || err < best_err) {
              best_err = err;
              best_a = a;
              best_b = b;
              std::swap(q, best_q);
            }
          }
        }
        uint8_t* cg = cp + n * W + j * g;
        for (int64_t i = 0; i < g; ++i) cg[i] = static_cast<uint8_t>(best_q[i]);
        aop[n * G + j] = static_cast<uint8_t>(best_a);
        bop[n * G + j] = static_cast<uint8_t>(best_b);
      }
    }
  });
  return {codes, a_out, b_out};
}
