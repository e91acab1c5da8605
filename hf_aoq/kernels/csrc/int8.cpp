// Int8 weight x float activation on CPU: aten's `_weight_int8pack_mm` is built for bf16
// activations and is 10-30x slower than a float32 GEMM with float32 activations or at a few
// hundred rows. Half-precision activations (and K a multiple of 32), any number of rows: the
// activations as int16 codes in exact integer multiply-adds with the int8 codes (int8_code_gemv).
// Float32 activations: few rows, each weight row read once and dotted with every activation row
// in float32 (a GEMV that streams the weight); many rows, chunks of the weight dequantized exactly
// as the reference does it, multiplied by float32 GEMM (dequant_gemm.h).
#include <torch/types.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_gemm.h"
#include "dequant_gemm.h"
#include "hf_aoq_cpu.h"
#include "int16_rows.h"
#include "int8_weight.h"
#include "simd.h"

namespace {

#if defined(__AVX2__)
// The float32 values of the kLanes codes at p (simd.h).
inline vfloat int8_lanes(const int8_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  const auto x8 = [](const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  };
  return {x8(p), x8(p + 8)};
#endif
}

// One activation row against NR weight rows from n on (dot_rows in simd.h), scaled into y.
template <int NR>
inline void int8_rows(const float* x, const int8_t* q, const float* scale, int64_t K, int64_t n, float* y) {
  float d[NR];
  dot_rows<NR>(x, q + n * K, K, [](const int8_t* p) { return int8_lanes(p); }, [](int8_t c) { return float(c); }, d);
  for (int j = 0; j < NR; ++j) y[n + j] = d[j] * scale[n + j];
}
#endif

// y[m, n] = scale[n] * sum_k x[m, k] * q[n, k]: one activation row kDotRows weight rows at a time,
// more rows in tiles of four weight rows by several activation rows (each weight byte read once
// per tile of activation rows); without AVX2, one row at a time.
void int8_gemv(const float* x, const int8_t* q, const float* scale, float* y, int64_t M, int64_t N, int64_t K) {
#if defined(__AVX2__)
  if (M == 1 && N % 4 == 0) {  // kDotRows weight rows at a time, the last four alone when fewer are left
    at::parallel_for(0, (N + kDotRows - 1) / kDotRows, 16 / kDotRows, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        if (kDotRows * b + kDotRows <= N)
          int8_rows<kDotRows>(x, q, scale, K, kDotRows * b, y);
        else
          int8_rows<4>(x, q, scale, K, kDotRows * b, y);
      }
    });
    return;
  }
  if (M > 1) {  // tiles of four weight rows by up to kTileRows activation rows (simd.h)
    at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t b0, int64_t b1) {
      tiled_dots(x, q, M, N, K, b0, b1, [](const int8_t* p) { return int8_lanes(p); }, [](int8_t c) { return float(c); },
                 [&](int64_t m, int64_t n, float d) { y[m * N + n] = d * scale[n]; });
    });
    return;
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t n = r0; n < r1; ++n) {
      const int8_t* row = q + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        const bool two = m0 + 1 < M;
        const float* x0 = x + m0 * K;
        const float* x1 = x + (two ? m0 + 1 : m0) * K;
        float a0 = 0.f, a1 = 0.f;
        int64_t k = 0;
#if defined(__AVX2__)
        __m256 v0 = _mm256_setzero_ps(), v1 = _mm256_setzero_ps();
        __m256 u0 = _mm256_setzero_ps(), u1 = _mm256_setzero_ps();
        for (; k + 16 <= K; k += 16) {
          const __m256 wa = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k))));
          const __m256 wb = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k + 8))));
          v0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k), wa, v0);
          u0 = _mm256_fmadd_ps(_mm256_loadu_ps(x0 + k + 8), wb, u0);
          if (two) {
            v1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k), wa, v1);
            u1 = _mm256_fmadd_ps(_mm256_loadu_ps(x1 + k + 8), wb, u1);
          }
        }
        a0 = hsum(_mm256_add_ps(v0, u0));
        a1 = hsum(_mm256_add_ps(v1, u1));
