// Int8 weights with dynamic int8 activations (Int8Tensor act_quant="per_token") in exact integer
// sums, in the avx512 build: each row of x quantized as the reference quantizes it (the rule of
// int8_per_token.h in AVX-512 lanes: the same codes and scales), its codes dotted with the
// weight's in exact int32 sums, and one float32 epilogue, y = float(sum) x the row's scale x the
// weight row's scale (+ bias), each a float32 rounding, then one rounding to x's dtype. Three
// engines make the sums:
//  - AMX's int8 tiles (TDPBSSD; amx_gemm.h's tile loop, the weight's rows as A), many rows;
//  - AVX-512 VNNI's VPDPBUSD in amx_gemm.h's dot-product loop (x's rows as A, the weight in lanes
//    of four codes as B), many rows where AMX is not: at twice the rate of AVX512-BF16's dot
//    products, the bf16 rows' engine there;
//  - a VPDPBUSD GEMV that streams the weight's rows against each row's codes, few rows.
// VPDPBUSD multiplies unsigned bytes by signed ones: the weight's codes go in as w + 128 (their
// top bit flipped) and each sum of row m then holds 128 x (the sum of row m's codes) too, taken
// off before the epilogue. The int32 arithmetic wraps, so the result is exact whenever the true
// sum fits in int32 (|sum| <= 127 x 127 x K: K up to 131072 is taken), whatever the partial sums
// did.
// Exact integer sums do not depend on their order, and every engine ends in int8dyn_store32: all
// three give the same bits, and a row's bits do not depend on the other rows
// (tests/kernels/test_cpu_int8dyn.py). The reference rounds the dequantized activations and weight
// to x's dtype and sums those products in float32; these outputs are nearer the exact product of
// the codes.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx_gemm.h"
#include "float_dtypes.h"
#include "hf_aoq_cpu.h"
#include "int8_weight.h"
#include "simd.h"

#if HF_AOQ_AMX
namespace {
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8")

template <typename T>
inline __m512 int8dyn_load(const T* p) {
  if constexpr (std::is_same_v<T, float>)
    return _mm512_loadu_ps(p);
  else if constexpr (std::is_same_v<T, at::BFloat16>)
    return bf16_lanes(reinterpret_cast<const uint16_t*>(p));
  else
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Rows of x (float32, bf16 or fp16; rows ldx apart, K a multiple of 16) as symmetric int8 codes
// (codes [M, K]), their scales, and 128 x the sum of each row's codes (fix, as VPDPBUSD's sums
// carry it; wrapping int32), int8_per_token.h's rule (common.quantize_int8_per_token's) bit for
// bit. A row with a NaN gets a NaN scale (and so NaN outputs), one with an infinity an infinite
// one, as there.
template <typename T>
void int8dyn_quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K, int8_t* codes, float* scales, int32_t* fix) {
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* row = x + m * ldx;
      __m512 amax = _mm512_setzero_ps();
      __mmask16 nan = 0;  // max_ps drops a NaN operand; torch's amax (and so the scale) keeps it
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 v = int8dyn_load(row + k);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      }
      const float s = nan ? std::numeric_limits<float>::quiet_NaN()
                          : std::max(_mm512_reduce_max_ps(amax) / 127.f, 1e-12f);
      scales[m] = s;
      const __m512 sv = _mm512_set1_ps(s), lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
      __m512i total = _mm512_setzero_si512();
      for (int64_t k = 0; k < K; k += 16) {
        const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(int8dyn_load(row + k), sv),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m128i c = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(q, lo), hi)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + m * K + k), c);
        total = _mm512_add_epi32(total, _mm512_cvtepi8_epi32(c));  // the stored codes, whatever a NaN made
      }
      fix[m] = static_cast<int32_t>(static_cast<uint32_t>(_mm512_reduce_add_epi32(total)) * 128u);
    }
  });
}

