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
#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "amx_gemm.h"
#include "hf_aoq_cpu.h"
#include "int4_pairs.h"
#include "int4dq_rows.h"

namespace {

// dlo, dstep, clo, cstep of N rows from rparams [N, 4] into four arrays. Each row's values come
// from the scalar formulas above, float32 operation by operation in the same order; the vector
// steps (16 rows on AVX-512, 8 on AVX2) apply those operations lane by lane, with the table
// lookups as permutes or gathers, so every build decodes every code to the same bits. On the
// Xeon the scalar loop and the table's copies took 7-11 ns a row, 3.7 ms of a compiled 22-layer
// TinyLlama decode token (which decodes inside the op on every call); now 1.2-1.5 ns.
// The grid's constant tables, made once: LUT[j] and 2^-e for e = 0..7 (multiplying by it is exact,
// as ldexp is, and much cheaper per row), padded to 16 for the vector permute.
struct RowGridTables {
  alignas(64) float lut[32];
  alignas(64) float pow2[16] = {};
  RowGridTables() {
    for (int j = 0; j < 32; ++j) lut[j] = static_cast<float>(std::exp2(-j / 32.0));
    for (int e = 0; e < 8; ++e) pow2[e] = std::ldexp(1.f, -e);
  }
};

void int4dq_decode_planar(const uint8_t* rp, float td, float tc, int64_t N, float* __restrict dlo,
                          float* __restrict dstep, float* __restrict clo, float* __restrict cstep) {
  static const RowGridTables tables;
  const float* lut = tables.lut;
  const float* pow2 = tables.pow2;
  int64_t n = 0;
#if defined(__AVX512F__)
  {
    const __m512 lut_lo = _mm512_load_ps(lut), lut_hi = _mm512_load_ps(lut + 16), p2 = _mm512_load_ps(pow2);
    const __m512 tdv = _mm512_set1_ps(td), tcv = _mm512_set1_ps(tc), fifteen = _mm512_set1_ps(15.f);
    const __m512i ff = _mm512_set1_epi32(255), m127 = _mm512_set1_epi32(127), b7 = _mm512_set1_epi32(128),
                  sign = _mm512_set1_epi32(static_cast<int32_t>(0x80000000u));
    // permutex2var reads an index's low 5 bits (k & 31), permutexvar its low 4 (k >> 5 < 8).
    auto dval = [&](__m512i k) {
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(tdv, _mm512_permutex2var_ps(lut_lo, k, lut_hi)),
                                     _mm512_permutexvar_ps(_mm512_srli_epi32(k, 5), p2));
      return _mm512_maskz_mov_ps(_mm512_cmpneq_epi32_mask(k, ff), v);
    };
    auto cval = [&](__m512i k) {
      const __m512i m = _mm512_and_si512(k, m127);  // 2m's low 5 bits: 2 * (m & 15)
      const __m512 v = _mm512_mul_ps(_mm512_mul_ps(tcv, _mm512_permutex2var_ps(lut_lo, _mm512_slli_epi32(m, 1), lut_hi)),
                                     _mm512_permutexvar_ps(_mm512_srli_epi32(m, 4), p2));
      const __mmask16 live = _mm512_cmpneq_epi32_mask(m, m127);
      const __m512i z = _mm512_castps_si512(_mm512_maskz_mov_ps(live, v));
      const __mmask16 neg = _mm512_mask_cmpeq_epi32_mask(live, _mm512_and_si512(k, b7), b7);
      return _mm512_castsi512_ps(_mm512_mask_xor_epi32(z, neg, z, sign));
    };
    for (; n + 16 <= N; n += 16) {
      const __m512i v = _mm512_loadu_si512(rp + 4 * n);  // row n + i in lane i: kd_lo, kd_hi, kc_lo, kc_hi bytes
      const __m512 d0 = dval(_mm512_and_si512(v, ff)), d1 = dval(_mm512_and_si512(_mm512_srli_epi32(v, 8), ff));
      const __m512 c0 = cval(_mm512_and_si512(_mm512_srli_epi32(v, 16), ff)), c1 = cval(_mm512_srli_epi32(v, 24));
      _mm512_storeu_ps(dlo + n, d0);
      _mm512_storeu_ps(dstep + n, _mm512_div_ps(_mm512_sub_ps(d1, d0), fifteen));
      _mm512_storeu_ps(clo + n, c0);
      _mm512_storeu_ps(cstep + n, _mm512_div_ps(_mm512_sub_ps(c1, c0), fifteen));
    }
  }
#elif defined(__AVX2__)
  {
    const __m256 p2 = _mm256_load_ps(pow2), tdv = _mm256_set1_ps(td), tcv = _mm256_set1_ps(tc),
                 fifteen = _mm256_set1_ps(15.f);
    const __m256i ff = _mm256_set1_epi32(255), m127 = _mm256_set1_epi32(127), b7 = _mm256_set1_epi32(128),
                  sign = _mm256_set1_epi32(static_cast<int32_t>(0x80000000u));
    auto dval = [&](__m256i k) {
      const __m256 l = _mm256_i32gather_ps(lut, _mm256_and_si256(k, _mm256_set1_epi32(31)), 4);
      const __m256 v = _mm256_mul_ps(_mm256_mul_ps(tdv, l), _mm256_permutevar8x32_ps(p2, _mm256_srli_epi32(k, 5)));
      return _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(k, ff)), v);
    };
    auto cval = [&](__m256i k) {
      const __m256i m = _mm256_and_si256(k, m127);
      const __m256 l = _mm256_i32gather_ps(lut, _mm256_and_si256(_mm256_slli_epi32(m, 1), _mm256_set1_epi32(30)), 4);
      const __m256 v = _mm256_mul_ps(_mm256_mul_ps(tcv, l), _mm256_permutevar8x32_ps(p2, _mm256_srli_epi32(m, 4)));
      const __m256i dead = _mm256_cmpeq_epi32(m, m127);
      const __m256i neg = _mm256_andnot_si256(dead, _mm256_cmpeq_epi32(_mm256_and_si256(k, b7), b7));
      return _mm256_xor_ps(_mm256_andnot_ps(_mm256_castsi256_ps(dead), v), _mm256_castsi256_ps(_mm256_and_si256(neg, sign)));
    };
    for (; n + 8 <= N; n += 8) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rp + 4 * n));
      const __m256 d0 = dval(_mm256_and_si256(v, ff)), d1 = dval(_mm256_and_si256(_mm256_srli_epi32(v, 8), ff));
      const __m256 c0 = cval(_mm256_and_si256(_mm256_srli_epi32(v, 16), ff)), c1 = cval(_mm256_srli_epi32(v, 24));
      _mm256_storeu_ps(dlo + n, d0);
      _mm256_storeu_ps(dstep + n, _mm256_div_ps(_mm256_sub_ps(d1, d0), fifteen));
      _mm256_storeu_ps(clo + n, c0);
      _mm256_storeu_ps(cstep + n, _mm256_div_ps(_mm256_sub_ps(c1, c0), fifteen));
    }
  }
