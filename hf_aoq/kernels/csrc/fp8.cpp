// Float8 weight x float activation on CPU, reading the float8 weight directly.
//
// aten has no fused float8 CPU kernel: upcasting the whole weight on every call costs more
// than the bf16 matmul it replaces. Here each weight row is read once, widened to float32 with
// a bit trick in registers, and dotted with every activation row.
//
// The bit trick: place a float8 code's exponent and mantissa bits at the top of a float32's
// exponent and mantissa (sign stays the sign). The float32 then equals the float8 value times
// 2^-(127 - bias8) for normal and subnormal codes alike, so multiplying by 2^(127 - bias8)
// restores it: e4m3fn shift 20, factor 2^120; e5m2 shift 21, factor 2^112. The GEMV applies the
// factor as two halves, one to the dot product and one to the row's scale: exact (powers of
// two), and no overflow for any scale below 2^68 (the whole factor times a scale above 2^8
// would be infinite in float32).
// Subnormal float32 inputs must not be flushed, so DAZ is cleared for the call.
// The trick has no inf or NaN: e4m3fn's 0x7F / 0xFF and e5m2's 0x7C-0x7F / 0xFC-0xFF read as finite
// numbers. No quantizer writes them and the loader refuses a weight holding them
// (core/primitives.py check_float8_codes_finite); fp8_dpbf16_linear's table decodes them as torch does.
// At 2-28 bf16 rows on AVX512-BF16 (fp8_dpbf16_linear, at the end): the codes as their exact bf16
// values by byte-table lookups and VDPBF16PS's sums (bf16_dot_rows.h).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_gemm.h"
#include "bf16_dot_rows.h"
#include "dequant_gemm.h"
#include "hf_aoq_cpu.h"
#include "simd.h"

namespace {

inline float code_to_scaled_float(uint8_t b, int shift) {
  uint32_t bits = (uint32_t(b & 0x80) << 24) | (uint32_t(b & 0x7F) << shift);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

struct DenormalsKept {
#if defined(__SSE__) || defined(__AVX2__)
  unsigned int saved;
  DenormalsKept() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x0040u); }  // clear DAZ
  ~DenormalsKept() { _mm_setcsr(saved); }
#endif
};

#if defined(__AVX2__)
// Sign-extend each byte to 32 bits and shift: the exponent and mantissa land in place, the sign
// copies above them are masked off except the top one, which is the float32 sign.
inline __m256 codes_to_scaled_floats(const uint8_t* p, int shift) {
  const __m256i b = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if (shift == 20)
    return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 20), _mm256_set1_epi32(int(0x87F00000u))));
  return _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 21), _mm256_set1_epi32(int(0x8FE00000u))));
}

// codes_to_scaled_floats over the kLanes codes at p (simd.h).
inline vfloat codes_to_scaled_lanes(const uint8_t* p, int shift) {
#if defined(__AVX512F__)
  const __m512i b = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if (shift == 20)
    return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 20), _mm512_set1_epi32(int(0x87F00000u))));
  return _mm512_castsi512_ps(_mm512_and_si512(_mm512_slli_epi32(b, 21), _mm512_set1_epi32(int(0x8FE00000u))));
#else
  return {codes_to_scaled_floats(p, shift), codes_to_scaled_floats(p + 8, shift)};
#endif
}

// Dot products of one weight row with MB activation rows, U independent accumulator chains per
// activation row (one chain would leave the loop waiting on FMA latency).
template <int MB, int U>
inline void fp8_row_dots(const uint8_t* row, const float* xp, int64_t K, int s, float* acc) {
  __m256 v[MB][U];
  for (int i = 0; i < MB; ++i)
    for (int u = 0; u < U; ++u) v[i][u] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 * U <= K; k += 8 * U) {
    for (int u = 0; u < U; ++u) {
      const __m256 w = codes_to_scaled_floats(row + k + 8 * u, s);
      for (int i = 0; i < MB; ++i) v[i][u] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i * K + k + 8 * u), w, v[i][u]);
    }
  }
  for (; k + 8 <= K; k += 8) {
    const __m256 w = codes_to_scaled_floats(row + k, s);
    for (int i = 0; i < MB; ++i) v[i][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + i * K + k), w, v[i][0]);
  }
  for (int i = 0; i < MB; ++i) {
    __m256 t = v[i][0];
    for (int u = 1; u < U; ++u) t = _mm256_add_ps(t, v[i][u]);
    acc[i] = hsum(t);
  }
  for (; k < K; ++k) {
    const float w = code_to_scaled_float(row[k], s);
    for (int i = 0; i < MB; ++i) acc[i] += xp[i * K + k] * w;
  }
}