// Output columns n..n+31 of one row (o, wscale and bias from column n): s0, s1 the exact int32
// sums of columns n..n+15 and n+16..n+31; float(sum) x sx x the weight row's scale (+ bias, float32
// or null), each a float32 rounding, then one rounding to T. Every engine's last step.
template <typename T>
inline void int8dyn_store32(__m512i s0, __m512i s1, float sx, const float* wscale, const float* bias, T* o) {
  const __m512 sv = _mm512_set1_ps(sx);
  const auto value = [&](__m512i s, int h) {
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * h) : _mm512_setzero_ps();
    return _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s), sv), _mm512_loadu_ps(wscale + 16 * h)), b);
  };
  const __m512 v0 = value(s0, 0), v1 = value(s1, 1);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(o, v0);
    _mm512_storeu_ps(o + 16, v1);
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    _mm512_storeu_si512(o, bf16_pack(v0, v1));
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtps_ph(v0, _MM_FROUND_TO_NEAREST_INT));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16), _mm512_cvtps_ph(v1, _MM_FROUND_TO_NEAREST_INT));
  }
}

// A finished 32 x 32 block of int32 sums from amx_linear_tiles ([n][m] when nm) into y's rows
// m0.. (T: float32, bf16 or fp16), less fix[m] (the dot products' 128 x code sums; null for the
// tiles, whose sums are exact as they come).
template <typename T>
struct Int8DynOut {
  const float* xscale;
  const int32_t* fix;
  const float* wscale;
  const float* bias;
  T* y;
  int64_t N;
  void operator()(float* c, bool nm, int64_t n0, int64_t m0, int64_t rows) const {
    if (nm) amx_transpose_block(c);
    for (int64_t r = 0; r < rows; ++r) {
      __m512i s0 = _mm512_load_si512(c + r * 32), s1 = _mm512_load_si512(c + r * 32 + 16);
      if (fix) {
        const __m512i f = _mm512_set1_epi32(fix[m0 + r]);
        s0 = _mm512_sub_epi32(s0, f);
        s1 = _mm512_sub_epi32(s1, f);
      }
      int8dyn_store32(s0, s1, xscale[m0 + r], wscale + n0, bias ? bias + n0 : nullptr, y + (m0 + r) * N + n0);
    }
  }
};

// Panel writer for the dot-product loop: int8 codes ([N, K], row-major) as the B operand, rows
// n0..n0+31 and k in [k0, k1) as lanes of four consecutive codes, panel[(k - k0) / 4 * 32 + j] =
// row n0 + j's lane at k, each code + 128 (VPDPBUSD's unsigned side). 64 k at a time: 16 rows'
// 64 bytes, a 16 x 16 transpose of 4-byte lanes, 16 stores, twice.
struct Int8LanesPanel {
  static constexpr bool kWeightRows = false;
  static constexpr bool kAsksAhead = false;
  static constexpr int64_t kPieceK = 256;
  using Elem = uint32_t;
  const int8_t* q;
  int64_t K;
  AmxWeightBytes bytes(int64_t n0, int64_t k0, int64_t k1) const { return {q + n0 * K + k0, kAmxBlockN, K, k1 - k0}; }
  void operator()(int64_t n0, int64_t k0, int64_t k1, uint32_t* panel, bool /*ahead*/) const {
    const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int64_t k = k0; k < k1; k += 64) {
      uint32_t* o = panel + (k - k0) / 4 * kAmxBlockN;
      for (int h = 0; h < 2; ++h) {
        __m512i r[16];
        for (int i = 0; i < 16; ++i) r[i] = _mm512_xor_si512(_mm512_loadu_si512(q + (n0 + 16 * h + i) * K + k), flip);
        transpose16x16_epi32(r);  // r[j] lane i: row 16h + i's lane j
        for (int j = 0; j < 16; ++j) _mm512_store_si512(o + j * kAmxBlockN + 16 * h, r[j]);
      }
    }
  }
};