#endif
  auto dval = [&](int k) -> float { return k == 255 ? 0.f : (td * lut[k & 31]) * pow2[k >> 5]; };
  auto cval = [&](int k) -> float {
    const int m = k & 127;
    if (m == 127) return 0.f;
    const float v = (tc * lut[2 * (m & 15)]) * pow2[m >> 4];
    return (k >> 7) ? -v : v;
  };
  for (; n < N; ++n) {
    const uint8_t* r = rp + n * 4;
    const float d0 = dval(r[0]), d1 = dval(r[1]), c0 = cval(r[2]), c1 = cval(r[3]);
    dlo[n] = d0;
    dstep[n] = (d1 - d0) / 15.f;
    clo[n] = c0;
    cstep[n] = (c1 - c0) / 15.f;
  }
}

// rparams (uint8 [N, 4]) and tparams (float32 [2]) checked and made contiguous: the decode's inputs.
struct RowFields {
  torch::Tensor rp, tp;
};
RowFields row_fields(const torch::Tensor& rparams, const torch::Tensor& tparams) {
  TORCH_CHECK(rparams.dtype() == torch::kUInt8 && rparams.dim() == 2 && rparams.size(1) == 4,
              "rparams: uint8 [N, 4]");
  TORCH_CHECK(tparams.dtype() == torch::kFloat32 && tparams.numel() == 2, "tparams: float32 [2]");
  return {rparams.contiguous(), tparams.contiguous()};
}

