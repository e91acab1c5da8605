// FPxTensor's CPU kernels (sub-byte floats, 1 sign + ebits + mbits bits; canonical layout: per row
// IntxTensor's little-endian bit stream, column k at stream bits [k*b, (k+1)*b), one float scale
// per row): F.linear in one call, and the weight dequantized exactly as the reference does it.
//
// Decoding is a table lookup fused into the GEMV: 16 codes (2b bytes) at a time. Their bytes are
// broadcast to every 128-bit lane, a byte shuffle gives 32-bit lane j the two bytes holding code j
// and a variable shift moves the code to bits 0..b-1 (the bits above are the next code's). The
// magnitude comes from a table of 2^(b-1) float32 values indexed by the low bits (AVX-512: one
// vpermt2ps over 32 entries; AVX2: up to four vpermps and blends), the sign from the code's top
// bit moved to bit 31 by a shift of 32 - b. That shift also leaves the magnitude bits at bits
// 32-b..30, so the table holds each value's bits XOR (index << (32 - b)), which the same XOR
// cancels (the idea of mx.cpp's e2m1 table): exact values, nothing rounded. Both builds decode 16
// codes per step into the same 16 float32 lanes (simd.h's vfloat) and add the products in the
// same order (even steps into one accumulator, odd into another), so their outputs are equal bit
// for bit.
//
// Few rows (up to gemv_max_rows): per weight row, the dot products in float32, decoded in
// registers once per tile of kFpxTile activation rows, times the row's scale. Many rows: chunks
// of the weight dequantized to float32 exactly as the reference (value * scale in float32) and
// float32 GEMM (dequant_gemm.h); fpx_dequantize gives the weight in bf16/fp16/fp32 for aten's
// GEMM (kernels/cpu_fpx.py).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hf_aoq_cpu.h"
#include "dequant_gemm.h"
#include "simd.h"

namespace {

constexpr int64_t kStep = 16;  // codes per decode step
constexpr int64_t kRead = 16;  // bytes a step's load may touch from its start

struct FpxFormat {
  int bits;
  float values[64];     // by code: magnitudes, then their negatives
  uint32_t tbits[32];   // the XOR table of the comment above, periodic in the magnitude bits
};

FpxFormat make_format(int64_t ebits, int64_t mbits) {
  TORCH_CHECK(ebits >= 1 && mbits >= 0 && ebits + mbits >= 2 && ebits + mbits <= 5,
              "ebits, mbits: 1 + ebits + mbits must be 3..6 bits, got ebits ", ebits, ", mbits ", mbits);
  FpxFormat f;
  f.bits = static_cast<int>(1 + ebits + mbits);
  const int mags = 1 << (ebits + mbits), bias = (1 << (ebits - 1)) - 1;
  for (int c = 0; c < mags; ++c) {
    const int e = c >> mbits, m = c & ((1 << mbits) - 1);
    const double v = e == 0 ? std::ldexp(double(m), 1 - bias - int(mbits))
                            : std::ldexp(double((1 << mbits) + m), e - bias - int(mbits));
    f.values[c] = static_cast<float>(v);
    f.values[c + mags] = -static_cast<float>(v);
  }
  for (int i = 0; i < 32; ++i) {
    const uint32_t mag = uint32_t(i) & uint32_t(mags - 1);
    uint32_t vb;
    std::memcpy(&vb, &f.values[mag], 4);
    f.tbits[i] = vb ^ (mag << (32 - f.bits));
  }
  return f;
}

template <int B>
inline int code_of(const uint8_t* row, int64_t k) {
  const int64_t bit = k * B, byte = bit >> 3;
  const int sh = static_cast<int>(bit & 7);
  uint32_t w = row[byte];
  if (sh + B > 8) w |= uint32_t(row[byte + 1]) << 8;
  return static_cast<int>((w >> sh) & ((1u << B) - 1));
}

inline float scale_of(const void* scale, torch::ScalarType t, int64_t n) {
  if (t == torch::kFloat32) return static_cast<const float*>(scale)[n];
  if (t == torch::kBFloat16) return static_cast<float>(static_cast<const c10::BFloat16*>(scale)[n]);
  return static_cast<float>(static_cast<const c10::Half*>(scale)[n]);
}

struct FpxWeight {
  const uint8_t* q;
  int64_t N, K, row_bytes;
  const void* scale;
  torch::ScalarType dtype;
  FpxFormat fmt;
};

#if defined(__AVX2__)

// The 16 codes whose 2B bytes start at p, as float32 values (reads kRead bytes from p).
template <int B>
struct Decode16 {
#if defined(__AVX512F__) && defined(__AVX512BW__)
  __m512i shuf, shifts;
  __m512 tlo, thi;
  explicit Decode16(const FpxFormat& f) {
    alignas(64) int8_t ctl[64];
    alignas(64) int32_t sh[16];
    for (int j = 0; j < 16; ++j) {
      const int bit = B * j;
      ctl[4 * j] = static_cast<int8_t>(bit >> 3);
      ctl[4 * j + 1] = static_cast<int8_t>((bit >> 3) + 1);
      ctl[4 * j + 2] = ctl[4 * j + 3] = static_cast<int8_t>(-128);
      sh[j] = bit & 7;
    }
    shuf = _mm512_load_si512(ctl);
    shifts = _mm512_load_si512(sh);
    tlo = _mm512_loadu_ps(reinterpret_cast<const float*>(f.tbits));
    thi = _mm512_loadu_ps(reinterpret_cast<const float*>(f.tbits + 16));
  }
  vfloat operator()(const uint8_t* p) const {
    const __m512i raw = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i v = _mm512_srlv_epi32(_mm512_shuffle_epi8(raw, shuf), shifts);
    const __m512 mag = _mm512_permutex2var_ps(tlo, v, thi);
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mag), _mm512_slli_epi32(v, 32 - B)));
  }