// The GEMV's tile: MB rows of codes (c, K apart; fix from the first) against NR weight rows (w, K
// apart), K a multiple of 64: s[i * N + r] = the exact int32 sum of code row i and weight row r.
// Per 64 bytes of each weight row one load, one flip to unsigned, and one VPDPBUSD per code row.
// While a block of rows is read, each row asks for the same line of the row NR on (the next
// block's) into L2, as the other GEMVs do (simd.h dot_rows).
template <int NR, int MB>
inline void int8dyn_gemv_tile(const int8_t* c, const int32_t* fix, const int8_t* w, int64_t K, int32_t* s, int64_t N) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc[MB][NR];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < K; k += 64) {
    for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (NR + r) * K + k), _MM_HINT_T1);
    __m512i xv[MB];
    for (int i = 0; i < MB; ++i) xv[i] = _mm512_loadu_si512(c + i * K + k);
    for (int r = 0; r < NR; ++r) {
      const __m512i wr = _mm512_xor_si512(_mm512_loadu_si512(w + r * K + k), flip);
      for (int i = 0; i < MB; ++i) acc[i][r] = dpbusd512(acc[i][r], wr, xv[i]);
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NR; ++r)
      s[i * N + r] = static_cast<int32_t>(static_cast<uint32_t>(_mm512_reduce_add_epi32(acc[i][r])) -
                                          static_cast<uint32_t>(fix[i]));
}

// The exact sums [M, N] of the codes [M, K] against q [N, K] (N a multiple of 8, K of 64): blocks
// of weight rows over the threads, 8 rows at one code row, else 4 rows by up to 4 code rows at a
// time (the block's rows, 4 x K bytes, stay in L1 while each group of code rows passes).
void int8dyn_gemv_sums(const int8_t* codes, const int32_t* fix, const int8_t* q, int64_t M, int64_t N, int64_t K,
                       int32_t* sums) {
  const int64_t rows = M == 1 ? 8 : 4;
  at::parallel_for(0, N / rows, std::max<int64_t>(1, 16 / rows), [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * rows;
      const int8_t* w = q + n0 * K;
      if (M == 1) {
        int8dyn_gemv_tile<8, 1>(codes, fix, w, K, sums + n0, N);
        continue;
      }
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) int8dyn_gemv_tile<4, 4>(codes + m * K, fix + m, w, K, sums + m * N + n0, N);
      const int8_t* c = codes + m * K;
      int32_t* s = sums + m * N + n0;
      switch (M - m) {
        case 3: int8dyn_gemv_tile<4, 3>(c, fix + m, w, K, s, N); break;
        case 2: int8dyn_gemv_tile<4, 2>(c, fix + m, w, K, s, N); break;
        case 1: int8dyn_gemv_tile<4, 1>(c, fix + m, w, K, s, N); break;
        default: break;
      }
    }
  });
}

// The GEMV: y [M, N] (T) from the codes [M, K], their scales xs and fix, and the weight q [N, K]
// with its row scales ws (and bias, or null): the sums, then int8dyn_store32 row by row.
template <typename T>
void int8dyn_gemv(const int8_t* codes, const float* xs, const int32_t* fix, const int8_t* q, const float* ws,
                  const float* bias, int64_t M, int64_t N, int64_t K, T* y) {
  std::vector<int32_t> sums(M * N);
  int8dyn_gemv_sums(codes, fix, q, M, N, K, sums.data());
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t n = 0; n < N; n += 32) {
        const int32_t* s = sums.data() + m * N + n;
        int8dyn_store32(_mm512_loadu_si512(s), _mm512_loadu_si512(s + 16), xs[m], ws + n, bias ? bias + n : nullptr,
                        y + m * N + n);
      }
  });
}

#pragma GCC pop_options
}  // namespace
#endif