#endif
        for (; k < K; ++k) {
          a0 += x0[k] * float(row[k]);
          a1 += x1[k] * float(row[k]);
        }
        y[m0 * N + n] = a0 * scale[n];
        if (two) y[(m0 + 1) * N + n] = a1 * scale[n];
      }
    }
  });
}

#if defined(__AVX2__)
// Half-precision activations as int16 codes (int16_rows.h: per row and group of gs columns, within
// 1/65534 of the group's largest |x|) meet the int8 codes in exact integer multiply-adds, 32
// columns a step: per weight byte one widening and half a multiply-add, where the float32 GEMV
// widens each byte to float32 and multiplies it in float (three instructions per 16). On a 2-core
// AMD EPYC Zen 4 both read DRAM at its rate at one row, but from cache, and from 4 rows on (the
// weight reused from L1), the float work was the limit: 16 rows took half the time with the codes
// (docs/performance.md). Lane l of a step's sums takes columns 2l and 2l + 1 of its
// 32 (vpdpwssd on AVX-512 VNNI; vpmaddwd + vpaddd on AVX2, two registers of eight lanes, the same
// int32 sums), each group's int32 lanes are turned to float32 and added times the group's sx,
// and vsum adds the lanes: the same operations in both builds, so the same outputs.
#if defined(__AVX512F__)
using ivec = __m512i;
inline ivec izero() { return _mm512_setzero_si512(); }
inline ivec codes32(const int16_t* p) { return _mm512_loadu_si512(p); }
inline ivec widen32(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline ivec dot_pairs(ivec acc, ivec a, ivec b) { return dpwssd512(acc, a, b); }
inline vfloat lanes_float(ivec v) { return _mm512_cvtepi32_ps(v); }
inline vfloat vset(float f) { return _mm512_set1_ps(f); }
constexpr int kCodeRows = 8;  // weight rows per step at one activation row: 8 int32 + 8 float32 accumulators
#else
struct ivec {
  __m256i lo, hi;
};
inline ivec izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline ivec codes32(const int16_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16))};
}
inline ivec widen32(const int8_t* p) {
  return {_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))};
}
inline ivec dot_pairs(ivec acc, ivec a, ivec b) {
  return {_mm256_add_epi32(acc.lo, _mm256_madd_epi16(a.lo, b.lo)), _mm256_add_epi32(acc.hi, _mm256_madd_epi16(a.hi, b.hi))};
}
inline vfloat lanes_float(ivec v) { return {_mm256_cvtepi32_ps(v.lo), _mm256_cvtepi32_ps(v.hi)}; }
inline vfloat vset(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
constexpr int kCodeRows = 4;
#endif

// MB activation rows of codes (from m0) against NR weight rows (from n0), K a multiple of 32 and
// of gs: y[m, n] = scale[n] * sum over groups g of sx[m, g] * (exact int32 sum of the group's
// code products), summed lane by lane in float32, then across lanes. While a block of rows is
// read, each row asks for the same column of the row NR on (the next block's) into L2, as dot_rows does.
template <int NR, int MB>
inline void int8_code_tile(const Int16Rows& xr, int64_t m0, const int8_t* q, const float* scale, int64_t K,
                           int64_t gs, int64_t n0, float* y, int64_t N) {
  const int64_t G = K / gs;
  const int8_t* w = q + n0 * K;
  const int16_t* c = xr.codes.data() + m0 * K;
  vfloat f[MB][NR];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NR; ++r) f[i][r] = vzero();
  for (int64_t g = 0; g < G; ++g) {
    ivec acc[MB][NR];
    for (int i = 0; i < MB; ++i)
      for (int r = 0; r < NR; ++r) acc[i][r] = izero();
    for (int64_t k = g * gs; k < (g + 1) * gs; k += 32) {
      if ((k & 63) == 0)
        for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * K + k), _MM_HINT_T1);
      ivec xc[MB];
      for (int i = 0; i < MB; ++i) xc[i] = codes32(c + i * K + k);
      for (int r = 0; r < NR; ++r) {
        const ivec wr = widen32(w + r * K + k);
        for (int i = 0; i < MB; ++i) acc[i][r] = dot_pairs(acc[i][r], wr, xc[i]);
      }
    }
    for (int i = 0; i < MB; ++i) {
      const vfloat s = vset(xr.sx[(m0 + i) * G + g]);
      for (int r = 0; r < NR; ++r) f[i][r] = vfma(lanes_float(acc[i][r]), s, f[i][r]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NR; ++r) y[(m0 + i) * N + n0 + r] = vsum(f[i][r]) * scale[n0 + r];
}