// The int4 kernels' parameter provider for Int4DQTensor: d and c of rows [n0, n0 + rows) in
// group g from the CPU packing's group bytes (gp, below) and the decoded rows, held as four
// arrays (dlo, dstep, clo, cstep) so that the loop over rows vectorizes.
//
// gp: the group bytes in chunks of 64 rows, each chunk's [G, rows] contiguous (the last chunk
// holds the N % 64 rows left, if any), so that a 64-row step of the GEMV reads its groups' bytes
// as one stream. With the affine epilogue below, the batch-1 GEMV from DRAM took 6-7% less time
// on the Xeon than with the bytes as [G, N] (a page or more between one group's bytes and the
// next's at N >= 4096); neither change alone moved it (docs/performance.md).
//
// kAffine: d and c are affine in the group's 4-bit indices a and b, so the integer GEMV
// (int4_pairs.h) sums sx * acc - offset * xs, its product with a, and b * xs over the groups
// and applies each row's dlo, dstep, clo and cstep once at the end, instead of making d and c
// per group (int4_affine_* there).
struct DQParams {
  static constexpr float offset = 7.5f;
  static constexpr bool kAffine = true;
  const uint8_t* gp;
  const float* dlo;
  const float* dstep;
  const float* clo;
  const float* cstep;
  int64_t N;
  // dlo, dstep, clo, cstep again (4 arrays N apart), rows [64c, 64c + 64) in int4_pairs512.h's
  // 64-row lane order; for int4_affine_store64.
  const float* rows64;
  int64_t G;
  // Group g's bytes of rows n0.. (the rows inside one 64-row chunk).
  const uint8_t* bytes(int64_t g, int64_t n0) const {
    const int64_t c0 = n0 / 64 * 64;
    return gp + c0 * G + g * std::min<int64_t>(64, N - c0) + (n0 - c0);
  }
  void operator()(int64_t g, int64_t n0, int64_t rows, float* __restrict d, float* __restrict c) const {
    const uint8_t* __restrict p = bytes(g, n0);
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
  // The indices a and b of rows [n0, n0 + rows) in group g, as float32.
  void indices(int64_t g, int64_t n0, int64_t rows, float* __restrict a, float* __restrict b) const {
    const uint8_t* __restrict p = bytes(g, n0);
#if defined(__AVX2__)
    if (rows == BLOCK_N) {
      for (int j = 0; j < 4; ++j) {
        const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * j)));
        _mm256_storeu_ps(a + 8 * j, _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15))));
        _mm256_storeu_ps(b + 8 * j, _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)));
      }
      return;
    }
#endif
    for (int64_t r = 0; r < rows; ++r) {
      a[r] = static_cast<float>(p[r] & 15);
      b[r] = static_cast<float>(p[r] >> 4);
    }
  }
  // Brings group g's bytes of rows n0..n0+63 towards the core (int4_prefetch_params).
  void prefetch64(int64_t g, int64_t n0) const { int4_prefetch(bytes(g, n0)); }
#if HF_AOQ_INT4_512
  // a and b of rows n0..n0+63 (a whole chunk) in the 64-row lane order: each byte's nibble
  // picks its value from the lanes of 0..15 (vpermps reads an index's low 4 bits).
  void indices64(int64_t g, int64_t n0, __m512* a, __m512* b) const {
    const uint8_t* p = bytes(g, n0);
    const __m512 values = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int t = 0; t < 4; ++t) {
      const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * t)),
                                               _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32 + 8 * t)));
      const __m512i v = _mm512_cvtepu8_epi32(bytes);
      a[t] = _mm512_permutexvar_ps(v, values);
      b[t] = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), values);
    }
  }
#endif
};

}  // namespace