// One activation row against NR weight rows from n on (dot_rows in simd.h): acc gets the NR
// bit-trick-scaled dot products.
template <int NR>
inline void fp8_rows(const uint8_t* codes, const float* x, int64_t K, int64_t n, int s, float* acc) {
  dot_rows<NR>(x, codes + n * K, K, [s](const uint8_t* p) { return codes_to_scaled_lanes(p, s); },
               [s](uint8_t c) { return code_to_scaled_float(c, s); }, acc);
}
#endif

// Weight rows [n0, n1) as float32 [n1 - n0, K], exactly as the reference dequantizes: the code's
// value times its row's scale, one rounding.
struct Fp8Rows {
  const uint8_t* codes;
  const float* scale;
  int64_t K;
  int64_t shift;
  void operator()(int64_t n0, int64_t n1, float* wp) const {
    DenormalsKept keep;
    const float exact_factor = shift == 20 ? std::ldexp(1.f, 120) : std::ldexp(1.f, 112);
    const int s = static_cast<int>(shift);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = codes + n * K;
      float* o = wp + (n - n0) * K;
      const float rs = scale[n];
      int64_t k = 0;
#if defined(__AVX2__)
      const __m256 f = _mm256_set1_ps(exact_factor), sv = _mm256_set1_ps(rs);
      for (; k + 8 <= K; k += 8) {
        const __m256 v = _mm256_mul_ps(codes_to_scaled_floats(row + k, s), f);  // exact: the code's value
        _mm256_storeu_ps(o + k, _mm256_mul_ps(v, sv));
      }
#endif
      for (; k < K; ++k) o[k] = (code_to_scaled_float(row[k], s) * exact_factor) * rs;
    }
  }
};

}  // namespace

// x: float32 [M, K]; codes: uint8 [N, K] (float8 bits); row_scale: float32 [N], the weight's
// per-row scale. Returns float32 [M, N].
torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor row_scale, int64_t shift) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: contiguous uint8 [N, K]");
  TORCH_CHECK(row_scale.dtype() == torch::kFloat32 && row_scale.numel() == codes.size(0), "row_scale: float32 [N]");
  TORCH_CHECK(shift == 20 || shift == 21, "shift: 20 (e4m3fn) or 21 (e5m2)");
  TORCH_CHECK(x.size(1) == codes.size(1), "x and codes disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = row_scale.contiguous().data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int s = static_cast<int>(shift);
  const float half_factor = shift == 20 ? std::ldexp(1.f, 60) : std::ldexp(1.f, 56);
#if defined(__AVX2__)
  // Tiles of four weight rows by up to kTileRows activation rows (simd.h). Here the first half of
  // the factor goes onto each widened code (exact: it lands on the code's value times 2^-60, a
  // normal float32) rather than onto the dot product: the products and partial sums then stay
  // far from float32's subnormal range, where each one would cost a microcode assist.
  if (M > 1) {
    at::parallel_for(0, (N + 3) / 4, 4, [&](int64_t b0, int64_t b1) {
      DenormalsKept keep;
      tiled_dots(xp, cp, M, N, K, b0, b1,
                 [s, half_factor](const uint8_t* p) { return vscale(codes_to_scaled_lanes(p, s), half_factor); },
                 [s, half_factor](uint8_t c) { return code_to_scaled_float(c, s) * half_factor; },
                 [&](int64_t m, int64_t n, float d) { op[m * N + n] = d * (sp[n] * half_factor); });
    });
    return out;
  }
#endif
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    DenormalsKept keep;
    constexpr int64_t MB = 4;  // activation rows per pass over a weight row
    int64_t n = n0;
#if defined(__AVX2__)
    if (M == 1) {  // kDotRows weight rows at a time, then four (the same value for a row either way)
      float acc[kDotRows];
      for (; n + kDotRows <= n1; n += kDotRows) {
        fp8_rows<kDotRows>(cp, xp, K, n, s, acc);
        for (int j = 0; j < kDotRows; ++j) op[n + j] = (acc[j] * half_factor) * (sp[n + j] * half_factor);
      }
      for (; n + 4 <= n1; n += 4) {
        fp8_rows<4>(cp, xp, K, n, s, acc);
        for (int j = 0; j < 4; ++j) op[n + j] = (acc[j] * half_factor) * (sp[n + j] * half_factor);
      }
    }
#endif
    for (; n < n1; ++n) {
      const uint8_t* row = cp + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += MB) {
        const int64_t mb = std::min<int64_t>(MB, M - m0);
        float acc[MB] = {0.f, 0.f, 0.f, 0.f};
        const float* xm = xp + m0 * K;
#if defined(__AVX2__)
        fp8_row_dots<1, 4>(row, xm, K, s, acc);  // M == 1 here: the tail rows of a chunk
#else
        for (int64_t k = 0; k < K; ++k) {
          const float w = code_to_scaled_float(row[k], s);
          for (int64_t i = 0; i < mb; ++i) acc[i] += xm[i * K + k] * w;
        }
#endif
        const float rs = sp[n] * half_factor;
        for (int64_t i = 0; i < mb; ++i) op[(m0 + i) * N + n] = (acc[i] * half_factor) * rs;
      }
    }
  });
  return out;
}

