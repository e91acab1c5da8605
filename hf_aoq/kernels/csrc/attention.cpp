// Attention of one query token per head over a KV cache: the decode step's attention on CPU.
//
// aten's scaled_dot_product_attention spends 0.2 ms on one bf16 decode token of one layer at 56
// cached positions, 0.8 ms at 300 and 2 ms at 1,024 (32 query heads, 4 KV heads, head size 64;
// 2 threads, AMD EPYC Zen 4), for work that reads 0.3 MB at 300 positions: over 22 layers, more
// than an int4 model's weights take to read. Here each (batch, KV head) reads its keys and values
// once for all the query heads that share them (grouped-query attention without repeating K/V):
// scores in float32, a float32 softmax, the values summed in float32, one rounding to the output's
// dtype at the end.
//
// The sums are in simd.h's lane order (16 float32 lanes, AVX2 or AVX-512), so both vector builds
// give the same bits; the generic build sums in column order.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hf_aoq_cpu.h"
#include "simd.h"

namespace {

// Element access for the two dtypes the kernel reads: float32, and bf16 as raw uint16.
inline float widen1(float v) { return v; }
inline float widen1(uint16_t v) { return bf16_to_float(v); }
inline void narrow1(float v, float* out) { *out = v; }
inline void narrow1(float v, uint16_t* out) {
  const c10::BFloat16 b(v);  // round to nearest even, as aten's casts
  *out = b.x;
}
#if defined(__AVX2__)
inline vfloat widen(const float* p) { return vload(p); }
inline vfloat widen(const uint16_t* p) { return bf16_lanes(p); }
#endif

struct Strides {
  int64_t b, h, l;  // in elements; the last dimension is contiguous
};

template <typename T>
struct Problem {
  const T *q, *k, *v;
  Strides qs, ks, vs;  // q: [B, H, 1, D] (l unused); k: [B, Hk, L, D]; v: [B, Hk, L, Dv]
  const bool* mask_bool;  // [B, H, 1, L] by ms (broadcast dimensions: stride 0), or null
  const float* mask_add;  // the same, an additive float32 mask, or null
  Strides ms;
  T* out;  // [B, 1, H, Dv] contiguous
  int64_t H, Hk, L, D, Dv;
  float scale;
};

#if defined(__AVX2__)
// exp of 16 float32 lanes, each <= 0 or -inf (a score less the row's maximum): 2^n exp(r) with
// n = round(x log2 e), r = x - n ln 2 in two parts, exp(r) by a degree-7 polynomial (Cephes's
// expf coefficients; within 2 ulp of expf); below ln(FLT_MIN), 0. The same operations in both
// vector builds, so the same bits.
inline vfloat vexp_nonpositive(vfloat x) {
#if defined(__AVX512F__)
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.33654f), _CMP_LT_OQ);
  x = _mm512_max_ps(_mm512_set1_ps(-87.33654f), x);  // a NaN stays NaN (the second operand)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  auto half = [](__m256 h, __m256& nn, __m256& tt) {
    tt = _mm256_cmp_ps(h, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
    h = _mm256_max_ps(_mm256_set1_ps(-87.33654f), h);  // a NaN stays NaN
    nn = _mm256_round_ps(_mm256_mul_ps(h, _mm256_set1_ps(1.44269504088896341f)),
                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return h;
  };
  vfloat n, tiny;
  x.lo = half(x.lo, n.lo, tiny.lo);
  x.hi = half(x.hi, n.hi, tiny.hi);
#endif
  vfloat r = vfma(n, vbroadcast(-0.693359375f), x);
  r = vfma(n, vbroadcast(2.12194440e-4f), r);
  vfloat p = vbroadcast(1.9875691500e-4f);
  p = vfma(p, r, vbroadcast(1.3981999507e-3f));
  p = vfma(p, r, vbroadcast(8.3334519073e-3f));
  p = vfma(p, r, vbroadcast(4.1665795894e-2f));
  p = vfma(p, r, vbroadcast(1.6666665459e-1f));
  p = vfma(p, r, vbroadcast(5.0000001201e-1f));
  p = vadd(vfma(p, vmul(r, r), r), vbroadcast(1.f));
#if defined(__AVX512F__)
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~tiny), p, _mm512_castsi512_ps(e));
#else
  auto scale = [](__m256 ph, __m256 nh, __m256 th) {
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nh), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(th, _mm256_mul_ps(ph, _mm256_castsi256_ps(e)));
  };
  return {scale(p.lo, n.lo, tiny.lo), scale(p.hi, n.hi, tiny.hi)};
