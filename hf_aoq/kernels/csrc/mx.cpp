// MXTensor (OCP MX: e2m1, e4m3 or e5m2 elements, one e8m0 scale per 32 along K) x float
// activations on CPU for few rows: F.linear(x, w, bias) in float32 on the exact weight, reading
// the MX bytes directly. Weight-only, or with the activations quantized in the same blocks first,
// exactly as the reference's simulate_input_quantization (mx_common.h), so both see the same values.
//
// e2m1 (MXFP4), in chunks of 128 elements (64 bytes, four blocks): the chunk's bytes load as 16
// 32-bit lanes, lane i holding elements 8i .. 8i + 7 (of block i / 4) in its eight nibbles, so
// `lane >> 4u` has element 8i + u's code in its low four bits for every lane at once; a 16-entry
// table of the e2m1 values (vpermps; AVX2's 8-entry one takes the sign as mx_common.h explains)
// gives the value. Per chunk and lane the eight products are added into a partial sum in the
// order u = 4, 0, 5, 1, 6, 2, 7, 3, the partial sum times its block's scale into the lane's total
// (one FMA): the products x * value are exact for bf16 activations, the scale is a power of two.
// (A vdpbf16ps variant for bf16 activations, 4 vpermw + 4 vdpbf16ps per chunk and row, measured
// slower here: 0.49 against 0.41 ms at batch 1, 2048x5632, one thread of the AVX-512 Xeon.)
// e4m3 / e5m2 (MXFP8), per block of 32: two 16-lane vectors decoded by a bit trick, each value
// times the block's scale (the reference's float32 weight), and acc = x1 * w1 + (x0 * w0 + acc).
// The activation rows are laid out once per call to match (zeros past K), and a last partial
// chunk or block of the weight is read from a zero-padded copy. Each output is its 16 lanes' sum
// in a fixed order (simd.h vsum); the AVX2 build computes the same lanes in two 8-lane halves with
// the same operations, so both builds give the same outputs. Tiles of kNR weight rows x up to kMB
// activation rows share each decoded weight vector and activation load; they change no value.
// Denormals are neither flushed nor treated as zero during the call.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>

#include "float_dtypes.h"
#include "hf_aoq_cpu.h"
#include "mx_common.h"

namespace {

// Tiles: weight rows x activation rows per register tile, per path (see the top of the file).
#if defined(__AVX512F__)
constexpr int kNR = 4, kMB = 2, kNR8 = 4, kMB8 = 4;
#else
constexpr int kNR = 1, kMB = 1, kNR8 = 2, kMB8 = 1;
#endif
constexpr int kMaxTile = 16;  // >= kNR * kMB and kNR8 * kMB8
constexpr int64_t kChunk = FP4_CHUNK;  // e2m1 elements per 64-byte chunk (four blocks)

#if defined(__AVX2__)
// e4m3 / e5m2, activations laid out in order, per block: acc = x1 * w1 + (x0 * w0 + acc).
template <int NR, int MB>
void fp8_tile(int64_t kind, const RowView* rows, int64_t B, int64_t full, const float* xp, int64_t ldx, float* out) {
  vfloat acc[MB][NR];
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NR; ++r) acc[i][r] = vzero();
  const int shift = kind == MX_E4M3 ? 20 : 21;
#if defined(__AVX512F__)
  const __m512 factor = _mm512_set1_ps(kind == MX_E4M3 ? 0x1p120f : 0x1p112f);
#else
  const __m256 factor = _mm256_set1_ps(kind == MX_E4M3 ? 0x1p120f : 0x1p112f);
#endif
  for (int64_t g = 0; g < B; ++g) {
    vfloat w0[NR], w1[NR];
    for (int r = 0; r < NR; ++r) {
      const uint8_t* p = g < full ? rows[r].row + g * MX_BLOCK : rows[r].tail;
#if defined(__AVX512F__)
      const __m512 sv = _mm512_set1_ps(rows[r].sf[g]);
#else
      const __m256 sv = _mm256_set1_ps(rows[r].sf[g]);
#endif
      w0[r] = fp8_decode16(p, shift, factor, sv);
      w1[r] = fp8_decode16(p + 16, shift, factor, sv);
    }
    for (int i = 0; i < MB; ++i) {
      const vfloat x0 = vload(xp + i * ldx + g * MX_BLOCK), x1 = vload(xp + i * ldx + g * MX_BLOCK + 16);
      for (int r = 0; r < NR; ++r) acc[i][r] = vfma(x1, w1[r], vfma(x0, w0[r], acc[i][r]));
    }
  }
  for (int i = 0; i < MB; ++i)
    for (int r = 0; r < NR; ++r) out[i * NR + r] = vsum(acc[i][r]);
}
#endif