// Many rows: chunks of the weight dequantized to float32 exactly as the reference does it (the
// code's value times its row's scale, one rounding), each multiplied by float32 GEMM. `scale` is
// the per-row scale, as for fp8_linear.
torch::Tensor fp8_dequant_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, int64_t shift) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: contiguous uint8 [N, K]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.numel() == codes.size(0) && scale.is_contiguous(), "scale: float32 [N]");
  TORCH_CHECK(shift == 20 || shift == 21, "shift: 20 (e4m3fn) or 21 (e5m2)");
  TORCH_CHECK(x.size(1) == codes.size(1), "x and codes disagree on K");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  auto y = torch::empty({M, N}, x.options());
  dequant_gemm(x, y, N, K, 1, /*transposed=*/false, Fp8Rows{codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), K, shift});
  return y;
}

// The weight [N, K] in dtype (bfloat16 or float16), bit for bit the reference's dequantize(dtype):
// for aten's GEMM in that dtype at many rows. scale: the per-row scale, as for fp8_linear.
torch::Tensor fp8_dequantize(torch::Tensor codes, torch::Tensor scale, int64_t shift, torch::ScalarType dtype) {
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: contiguous uint8 [N, K]");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.numel() == codes.size(0) && scale.is_contiguous(), "scale: float32 [N]");
  TORCH_CHECK(shift == 20 || shift == 21, "shift: 20 (e4m3fn) or 21 (e5m2)");
  const int64_t N = codes.size(0), K = codes.size(1);
  return dequant_weight(N, K, K, 1, /*transposed=*/false, dtype,
                        Fp8Rows{codes.data_ptr<uint8_t>(), scale.data_ptr<float>(), K, shift});
}

#if HF_AOQ_AMX
namespace {
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
// The exact float32 values of 16 codes (codes_to_scaled_lanes, then the power of two back).
struct Fp8Lanes {
  int shift;
  __m512 factor;
  __m512 operator()(const uint8_t* p) const { return _mm512_mul_ps(codes_to_scaled_lanes(p, shift), factor); }
};
// The row panel with DAZ cleared on the worker thread that writes it: the bit trick's
// intermediate floats are denormal for subnormal codes.
struct Fp8Panel {
  static constexpr bool kWeightRows = true;
  static constexpr bool kAsksAhead = true;
  // Whole chunks: each call sets and restores MXCSR, which held back the tiles' overlap with the
  // writing (16 rows 1.13-1.27 ms a weight in pieces of 256 k against 1.01-1.08).
  static constexpr int64_t kPieceK = 0;
  using Elem = uint16_t;
  RowScalePanel<uint8_t, Fp8Lanes> rows;
  AmxWeightBytes bytes(int64_t n0, int64_t k0, int64_t k1) const { return rows.bytes(n0, k0, k1); }
  void operator()(int64_t n0, int64_t k0, int64_t k1, uint16_t* out, bool ahead) const {
    DenormalsKept keep;
    rows(n0, k0, k1, out, ahead);
  }
};
#pragma GCC pop_options
}  // namespace
#endif

// x: bfloat16 [M, K]; codes: uint8 [N, K] (float8 bits) contiguous, N and K multiples of 32;
// scale: float32 [N]; shift: 20 (e4m3fn) or 21 (e5m2). F.linear in bf16 on AMX tiles (tiles) or
// AVX512-BF16's dot products (amx_gemm.h): the weight's bf16 values are the reference's
// dequantize(bfloat16) (the code's value times its row's scale in float32, rounded once), bit for
// bit. Returns bfloat16 [M, N].
torch::Tensor fp8_amx_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, int64_t shift,
                             c10::optional<torch::Tensor> bias, bool tiles) {
  check_panel_gemm_usable(tiles);
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: contiguous uint8 [N, K]");
  TORCH_CHECK(shift == 20 || shift == 21, "shift: 20 (e4m3fn) or 21 (e5m2)");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "the panel GEMM takes N and K multiples of 32, got ", N, " x ", K);
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.numel() == N && scale.is_contiguous(), "scale: float32 [N]");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x: [M, ", K, "]");
  const torch::Tensor xa = amx_input(x, K), b = amx_bias(bias, N);
  auto y = torch::empty({xa.size(0), N}, xa.options());