// AVX2, more than one activation row: blocks of NB weight rows over the threads; in a block, MB
// activation rows at a time against each NR of its rows, so that the MB rows' codes stay in L1
// while the block's rows come from L2. (Four weight rows by every activation row in turn, as at
// one row, read each activation row from L2 or L3 again for every four weight rows: 1.13-1.53x
// slower at 2-256 rows on a Zen 4 in the AVX2 build; docs/performance.md.) The same operations
// per output as every tile, so the same outputs.
template <int NR, int MB, int NB>
void int8_code_blocks(const Int16Rows& xr, const int8_t* q, const float* scale, float* y, int64_t M, int64_t N,
                      int64_t K, int64_t gs) {
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * NB, n1 = std::min<int64_t>(N, n0 + NB);
      int64_t m = 0;
      for (; m + MB <= M; m += MB) {
        int64_t n = n0;
        for (; n + NR <= n1; n += NR) int8_code_tile<NR, MB>(xr, m, q, scale, K, gs, n, y, N);
        for (; n < n1; ++n)
          for (int i = 0; i < MB; ++i) int8_code_tile<1, 1>(xr, m + i, q, scale, K, gs, n, y, N);
      }
      for (; m < M; ++m) {
        int64_t n = n0;
        for (; n + NR <= n1; n += NR) int8_code_tile<NR, 1>(xr, m, q, scale, K, gs, n, y, N);
        for (; n < n1; ++n) int8_code_tile<1, 1>(xr, m, q, scale, K, gs, n, y, N);
      }
    }
  });
}

// The int16-code kernel over all M rows: at one row, blocks of kCodeRows weight rows over the
// threads (a last part block one row at a time); at more rows, on AVX-512, blocks of four weight
// rows by activation row pairs (half the rows a tile, so that both accumulator sets fit its 32
// registers), on AVX2 int8_code_blocks' tiles of two weight rows by two activation rows.
void int8_code_gemv(const Int16Rows& xr, const int8_t* q, const float* scale, float* y, int64_t M, int64_t N, int64_t K,
                    int64_t gs) {
#if defined(__AVX512F__)
  constexpr int kPair = 2, kPairRows = kCodeRows / 2;
#else
  if (M > 1) {
    int8_code_blocks<2, 2, 32>(xr, q, scale, y, M, N, K, gs);
    return;
  }
  constexpr int kPair = 1, kPairRows = kCodeRows;  // one row only, here
#endif
  const int64_t rows = M == 1 ? kCodeRows : kPairRows, full = N / rows;
  at::parallel_for(0, full + (N % rows ? 1 : 0), std::max<int64_t>(1, 16 / rows), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      if (b == full) {  // the rows past the last full block
        for (int64_t n = b * rows; n < N; ++n)
          for (int64_t m = 0; m < M; ++m) int8_code_tile<1, 1>(xr, m, q, scale, K, gs, n, y, N);
      } else if (M == 1) {
        int8_code_tile<kCodeRows, 1>(xr, 0, q, scale, K, gs, b * rows, y, N);
      } else {
        int64_t m = 0;
        for (; m + kPair <= M; m += kPair) int8_code_tile<kPairRows, kPair>(xr, m, q, scale, K, gs, b * rows, y, N);
        for (; m < M; ++m) int8_code_tile<kPairRows, 1>(xr, m, q, scale, K, gs, b * rows, y, N);
      }
    }
  });
}

// The int16 codes' group: the largest of 256, 128, 64 and 32 columns that divides K (0 when none
// does: the float32 GEMV then).
inline int64_t int8_code_group(int64_t K) {
  for (int64_t gs : {256, 128, 64, 32})
    if (K % gs == 0) return gs;
  return 0;
}
#endif