// The activation rows laid out for the kernels, zero past K: x float32 [M, K]; xp [M, ld].
// e2m1: per chunk of 128, xp[128c + 16u + i] = x[128c + 8i + u]; float8: in order.
void layout_rows(const float* x, float* xp, int64_t M, int64_t K, int64_t ld, int64_t kind) {
  if (kind == MX_E2M1) return fp4_layout_rows(x, xp, M, K, ld);
  for (int64_t m = 0; m < M; ++m) {
    std::memcpy(xp + m * ld, x + m * K, size_t(K) * sizeof(float));
    std::fill(xp + m * ld + K, xp + (m + 1) * ld, 0.f);
  }
}

// y [M, N] = x W^T for activations xp laid out by layout_rows, rows ld floats apart.
void mx_gemv(const float* xp, int64_t ld, int64_t M, const uint8_t* q, const uint8_t* sc, float* y,
             int64_t N, int64_t K, int64_t kind) {
  const int64_t B = (K + MX_BLOCK - 1) / MX_BLOCK;
  const bool fp4 = kind == MX_E2M1;
  const int64_t row_bytes = fp4 ? K / 2 : K, unit = fp4 ? 64 : MX_BLOCK;  // bytes of a chunk / block
  const int64_t units = fp4 ? (K + kChunk - 1) / kChunk : B, full = row_bytes / unit;
#if defined(__AVX2__)
  const int NR = fp4 ? kNR : kNR8, MBmax = fp4 ? kMB : kMB8;
#else
  const int NR = 1, MBmax = 1;
#endif
  const int64_t groups = (N + NR - 1) / NR;
  at::parallel_for(0, groups, 16, [&](int64_t g0, int64_t g1) {
    MxDenormalsKept keep;
    const int64_t per_row = fp4 ? units * 4 : B;
    std::vector<float> sf(NR * per_row);
    alignas(64) uint8_t tail[4][64];
    float out[kMaxTile];
    for (int64_t grp = g0; grp < g1; ++grp) {
      const int64_t n0 = grp * NR;
      const int nr = static_cast<int>(std::min<int64_t>(NR, N - n0));
      RowView rows[4];
      for (int r = 0; r < NR; ++r) {
        const int64_t n = std::min(n0 + r, N - 1);  // rows past N repeat the last, not stored
        const uint8_t* row = q + n * row_bytes;
        float* f = sf.data() + r * per_row;
        const uint8_t* scn = sc + n * B;
        for (int64_t g = 0; g < B; ++g) f[g] = e8m0_value(scn[g]);
        for (int64_t g = B; g < per_row; ++g) f[g] = 0.f;  // e2m1: blocks past the row's end
        std::memset(tail[r], 0, sizeof(tail[r]));
        if (full < units) std::memcpy(tail[r], row + full * unit, size_t(row_bytes - full * unit));
        rows[r] = {row, tail[r], f};
      }
      for (int64_t m0 = 0; m0 < M; m0 += MBmax) {
        const int mb = static_cast<int>(std::min<int64_t>(MBmax, M - m0));
#if defined(__AVX2__)
        if (fp4) {
#if defined(__AVX512F__)
          if (mb == 2) fp4_tile<kNR, 2, 4>(rows, units, full, xp + m0 * ld, ld, out);
          else
#endif
            fp4_tile<kNR, 1, 4>(rows, units, full, xp + m0 * ld, ld, out);
        } else {
          switch (mb) {
#if defined(__AVX512F__)
            case 4: fp8_tile<kNR8, 4>(kind, rows, B, full, xp + m0 * ld, ld, out); break;
            case 3: fp8_tile<kNR8, 3>(kind, rows, B, full, xp + m0 * ld, ld, out); break;
            case 2: fp8_tile<kNR8, 2>(kind, rows, B, full, xp + m0 * ld, ld, out); break;
#endif
            default: fp8_tile<kNR8, 1>(kind, rows, B, full, xp + m0 * ld, ld, out); break;
          }
        }
#else
        {  // plain C++: the row in order against the decoded weight (xp holds x in order here)
          float a = 0.f;
          for (int64_t k = 0; k < K; ++k) a += xp[m0 * ld + k] * (mx_elem_value(rows[0].row, kind, k) * e8m0_value(sc[(n0) * B + k / MX_BLOCK]));
          out[0] = a;
        }
#endif
        for (int i = 0; i < mb; ++i)
          for (int r = 0; r < nr; ++r) y[(m0 + i) * N + n0 + r] = out[i * NR + r];
      }
    }
  });
}

}  // namespace