#else
  __m256i shuf, shifts;
  __m256 t[4];
  explicit Decode16(const FpxFormat& f) {
    alignas(32) int8_t ctl[32];
    alignas(32) int32_t sh[8];
    for (int j = 0; j < 8; ++j) {
      const int bit = B * j, at = 4 * (j % 4) + 16 * (j / 4);  // lane j's bytes, within its 128-bit half
      ctl[at] = static_cast<int8_t>(bit >> 3);
      ctl[at + 1] = static_cast<int8_t>((bit >> 3) + 1);
      ctl[at + 2] = ctl[at + 3] = static_cast<int8_t>(-128);
      sh[j] = bit & 7;
    }
    shuf = _mm256_load_si256(reinterpret_cast<const __m256i*>(ctl));
    shifts = _mm256_load_si256(reinterpret_cast<const __m256i*>(sh));
    for (int i = 0; i < 4; ++i) t[i] = _mm256_loadu_ps(reinterpret_cast<const float*>(f.tbits + 8 * i));
  }
  __m256 eight(const uint8_t* p) const {
    uint64_t u;
    std::memcpy(&u, p, 8);
    const __m256i v = _mm256_srlv_epi32(_mm256_shuffle_epi8(_mm256_set1_epi64x(static_cast<long long>(u)), shuf), shifts);
    __m256 mag = _mm256_permutevar8x32_ps(t[0], v);
    if constexpr (B >= 5) {  // 16 or 32 magnitudes: bit 3 (and 4) of the index pick the table
      const __m256 b3 = _mm256_castsi256_ps(_mm256_slli_epi32(v, 28));
      mag = _mm256_blendv_ps(mag, _mm256_permutevar8x32_ps(t[1], v), b3);
      if constexpr (B >= 6) {
        const __m256 hi = _mm256_blendv_ps(_mm256_permutevar8x32_ps(t[2], v), _mm256_permutevar8x32_ps(t[3], v), b3);
        mag = _mm256_blendv_ps(mag, hi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 27)));
      }
    }
    return _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(mag), _mm256_slli_epi32(v, 32 - B)));
  }
  vfloat operator()(const uint8_t* p) const { return {eight(p), eight(p + B)}; }
#endif
};

// Calls pair(s, p) for steps s, s + 1 (s even) and one(s, p) for single steps, p pointing to step
// s's bytes, over `steps` steps of one row; the last steps, whose kRead-byte loads would pass the
// row's end, read a zero-padded copy. (Pairs keep two accumulators in registers: indexing them by
// a step's parity at run time would put them in memory.)
template <int B, class Pair, class One>
inline void for_steps(const uint8_t* row, int64_t row_bytes, int64_t steps, const Pair& pair, const One& one) {
  constexpr int64_t bytes = 2 * B;
  const int64_t safe = std::min(steps, row_bytes >= kRead ? (row_bytes - kRead) / bytes + 1 : int64_t(0));
  int64_t s = 0;
  for (; s + 2 <= safe; s += 2) pair(s, row + s * bytes);
  if (s < steps) {
    alignas(64) uint8_t tail[128] = {0};  // < kRead + bytes left, read by at most 5 steps
    std::memcpy(tail, row + s * bytes, size_t(row_bytes - s * bytes));
    for (int64_t t = 0; s < steps; ++s, ++t) one(s, tail + t * bytes);
  }
}