#endif
}
#endif

#if defined(__AVX2__)
// vsum of a[0], .., a[3] at once: per vector the same additions in the same order as vsum (the
// upper eight lanes onto the lower, the upper four onto the lower, two pairwise rounds), so the
// same bits, with the last rounds shared by the four.
inline void vsum4(const vfloat* a, float* out) {
  __m128 u[4];
  for (int r = 0; r < 4; ++r) {
#if defined(__AVX512F__)
    const __m256 t = _mm256_add_ps(_mm512_castps512_ps256(a[r]), _mm512_extractf32x8_ps(a[r], 1));
#else
    const __m256 t = _mm256_add_ps(a[r].lo, a[r].hi);
#endif
    u[r] = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
  }
  _mm_storeu_ps(out, _mm_hadd_ps(_mm_hadd_ps(u[0], u[1]), _mm_hadd_ps(u[2], u[3])));
}
#endif

// s[0..n) = exp(s - m) (m finite, s <= m or -inf); returns their float32 sum, added in lane order.
inline float exp_shifted(float* s, int64_t n, float m) {
#if defined(__AVX2__)
  vfloat acc = vzero();
  const vfloat vm = vbroadcast(m);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const vfloat e = vexp_nonpositive(vsub(vload(s + j), vm));
    vstore(s + j, e);
    acc = vadd(acc, e);
  }
  if (j < n) {  // the tail through the same lanes, padded with -inf (exp: 0)
    alignas(64) float t[kLanes];
    for (int i = 0; i < kLanes; ++i) t[i] = j + i < n ? s[j + i] : -std::numeric_limits<float>::infinity();
    const vfloat e = vexp_nonpositive(vsub(vload(t), vm));
    vstore(t, e);
    acc = vadd(acc, e);
    for (int64_t i = 0; j + i < n; ++i) s[j + i] = t[i];
  }
  return vsum(acc);
#else
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - m));
  return sum;
#endif
}

// Query heads h0 .. h0 + R - 1 (R <= kMaxR) of batch b, which all read KV head g. R is a constant
// of the instance, so that the R sums stay in registers (with a run-time count the kernel took
// 1.7x the time at 1,024 positions, Zen 4).
constexpr int64_t kMaxR = 4;