#if HF_AOQ_AMX
  const float* sp = scale.data_ptr<float>();
  const Fp8Lanes lanes{static_cast<int>(shift), _mm512_set1_ps(shift == 20 ? std::ldexp(1.f, 120) : std::ldexp(1.f, 112))};
  amx_linear_bf16(reinterpret_cast<const uint16_t*>(xa.data_ptr()), K, xa.size(0), N, K, 32,
                  b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
                  Fp8Panel{{codes.data_ptr<uint8_t>(), sp, K, lanes}}, tiles);
#endif
  return y;
}

#if HF_AOQ_AMX
namespace {
#pragma GCC push_options
#pragma GCC target("avx512vbmi")
// The bf16 bits of float8 magnitudes 0..127 (the code without its sign bit): e4m3fn (shift 20; 127
// is NaN) or e5m2 (shift 21; 124 inf, 125-127 NaN). Exact: at most 4 significant bits, exponents
// from 2^-16 to 2^15.
struct Fp8Bf16Table : Bf16ByteTable {
  explicit Fp8Bf16Table(int64_t shift) {
    const int mb = shift == 20 ? 3 : 2, bias = shift == 20 ? 7 : 15;
    for (int c = 0; c < 128; ++c) {
      const int e = c >> mb, m = c & ((1 << mb) - 1);
      uint16_t b;
      if (shift == 20 && c == 127) {
        b = 0x7FC0;
      } else if (shift == 21 && e == 31) {
        b = m == 0 ? 0x7F80 : 0x7FC0;
      } else {
        const float v = e == 0 ? std::ldexp(static_cast<float>(m), 1 - bias - mb)
                               : std::ldexp(static_cast<float>((1 << mb) + m), e - bias - mb);
        uint32_t u;
        std::memcpy(&u, &v, sizeof u);
        b = static_cast<uint16_t>(u >> 16);
      }
      set(c, b);
    }
  }
};

// bf16_dot_rows' converter for float8 codes: the magnitude's bits looked up, the code's sign bit
// put onto the high byte.
struct Fp8ToBf16 {
  Bf16Lookup lookup;
  __attribute__((always_inline)) void operator()(__m512i c, __m512i& lo, __m512i& hi) const {
    const auto sign = [c](__m512i high) {  // high | (c & 0x80)
      return _mm512_ternarylogic_epi32(high, c, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
    };
    lookup(c, sign, lo, hi);
  }
};

#pragma GCC pop_options
}  // namespace
#endif
// x: bfloat16 [M, K] contiguous; codes: uint8 [N, K] (float8 bits) contiguous; scale: float32
// [N]; shift: 20 (e4m3fn) or 21 (e5m2); bias: [N] or none. y = (x . exact codes) * scale (+ bias)
// per output, summed in float32 by AVX512-BF16's dot products, rounded once to bf16 [M, N]. Needs
// the avx512 build and AVX512-VBMI (the byte permutes; kernels/cpu_isa.py checks both).
torch::Tensor fp8_dpbf16_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scale, int64_t shift,
                                c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(HF_AOQ_AMX, "hf_aoq: the float8 dot-product kernel needs the avx512 build "
              "(kernels/cpu_isa.py decides where it runs)");
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(), "x: contiguous bfloat16 [M, K]");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2 && codes.is_contiguous(), "codes: contiguous uint8 [N, K]");
  TORCH_CHECK(shift == 20 || shift == 21, "shift: 20 (e4m3fn) or 21 (e5m2)");
  TORCH_CHECK(x.size(1) == codes.size(1), "x and codes disagree on K: ", x.size(1), " and ", codes.size(1));
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.numel() == N && scale.is_contiguous(), "scale: float32 [", N, "]");
  const torch::Tensor b = amx_bias(bias, N);
  if (M == 0 || N == 0 || K == 0)
    return (b.defined() ? b.expand({M, N}) : torch::zeros({M, N}, torch::kFloat32)).to(torch::kBFloat16);
  auto y = torch::empty({M, N}, x.options());
#if HF_AOQ_AMX
  TORCH_CHECK(__builtin_cpu_supports("avx512vbmi"), "hf_aoq: the float8 dot-product kernel needs AVX512-VBMI");
  static const Fp8Bf16Table e4m3(20), e5m2(21);
  bf16_dot_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, codes.data_ptr<uint8_t>(), N,
                scale.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
                Fp8ToBf16{Bf16Lookup(shift == 20 ? e4m3 : e5m2)}, reinterpret_cast<uint16_t*>(y.data_ptr()));
#endif
  return y;
}