// Weight rows [n0, n1) as float32 [n1 - n0, K]: q * scale, the reference's float32 dequantization.
struct Int8Rows {
  const int8_t* q;
  const float* scale;
  int64_t K;
  void operator()(int64_t n0, int64_t n1, float* buf) const {
    for (int64_t n = n0; n < n1; ++n) {
      const int8_t* row = q + n * K;
      float* o = buf + (n - n0) * K;
      const float s = scale[n];
      for (int64_t k = 0; k < K; ++k) o[k] = float(row[k]) * s;
    }
  }
};

}  // namespace

// x: float32 [M, K] contiguous; q: int8 [N, K] contiguous; scale: float32 [N]. Returns float32
// [M, N]. Where x came in half precision (int16_activations) and K is a multiple of 32: int16
// activation codes at any number of rows (int8_code_gemv; at many rows as fast as dequantize +
// float32 GEMM or faster in the AVX2 build, 1.6-2.2x in the AVX-512 one, with no float32 copy of
// the weight). Otherwise, up to gemv_max_rows, the float32 GEMV; above, chunks of q * scale (the
// reference's float32 dequantization) and GEMM.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t gemv_max_rows,
                          bool int16_activations) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.dim() == 2 && q.is_contiguous() && q.size(1) == x.size(1),
              "q: contiguous int8 [N, K]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.numel() == q.size(0) && scale.is_contiguous(), "scale: float32 [N]");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto y = torch::empty({M, N}, x.options());
#if defined(__AVX2__)
  const int64_t gs = int8_code_group(K);
  if (int16_activations && gs > 0) {
    const Int16Rows xr = quantize_rows16(x.data_ptr<float>(), M, K, gs);
    int8_code_gemv(xr, q.data_ptr<int8_t>(), scale.data_ptr<float>(), y.data_ptr<float>(), M, N, K, gs);
    return y;
  }
#endif
  if (M <= gemv_max_rows) {
    int8_gemv(x.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), y.data_ptr<float>(), M, N, K);
    return y;
  }
  const Int8Rows rows{q.data_ptr<int8_t>(), scale.data_ptr<float>(), K};
  dequant_gemm(x, y, N, K, 1, /*transposed=*/false, rows);
  return y;
}

// The weight [N, K] in dtype (bfloat16 or float16), bit for bit the reference's dequantize(dtype):
// for aten's GEMM in that dtype at many rows. scale: [N] or [N, 1], any float dtype.
torch::Tensor int8_dequantize(torch::Tensor q, torch::Tensor scale, torch::ScalarType dtype) {
  const Int8Weight w = check_int8_weight(q, scale);
  return dequant_weight(w.N, w.K, w.K, 1, /*transposed=*/false, dtype, Int8Rows{w.q, w.scale.data_ptr<float>(), w.K});
}

#if HF_AOQ_AMX
namespace {
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8")
struct Int8Lanes {
  __m512 operator()(const int8_t* p) const {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
};
#pragma GCC pop_options
}  // namespace
#endif

// x: bfloat16 [M, K]; q: int8 [N, K] contiguous, N and K multiples of 32; scale: [N] (or [N, 1]),
// any float dtype. F.linear in bf16 on AMX tiles (tiles) or AVX512-BF16's dot products
// (amx_gemm.h): the weight's bf16 values are the reference's dequantize(bfloat16) (q * scale in
// float32, rounded once), bit for bit. Returns bfloat16 [M, N].
torch::Tensor int8_amx_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> bias,
                             bool tiles) {
  check_panel_gemm_usable(tiles);
  const Int8Weight w = check_int8_weight(q, scale);
  const int64_t N = w.N, K = w.K;
  const torch::Tensor& s = w.scale;
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "the panel GEMM takes N and K multiples of 32, got ", N, " x ", K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x: [M, ", K, "]");
  const torch::Tensor xa = amx_input(x, K), b = amx_bias(bias, N);
  auto y = torch::empty({xa.size(0), N}, xa.options());
#if HF_AOQ_AMX
  const float* sp = s.data_ptr<float>();
  amx_linear_bf16(reinterpret_cast<const uint16_t*>(xa.data_ptr()), K, xa.size(0), N, K, 32,
                  b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
                  RowScalePanel<int8_t, Int8Lanes>{q.data_ptr<int8_t>(), sp, K, Int8Lanes{}}, tiles);
#endif
  return y;
}