// See int4dq_rows.h.
torch::Tensor int4dq_decode(const torch::Tensor& rparams, const torch::Tensor& tparams) {
  const RowFields in = row_fields(rparams, tparams);
  const int64_t N = in.rp.size(0);
  auto out = torch::empty({N, 4}, in.tp.options());
  const float* t = in.tp.data_ptr<float>();
  const uint8_t* r = in.rp.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  constexpr int64_t kChunk = 256;  // decoded planar on the stack, then interleaved by row
  float f[4][kChunk];
  for (int64_t n0 = 0; n0 < N; n0 += kChunk) {
    const int64_t rows = std::min(kChunk, N - n0);
    int4dq_decode_planar(r + 4 * n0, t[0], t[1], rows, f[0], f[1], f[2], f[3]);
    for (int64_t i = 0; i < rows; ++i)
      for (int j = 0; j < 4; ++j) o[(n0 + i) * 4 + j] = f[j][i];
  }
  return out;
}

namespace {

// The decoded row parameters the kernels read, float32 [8, N]: dlo, dstep, clo, cstep by row, then
// the same in the 64-row lane order (rows past the last whole 64 in order).
torch::Tensor dq_row_table(const torch::Tensor& rparams, const torch::Tensor& tparams) {
  const RowFields in = row_fields(rparams, tparams);
  const int64_t N = in.rp.size(0);
  auto rows = torch::empty({8, N}, in.tp.options());
  float* o = rows.data_ptr<float>();
  const float* t = in.tp.data_ptr<float>();
  int4dq_decode_planar(in.rp.data_ptr<uint8_t>(), t[0], t[1], N, o, o + N, o + 2 * N, o + 3 * N);
  // The lane-order copy: rows 8u..8u+7 of a 64-row step stay together (int4_lane64).
  const int64_t n64 = N / 64 * 64;
  for (int f = 0; f < 4; ++f) {
    const float* src = o + f * N;
    float* dst = o + (4 + f) * N;
    for (int64_t n = 0; n < n64; n += 8) std::memcpy(dst + n / 64 * 64 + int4_lane64(n % 64), src + n, 8 * sizeof(float));
    std::memcpy(dst + n64, src + n64, (N - n64) * sizeof(float));
  }
  return rows;
}

// The checked parameter provider of a packed Int4DQ weight (Kp = packed's columns times two);
// `rows` keeps the decoded row parameters it points into alive. tparams: float32 [2] (T_d, T_c:
// the table is decoded here, per call: 1.2-1.5 ns a row on the Xeon's AVX-512, 2.7 on AVX2, 6.5
// to 15 us a call at N = 5632), or the CPU packing's [2 + 8N], T_d and T_c followed by the table
// (dq_row_table) made once when the weight was packed (kernels/cpu.py `pack_int4dq_for_cpu`):
// so that eager calls and a compiled graph, which reads the weight's fields as they are, both
// skip the decode.
DQParams dq_params(const torch::Tensor& packed, const torch::Tensor& gparams, const torch::Tensor& rparams,
                   const torch::Tensor& tparams, int64_t group_size, torch::Tensor& rows) {
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.dim() == 2 && packed.is_contiguous(),
              "packed: contiguous uint8 [N, Kp/2]");
  TORCH_CHECK(N % 16 == 0, "N must be a multiple of 16");
  TORCH_CHECK(group_size > 0 && group_size % 2 == 0 && K % group_size == 0, "Kp must be a multiple of an even group_size");
  TORCH_CHECK(gparams.dtype() == torch::kUInt8 && gparams.dim() == 1 && gparams.numel() == K / group_size * N &&
                  gparams.is_contiguous(),
              "gparams: contiguous uint8 [Kp/group_size * N] in 64-row chunks (DQParams)");
  TORCH_CHECK(rparams.dim() == 2 && rparams.size(0) == N, "rparams: uint8 [N, 4]");
  if (tparams.numel() == 2 + 8 * N) {
    TORCH_CHECK(tparams.dtype() == torch::kFloat32 && tparams.dim() == 1 && tparams.is_contiguous(),
                "tparams: contiguous float32 [2] or [2 + 8N] (T_d, T_c and the CPU packing's row table)");
    rows = tparams.narrow(0, 2, 8 * N);
  } else {
    rows = dq_row_table(rparams, tparams);  // checks rparams and tparams
  }
  const float* rp = rows.data_ptr<float>();
  return DQParams{gparams.data_ptr<uint8_t>(), rp, rp + N, rp + 2 * N, rp + 3 * N, N, rp + 4 * N, K / group_size};
}

}  // namespace