// Activation rows per register tile (AVX-512 has 32 vector registers, AVX2 16, and a vfloat is two
// of them there). The tile does not change any output's value.
#if defined(__AVX512F__)
constexpr int kFpxTile = 4;
#else
constexpr int kFpxTile = 1;
#endif

// MB activation rows (xp, rows ldx floats apart, zero past K) against one weight row, decoded in
// registers; d[i] gets the float32 dot products (even steps and odd steps summed apart).
template <int B, int MB>
inline void row_dots(const Decode16<B>& dec, const uint8_t* row, int64_t row_bytes, int64_t steps, const float* xp,
                     int64_t ldx, float* d) {
  vfloat acc[MB][2];
  for (int i = 0; i < MB; ++i) acc[i][0] = acc[i][1] = vzero();
  for_steps<B>(
      row, row_bytes, steps,
      [&](int64_t s, const uint8_t* p) {
        const vfloat w0 = dec(p), w1 = dec(p + 2 * B);
        for (int i = 0; i < MB; ++i) {
          acc[i][0] = vfma(vload(xp + i * ldx + s * kStep), w0, acc[i][0]);
          acc[i][1] = vfma(vload(xp + i * ldx + (s + 1) * kStep), w1, acc[i][1]);
        }
      },
      [&](int64_t s, const uint8_t* p) {
        const vfloat w = dec(p);
        for (int i = 0; i < MB; ++i) {
          if (s & 1)
            acc[i][1] = vfma(vload(xp + i * ldx + s * kStep), w, acc[i][1]);
          else
            acc[i][0] = vfma(vload(xp + i * ldx + s * kStep), w, acc[i][0]);
        }
      });
  for (int i = 0; i < MB; ++i) d[i] = vsum(vadd(acc[i][0], acc[i][1]));
}

template <int B>
void fpx_gemv(const FpxWeight& w, const float* xp, int64_t M, int64_t steps, float* y) {
  const Decode16<B> dec(w.fmt);
  const int64_t ldx = steps * kStep;
  at::parallel_for(0, w.N, 8, [&](int64_t n0, int64_t n1) {
    float d[kFpxTile];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = w.q + n * w.row_bytes;
      const float s = scale_of(w.scale, w.dtype, n);
      for (int64_t m0 = 0; m0 < M; m0 += kFpxTile) {  // the row is decoded once per tile
        const int mb = static_cast<int>(std::min<int64_t>(kFpxTile, M - m0));
        const float* xm = xp + m0 * ldx;
        switch (mb) {
#if defined(__AVX512F__)
          case 4: row_dots<B, 4>(dec, row, w.row_bytes, steps, xm, ldx, d); break;
          case 3: row_dots<B, 3>(dec, row, w.row_bytes, steps, xm, ldx, d); break;
          case 2: row_dots<B, 2>(dec, row, w.row_bytes, steps, xm, ldx, d); break;
#endif
          default: row_dots<B, 1>(dec, row, w.row_bytes, steps, xm, ldx, d); break;
        }
        for (int i = 0; i < mb; ++i) y[(m0 + i) * w.N + n] = d[i] * s;
      }
    }
  });
}
#endif  // __AVX2__

// Rows [n0, n1) as float32 [n1 - n0, K]: value(code) * scale in float32, as the reference.
template <int B>
struct FpxRows {
  const FpxWeight& w;
  void operator()(int64_t n0, int64_t n1, float* buf) const {
    const int64_t K = w.K;
#if defined(__AVX2__)
    const Decode16<B> dec(w.fmt);
    const int64_t steps = (K + kStep - 1) / kStep;
    for (int64_t n = n0; n < n1; ++n) {
      const float s = scale_of(w.scale, w.dtype, n);
      float* o = buf + (n - n0) * K;
      const auto one = [&](int64_t st, const uint8_t* p) {
        const vfloat v = vscale(dec(p), s);
        if ((st + 1) * kStep <= K) {
          vstore(o + st * kStep, v);
        } else {
          float part[kStep];
          vstore(part, v);
          std::memcpy(o + st * kStep, part, sizeof(float) * size_t(K - st * kStep));
        }
      };
      for_steps<B>(
          w.q + n * w.row_bytes, w.row_bytes, steps,
          [&](int64_t st, const uint8_t* p) {  // both steps are whole: pairs end before a partial step
            vstore(o + st * kStep, vscale(dec(p), s));
            vstore(o + (st + 1) * kStep, vscale(dec(p + 2 * B), s));
          },
          one);
    }
#else
    for (int64_t n = n0; n < n1; ++n) {
      const float s = scale_of(w.scale, w.dtype, n);
      const uint8_t* row = w.q + n * w.row_bytes;
      for (int64_t k = 0; k < K; ++k) buf[(n - n0) * K + k] = w.fmt.values[code_of<B>(row, k)] * s;
    }
#endif
  }
};