template <typename T, int R>
void attend(const Problem<T>& p, int64_t b, int64_t g, int64_t h0, std::vector<float>& buf) {
  const int64_t L = p.L, D = p.D, Dv = p.Dv;
  buf.resize(R * (D + L + Dv) + L);
  float* qf = buf.data();      // [R, D] the queries in float32
  float* s = qf + R * D;       // [R, L] the mask's addends, then scores, then softmax numerators
  float* o = s + R * L;        // [R, Dv] value sums
  float* live = o + R * Dv;    // [L] whether any of the R queries attends to position j
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < R; ++r) {
    const T* qr = p.q + b * p.qs.b + (h0 + r) * p.qs.h;
    for (int64_t d = 0; d < D; ++d) qf[r * D + d] = widen1(qr[d]);
    float* sr = s + r * L;
    const int64_t mo = b * p.ms.b + (h0 + r) * p.ms.h;
    if (p.mask_bool)
      for (int64_t j = 0; j < L; ++j) sr[j] = p.mask_bool[mo + j * p.ms.l] ? 0.f : kNegInf;
    else if (p.mask_add)
      for (int64_t j = 0; j < L; ++j) sr[j] = p.mask_add[mo + j * p.ms.l];
    else
      std::fill(sr, sr + L, 0.f);
  }
  for (int64_t j = 0; j < L; ++j) {
    bool any = false;
    for (int r = 0; r < R; ++r) any = any || s[r * L + j] != kNegInf;
    live[j] = any ? 1.f : 0.f;
  }
  const T* kb = p.k + b * p.ks.b + g * p.ks.h;
  const T* vb = p.v + b * p.vs.b + g * p.vs.h;

  // Scores: each key the R queries attend to read once, their R sums in registers; a bool mask's
  // excluded positions are never read.
  for (int64_t j = 0; j < L; ++j) {
    if (live[j] == 0.f) continue;
    const T* kj = kb + j * p.ks.l;
    float dots[kMaxR] = {0.f, 0.f, 0.f, 0.f};
    int64_t d = 0;
#if defined(__AVX2__)
    vfloat acc[kMaxR] = {vzero(), vzero(), vzero(), vzero()};
    for (; d + kLanes <= D; d += kLanes) {
      const vfloat kv = widen(kj + d);
      for (int r = 0; r < R; ++r) acc[r] = vfma(vload(qf + r * D + d), kv, acc[r]);
    }
    vsum4(acc, dots);  // unused accumulators are zeros
#endif
    for (; d < D; ++d) {
      const float kd = widen1(kj[d]);
      for (int r = 0; r < R; ++r) dots[r] += qf[r * D + d] * kd;
    }
    for (int r = 0; r < R; ++r) s[r * L + j] = dots[r] * p.scale + s[r * L + j];
  }
  // Each query's softmax numerators exp(score - max); a query with every position masked gets
  // zeros, as aten's CPU attention gives.
  float sums[kMaxR];
  for (int r = 0; r < R; ++r) {
    float* sr = s + r * L;
    float m = kNegInf;
    bool nan = false;
    for (int64_t j = 0; j < L; ++j) {
      nan = nan || std::isnan(sr[j]);
      m = std::max(m, sr[j]);
    }
    if (nan || m == -kNegInf) {  // NaN or +inf scores: NaN, as aten gives
      std::fill(sr, sr + L, std::numeric_limits<float>::quiet_NaN());
      sums[r] = std::numeric_limits<float>::quiet_NaN();
    } else if (m == kNegInf) {
      std::fill(sr, sr + L, 0.f);
      sums[r] = 0.f;
    } else {
      sums[r] = exp_shifted(sr, L, m);
    }
  }
  // The values: per block of kLanes columns the R sums in registers over every live position.
  int64_t d = 0;
#if defined(__AVX2__)
  for (; d + kLanes <= Dv; d += kLanes) {
    vfloat acc[kMaxR] = {vzero(), vzero(), vzero(), vzero()};
    for (int64_t j = 0; j < L; ++j) {
      if (live[j] == 0.f) continue;
      const vfloat vv = widen(vb + j * p.vs.l + d);
      for (int r = 0; r < R; ++r) acc[r] = vfma(vbroadcast(s[r * L + j]), vv, acc[r]);
    }
    for (int r = 0; r < R; ++r) vstore(o + r * Dv + d, acc[r]);
  }
#endif
  for (; d < Dv; ++d)
    for (int r = 0; r < R; ++r) {
      float acc = 0.f;
      for (int64_t j = 0; j < L; ++j)
        if (live[j] != 0.f) acc += s[r * L + j] * widen1(vb[j * p.vs.l + d]);
      o[r * Dv + d] = acc;
    }
  for (int r = 0; r < R; ++r) {
    T* out = p.out + (b * p.H + h0 + r) * Dv;
    const float inv = sums[r] > 0.f ? 1.f / sums[r] : 0.f;
    for (int64_t c = 0; c < Dv; ++c) narrow1(sums[r] > 0.f ? o[r * Dv + c] * inv : o[r * Dv + c] * 0.f, out + c);
  }
}