// x: float32 [M, Kp] contiguous (Kp: K padded to whole groups, zero input columns past K);
// packed: uint8 [N, Kp/2] in the pairs layout (int4_repack_pairs of the canonical codes);
// gparams: uint8 [Kp/group_size * N], the canonical gparams in 64-row chunks (DQParams); rparams:
// uint8 [N, 4]; tparams: float32 [2], or [2 + 8N] with the row table (dq_params). Returns
// float32 [M, N]: through int16 activation codes when int16_activations, else the float32 GEMV
// at up to gemv_max_rows rows and above them chunks dequantized exactly as the format defines
// and float32 GEMM.
torch::Tensor int4dq_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams, torch::Tensor rparams,
                            torch::Tensor tparams, int64_t group_size, int64_t gemv_max_rows, bool int16_activations) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x: contiguous float32 [M, Kp]");
  const int64_t M = x.size(0), K = x.size(1), N = packed.size(0);
  TORCH_CHECK(packed.numel() * 2 == N * K, "packed: [N, Kp/2] for x's Kp");
  torch::Tensor rows;
  const DQParams params = dq_params(packed, gparams, rparams, tparams, group_size, rows);
  auto y = torch::empty({M, N}, x.options());
  int4_linear(x, packed.data_ptr<uint8_t>(), params, y, N, group_size, gemv_max_rows, int16_activations);
  return y;
}

// The row table the kernels read (float32 [8, N], see dq_row_table): the CPU packing appends it
// to tparams (dq_params).
torch::Tensor int4dq_cpu_rows(torch::Tensor rparams, torch::Tensor tparams) { return dq_row_table(rparams, tparams); }

// The weight [N, k] in dtype (bfloat16 or float16), bit for bit the reference's dequantize(dtype):
// for aten's GEMM in that dtype at many rows. Arguments as for int4dq_linear; k <= Kp.
torch::Tensor int4dq_dequantize(torch::Tensor packed, torch::Tensor gparams, torch::Tensor rparams,
                                torch::Tensor tparams, int64_t group_size, int64_t k, torch::ScalarType dtype) {
  torch::Tensor rows;
  const DQParams params = dq_params(packed, gparams, rparams, tparams, group_size, rows);
  return int4_dequant_weight(packed.data_ptr<uint8_t>(), params, packed.size(0), packed.size(1) * 2, group_size, k, dtype);
}

// x: bfloat16 [M, k], k <= Kp; the weight's arguments as for int4dq_linear, N a multiple of 32,
// Kp of 32. F.linear in bf16 on AMX tiles (tiles) or AVX512-BF16's dot products (amx_gemm.h): the
// weight's bf16 values are the reference's dequantize(bfloat16), bit for bit. Returns bfloat16 [M, N].
torch::Tensor int4dq_amx_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor gparams, torch::Tensor rparams,
                                torch::Tensor tparams, int64_t group_size, c10::optional<torch::Tensor> bias, bool tiles) {
  check_panel_gemm_usable(tiles);
  torch::Tensor rows;
  const DQParams params = dq_params(packed, gparams, rparams, tparams, group_size, rows);
  const int64_t N = packed.size(0), K = packed.size(1) * 2;
  TORCH_CHECK(N % 32 == 0 && K % 32 == 0, "the panel GEMM takes N and Kp multiples of 32, got ", N, " x ", K);
  const torch::Tensor xa = amx_input(x, K), b = amx_bias(bias, N);
  auto y = torch::empty({xa.size(0), N}, xa.options());
#if HF_AOQ_AMX
  amx_linear_bf16(reinterpret_cast<const uint16_t*>(xa.data_ptr()), K, xa.size(0), N, K, std::lcm<int64_t>(32, group_size),
                  b.defined() ? b.data_ptr<float>() : nullptr, reinterpret_cast<uint16_t*>(y.data_ptr()),
                  Int4PairsPanel<DQParams>{packed.data_ptr<uint8_t>(), params, K, group_size}, tiles);
#endif
  return y;
}