template <class F>
void dispatch_fpx_bits(int bits, F f) {
  switch (bits) {
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    default: TORCH_CHECK(false, "bits: 3..6, got ", bits);
  }
}

FpxWeight check_weight(const torch::Tensor& qdata, const torch::Tensor& scale, int64_t ebits, int64_t mbits, int64_t k) {
  const FpxFormat fmt = make_format(ebits, mbits);
  TORCH_CHECK(k > 0, "k must be positive, got ", k);
  const int64_t row_bytes = (k * fmt.bits + 7) / 8;
  TORCH_CHECK(qdata.dtype() == torch::kUInt8 && qdata.dim() == 2 && qdata.size(1) == row_bytes && qdata.is_contiguous(),
              "qdata: contiguous uint8 [N, ", row_bytes, "], got ", qdata.dtype(), " ", qdata.sizes());
  const int64_t N = qdata.size(0);
  const auto st = scale.scalar_type();
  TORCH_CHECK(st == torch::kFloat32 || st == torch::kBFloat16 || st == torch::kFloat16,
              "scale: float32, bfloat16 or float16");
  TORCH_CHECK(scale.numel() == N && scale.is_contiguous(), "scale: contiguous, one value per row (", N, "), got ",
              scale.sizes());
  return FpxWeight{qdata.data_ptr<uint8_t>(), N, k, row_bytes, scale.data_ptr(), st, fmt};
}

}  // namespace

// F.linear(x, FPxTensor weight, bias): x float32 / bfloat16 / float16 [..., k]; qdata uint8 [N,
// ceil(k * b / 8)] (b = 1 + ebits + mbits, the canonical bit streams); scale [N] or [N, 1], one
// float dtype; bias optional [N]. Up to gemv_max_rows rows: the table-lookup GEMV; else the
// weight dequantized in float32 chunks and float32 GEMM. Computed in float32, bias added in
// float32, returned in x's dtype as [..., N].
torch::Tensor fpx_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, int64_t ebits, int64_t mbits,
                            int64_t k, c10::optional<torch::Tensor> bias, int64_t gemv_max_rows) {
  const FpxWeight w = check_weight(qdata, scale, ebits, mbits, k);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16 ||
                  x.scalar_type() == torch::kFloat16,
              "x: float32, bfloat16 or float16");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == w.N, "bias: expected ", w.N, " values, got ", bias->numel());
  auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0), N = w.N;
  auto y = torch::empty({M, N}, x2.options());
  if (M > 0) {
    bool done = false;
#if defined(__AVX2__)
    if (M <= gemv_max_rows) {
      const int64_t steps = (k + kStep - 1) / kStep;
      auto xp = torch::zeros({M, steps * kStep}, x2.options());
      xp.narrow(1, 0, k).copy_(x2);
      dispatch_fpx_bits(w.fmt.bits, [&](auto bc) {
        fpx_gemv<decltype(bc)::value>(w, xp.data_ptr<float>(), M, steps, y.data_ptr<float>());
      });
      done = true;
    }
#endif
    if (!done)
      dispatch_fpx_bits(w.fmt.bits, [&](auto bc) {
        dequant_gemm(x2, y, N, k, 1, /*transposed=*/false, FpxRows<decltype(bc)::value>{w});
      });
  }
  if (has_bias) y.add_(bias->reshape({N}).to(torch::kFloat32));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}

// The weight [N, k] in dtype (float32, bfloat16 or float16), bit for bit the reference's
// dequantize(dtype): value(code) * scale in float32, rounded once.
torch::Tensor fpx_dequantize(torch::Tensor qdata, torch::Tensor scale, int64_t ebits, int64_t mbits, int64_t k,
                             torch::ScalarType dtype) {
  const FpxWeight w = check_weight(qdata, scale, ebits, mbits, k);
  torch::Tensor out;
  dispatch_fpx_bits(w.fmt.bits, [&](auto bc) {
    const FpxRows<decltype(bc)::value> rows{w};
    if (dtype == torch::kFloat32) {
      out = torch::empty({w.N, k}, torch::TensorOptions().dtype(torch::kFloat32));
      float* o = out.data_ptr<float>();
      at::parallel_for(0, w.N, 16, [&](int64_t n0, int64_t n1) { rows(n0, n1, o + n0 * k); });
    } else {
      out = dequant_weight(w.N, k, k, 1, /*transposed=*/false, dtype, rows);
    }
  });
  return out;
}