namespace {

// The most columns whose sums of code products are sure to fit in int32 (127 x 127 x K < 2^31),
// a power of two (kernels/cpu_int8dyn.py INT8DYN_MAX_K).
constexpr int64_t kInt8DynMaxK = 131072;

// x: float32, bfloat16 or float16 [M, K] (rows contiguous); q: int8 [N, K] contiguous, N a
// multiple of 32, K of 64 and at most kInt8DynMaxK; scale: [N] (or [N, 1]), any float dtype. The
// sums on AMX's tiles (tiles), else on VPDPBUSD: the GEMV at up to gemv_max_rows rows, the
// dot-product loop above. Returns [M, N] in x's dtype.
torch::Tensor int8dyn_linear(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                             const c10::optional<torch::Tensor>& bias, bool tiles, int64_t gemv_max_rows) {
  const Int8Weight w = check_int8_weight(q, scale);
  const int64_t N = w.N, K = w.K;
  TORCH_CHECK(N % 32 == 0 && K % 64 == 0, "the int8 x int8 kernels take N a multiple of 32 and K of 64, got ", N,
              " x ", K);
  TORCH_CHECK(K <= kInt8DynMaxK, "the int8 x int8 kernels take K up to ", kInt8DynMaxK,
              " (127 x 127 x K within int32), got ", K);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.stride(1) == 1, "x: [M, ", K, "] with contiguous rows");
  const auto dt = x.scalar_type();
  dispatch_float(dt, [](auto) {});  // refuses other dtypes before any work
  const torch::Tensor b = amx_bias(bias, N);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options().memory_format(at::MemoryFormat::Contiguous));
#if HF_AOQ_AMX
  std::vector<int8_t> codes(M * K);
  std::vector<float> xs(M);
  std::vector<int32_t> fix(M);
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  const float* sp = w.scale.data_ptr<float>();
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    T* yp = reinterpret_cast<T*>(y.data_ptr());
    int8dyn_quantize_rows(reinterpret_cast<const T*>(x.data_ptr()), x.stride(0), M, K, codes.data(), xs.data(),
                          fix.data());
    const uint8_t* c = reinterpret_cast<const uint8_t*>(codes.data());
    if (tiles) {
      amx_linear_tiles<1>(c, K, M, N, K, 64, Int8RowsPanel{w.q, K}, Int8DynOut<T>{xs.data(), nullptr, sp, bp, yp, N});
    } else if (M > gemv_max_rows) {
      const Int8DynOut<T> out{xs.data(), fix.data(), sp, bp, yp, N};
      amx_linear_tiles<1, Int8LanesPanel, Int8DynOut<T>, false>(c, K, M, N, K, 64, Int8LanesPanel{w.q, K}, out);
    } else {
      int8dyn_gemv(codes.data(), xs.data(), fix.data(), w.q, sp, bp, M, N, K, yp);
    }
  });
#endif
  return y;
}

}  // namespace

// The AMX tiles' entry (kernels/cpu_int8dyn.py's cpu_int8dyn_amx row): int8dyn_linear above.
torch::Tensor int8dyn_amx_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                 c10::optional<torch::Tensor> bias) {
  check_amx_usable();
  return int8dyn_linear(x, q, scale, bias, /*tiles=*/true, 0);
}

// The VPDPBUSD entry (the cpu_int8dyn_vnni row): int8dyn_linear above, the GEMV at up to
// gemv_max_rows rows. Any CPU the avx512 build loads on has AVX-512 VNNI.
torch::Tensor int8dyn_vnni_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale,
                                  c10::optional<torch::Tensor> bias, int64_t gemv_max_rows) {
  TORCH_CHECK(HF_AOQ_AMX, "hf_aoq: the int8 x int8 dot-product kernels need the avx512 build "
              "(kernels/cpu_isa.py decides where they run)");
  return int8dyn_linear(x, q, scale, bias, /*tiles=*/false, gemv_max_rows);
}