template <typename T>
void attend_heads(const Problem<T>& p, int64_t b, int64_t g, int64_t h0, int64_t R, std::vector<float>& buf) {
  switch (R) {
    case 1: attend<T, 1>(p, b, g, h0, buf); break;
    case 2: attend<T, 2>(p, b, g, h0, buf); break;
    case 3: attend<T, 3>(p, b, g, h0, buf); break;
    default: attend<T, 4>(p, b, g, h0, buf); break;
  }
}

template <typename T>
void run(const Problem<T>& p, int64_t B) {
  const int64_t rep = p.H / p.Hk;
  // Tasks: (batch, KV head, a block of its query heads). Whole groups share each key read; the
  // groups are split while there are fewer than four tasks a thread.
  int64_t R = std::min(rep, kMaxR);
  while (R > 1 && B * p.Hk * ((rep + R - 1) / R) < 4 * at::get_num_threads()) R = (R + 1) / 2;
  const int64_t blocks = (rep + R - 1) / R, tasks = B * p.Hk * blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> buf;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (p.Hk * blocks), g = (t / blocks) % p.Hk, i = t % blocks;
      const int64_t h0 = g * rep + i * R;
      attend_heads(p, b, g, h0, std::min(R, rep - i * R), buf);
    }
  });
}

Strides strides_of(const torch::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

}  // namespace

// q [B, H, 1, D], k [B, Hk, L, D], v [B, Hk, L, Dv] of one dtype (bfloat16 or float32), each
// with its last dimension contiguous; H a multiple of Hk (query head h reads KV head h / (H / Hk)).
// mask: none, or bool (true: attend) or float32 (added to the scores), broadcastable to
// [B, H, 1, L]. Returns softmax(q k^T scale + mask) v as [B, 1, H, Dv] (contiguous, q's dtype):
// transformers' attention output layout.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-d, got ", q.sizes(),
              ", ", k.sizes(), ", ", v.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), Hk = k.size(1), L = k.size(2), Dv = v.size(3);
  TORCH_CHECK(q.size(2) == 1, "decode_attention: one query token, got q ", q.sizes());
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(3) == D && v.size(1) == Hk && v.size(2) == L,
              "decode_attention: k ", k.sizes(), " and v ", v.sizes(), " do not fit q ", q.sizes());
  TORCH_CHECK(Hk > 0 && H % Hk == 0, "decode_attention: ", H, " query heads over ", Hk, " key/value heads");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == torch::kBFloat16 || q.scalar_type() == torch::kFloat32),
              "decode_attention: q, k, v of one dtype, bfloat16 or float32; got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1,
              "decode_attention: q, k, v need a contiguous last dimension");
  auto out = torch::empty({B, 1, H, Dv}, q.options());
  torch::Tensor m;
  if (mask.has_value()) {
    m = *mask;
    TORCH_CHECK(m.dim() == 4, "decode_attention: the mask must be 4-d, got ", m.sizes());
    if (m.scalar_type() != torch::kBool && m.scalar_type() != torch::kFloat32) m = m.to(torch::kFloat32);
    m = m.expand({B, H, 1, L});
  }
  if (B == 0 || H == 0 || Dv == 0) return out;
  auto go = [&](auto tag) {
    using T = decltype(tag);
    Problem<T> p{};
    p.q = reinterpret_cast<const T*>(q.data_ptr());
    p.k = reinterpret_cast<const T*>(k.data_ptr());
    p.v = reinterpret_cast<const T*>(v.data_ptr());
    p.qs = strides_of(q), p.ks = strides_of(k), p.vs = strides_of(v);
    if (m.defined()) {
      p.ms = {m.stride(0), m.stride(1), m.stride(3)};
      if (m.scalar_type() == torch::kBool)
        p.mask_bool = m.data_ptr<bool>();
      else
        p.mask_add = m.data_ptr<float>();
    }
    p.out = reinterpret_cast<T*>(out.data_ptr());
    p.H = H, p.Hk = Hk, p.L = L, p.D = D, p.Dv = Dv, p.scale = static_cast<float>(scale);
    run(p, B);
  };
  if (q.scalar_type() == torch::kBFloat16)
    go(uint16_t{});
  else
    go(float{});
  return out;
}