// F.linear(x, MX weight, bias): x float32 / bfloat16 / float16 [..., k]; qdata [N, k/2] uint8
// (e2m1, kind 0) or [N, k] float8 (kind 1 e4m3fn, 2 e5m2); scale uint8 [N, ceil(k/32)] (e8m0).
// act_kind -1: weight-only; 0-2: the activations are quantized to that element kind in blocks of
// 32 and decoded in x's dtype first (the reference's simulate_input_quantization, bit for bit).
// Computed in float32, bias (any float dtype, [N]) added in float32, returned in x's dtype as
// [..., N]. Meant for few rows: the weight is decoded once per kMB activation rows.
torch::Tensor mx_linear_io(torch::Tensor x, torch::Tensor qdata, torch::Tensor scale, int64_t kind, int64_t k,
                           c10::optional<torch::Tensor> bias, int64_t act_kind) {
  const int64_t N = mx_check_weight(qdata, scale, kind, k);
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == k, "x: expected [..., ", k, "], got ", x.sizes());
  TORCH_CHECK(act_kind == -1 || (act_kind >= 0 && act_kind <= 2), "act_kind: -1 (none) or 0-2, got ", act_kind);
  TORCH_CHECK(act_kind != MX_E2M1 || k % 2 == 0, "e2m1 activations need an even k");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) TORCH_CHECK(bias->numel() == N, "bias: expected ", N, " values, got ", bias->numel());
  const auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  const int64_t M = x2.size(0), B = (k + MX_BLOCK - 1) / MX_BLOCK;
  const float* xs = x2.data_ptr<float>();
  torch::Tensor fake;
  if (act_kind >= 0) {
    fake = torch::empty({M, k}, x2.options());
    const MxElem e = mx_elem(act_kind);
    float* fp = fake.data_ptr<float>();
    dispatch_float(x.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      MxDenormalsKept keep;
      for (int64_t m = 0; m < M; ++m) mx_fake_quantize_row<T>(xs + m * k, k, e, fp + m * k);
    });
    xs = fp;
  }
  const int64_t ld = kind == MX_E2M1 ? (k + kChunk - 1) / kChunk * kChunk : B * MX_BLOCK;
  const auto q = qdata.contiguous();
  const auto s = scale.contiguous();
  auto y = torch::empty({M, N}, x2.options());
  auto xp = torch::empty({M, ld}, x2.options());
#if defined(__AVX2__)
  layout_rows(xs, xp.data_ptr<float>(), M, k, ld, kind);
#else
  layout_rows(xs, xp.data_ptr<float>(), M, k, ld, MX_E4M3);  // the plain loop reads x in order
#endif
  mx_gemv(xp.data_ptr<float>(), ld, M,
          reinterpret_cast<const uint8_t*>(q.data_ptr()), s.data_ptr<uint8_t>(), y.data_ptr<float>(), N, k, kind);
  if (has_bias) y.add_(bias->reshape({N}).to(torch::kFloat32));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.to(x.scalar_type()).view(sizes);
}
