// y = x W^T on AMX tiles for bf16 activations at many rows (prefill), with W never held whole in
// bf16: each block of 32 output columns is dequantized by its format's panel writer into a small
// bf16 panel in the tiles' pair layout, exactly as the reference's dequantize(bfloat16) rounds it,
// and multiplied from there. The weight bits are the reference's (denormals aside, which the tile
// multiply reads as zero, as it does in aten's AMX GEMM); only the float32 summation order differs
// from aten's GEMM (the reference kernel's F.linear), so outputs agree within float32
// accumulation, and each is one bf16 rounding of its sum.
//
// Why: aten's bf16 GEMM (oneDNN, AMX) needs the whole weight in bf16, so the many-row rows of
// cpu_gemm.py write and read a whole bf16 copy per call (1.5-1.9x dense bf16's time at 256 rows
// on a 2-vCPU Xeon). Here the weight is read once in its own bytes, and the tile loop itself ran
// at ~1.2 TFLOP/s per core against oneDNN's ~0.8-0.9 on that machine (5632x2048, 256 rows).
//
// The same loop multiplies int8 by int8 (AMX-INT8, exact int32 sums; amx_linear_tiles<1>) for int8
// weights with dynamic int8 activations (int8dyn.cpp), the weight's rows copied into the panel as
// they are and each block of sums scaled by the caller's writer.
//
// Tiles (AMX-BF16): a multiply takes A = 16 rows x 32 k (bf16, row-major) and B = 16 k-pairs x
// 16 columns (each 32-bit lane a pair of bf16 of consecutive k) into C = 16 x 16 float32. Each step
// of 32 k loads two A and two B tiles and runs four multiplies (a 32 x 32 output block). The
// weight takes whichever side its own layout is nearer to:
//   B (panel of 32 output columns in k-pairs): the int4 pairs layout, whose 32-bit lanes already
//     hold one row's two consecutive codes; x is A.
//   A (32 weight rows, row-major bf16): row-major codes (int8, float8), which would otherwise need
//     a 16 x 16 transpose per 512 weights; x is then B, in k-pairs, and each 16 x 16 block of
//     sums is transposed on its way out.
// Both sides are laid out so that a step's two tiles are one contiguous 2 KB: x is copied once per
// call into blocks of 32 rows (M x K x 2 bytes, small beside the weight at prefill), the panel is
// written that way. (Tiles read in place from x's rows, 4 KB apart at K = 2048, or from a
// [K/2][M] pair layout, made the weight-as-A loop 1.3-1.7x slower.)
// Per thread: a range of 32-column blocks; for each, the panel is written once per chunk of k and
// used by every activation row. x is taken in chunks of at most 256 rows and of k such that a
// chunk (rows x k x 2 bytes) stays near 1 MB, inside the core's L2: with the whole of x in L3
// (2048x5632 at 256 rows, 2.9 MB) the loop ran at 0.6-0.7x the speed it reached with chunks of
// 0.5-1 MB (2 and 8 MB were slower again, on a noisy host). Across chunks of k the float32 sums
// wait in a per-thread buffer.
//
// A second engine runs the same bf16 loop without AMX (amx_linear_tiles<2, ..., kTiles = false>,
// dot_block): AVX512-BF16's dot products (VDPBF16PS) read the same panels and x blocks, since a B
// tile's 64-byte row is one register of 16 column pairs and an A tile's row gives each pair to
// broadcast. On a 2-core AMD EPYC Zen 4 (no AMX) it ran at dense bf16's time at 256 rows
// (5632x2048, int4 g128 1.00x, int8 1.01x), against 1.14-1.22x for dequantize + aten's GEMM.
// It multiplies int8 by int8 too (amx_linear_tiles<1, ..., kTiles = false>: AVX-512 VNNI's
// VPDPBUSD, unsigned by signed bytes, int32 sums), with x's rows as A (their signed codes
// broadcast) and the weight as B (int8dyn.cpp's panel of unsigned codes in lanes of four): on the
// same Zen 4, 256 rows at 0.51-0.55x dense bf16's time.
//
// Built in the avx512 binary only (HF_AOQ_AMX), the tile code under a target pragma, and run
// only where the CPU has AMX and Linux grants this process the tile state (amx_usable(); Python
// checks cpu_isa as well: AMX-INT8 for the int8 loop); the dot-product engine wherever that
// binary runs (its CPUs have AVX512-BF16). Internal linkage, as in every header here.
#pragma once
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__) && defined(__x86_64__) && \
    defined(__linux__) && (__GNUC__ >= 11 || __clang_major__ >= 12)
#define HF_AOQ_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#else
#define HF_AOQ_AMX 0
#endif

namespace {

// Whether this binary has the AMX kernels and Linux grants this process the tile state (asked
// once per process; the first tile instruction faults without the grant).
inline bool amx_usable() {
#if HF_AOQ_AMX
  static const bool ok = [] {
    constexpr long kReqPerm = 0x1023, kGetPerm = 0x1022, kXtileData = 18;
    if (syscall(SYS_arch_prctl, kReqPerm, kXtileData) != 0) return false;
    unsigned long bits = 0;
    return syscall(SYS_arch_prctl, kGetPerm, &bits) == 0 && (bits >> kXtileData & 1);
  }();
  return ok;
#else
  return false;
#endif
}

inline void check_amx_usable() {
  TORCH_CHECK(amx_usable(), "hf_aoq: the AMX kernels need an avx512 build on a CPU with AMX-BF16 that Linux lets "
              "this process use (kernels/cpu_isa.py decides where they run)");
}

// The bf16 panel GEMM (amx_linear_bf16) on AMX tiles (tiles) needs them usable here; on AVX512-BF16's
// dot products, only the avx512 build (which loads only on a CPU with AVX512-BF16).
inline void check_panel_gemm_usable(bool tiles) {
  if (tiles) return check_amx_usable();
  TORCH_CHECK(HF_AOQ_AMX, "hf_aoq: the bf16 panel GEMM on AVX512-BF16 needs the avx512 build "
              "(kernels/cpu_isa.py decides where it runs)");
}

#if HF_AOQ_AMX
// Two vectors of 16 float32 as 32 bf16 (a in the low half, b in the high), rounded to nearest,
// ties to even, as c10::BFloat16 rounds, except that the instruction reads denormal float32 inputs
// as zero. The tile multiply (TDPBF16PS) reads denormal bf16 as zero anyway, here as in aten's
// AMX GEMM that the reference kernel calls; the one difference left is a float32 value just below
// 2^-126 that c10 rounds up to the smallest normal bf16.
// Outside the AMX target region below (it needs only AVX512-BF16, a flag of the avx512 build), so
// that the panel writers of other files, compiled without that region's target, inline it: called
// from intx.cpp's panel writer it had stayed a call, a tenth of the panel's time.
inline __m512i bf16_pack(__m512 a, __m512 b) { return (__m512i)_mm512_cvtne2ps_pbh(b, a); }

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,amx-int8")

constexpr int64_t kAmxBlockN = 32;             // output columns per panel (two B tiles)
constexpr int64_t kAmxMaxRows = 256;           // activation rows per chunk
constexpr int64_t kAmxChunkBytes = 1 << 20;    // target bytes of an activation chunk (rows x k)

struct AmxTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Eight 16 x 64-byte tiles: 0-3 the sums, 4-5 activations, 6-7 the panel.
inline void amx_configure() {
  AmxTileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  _tile_loadconfig(&c);
}

// Where a block's weight bytes for k in [k0, k1) lie (each panel writer's bytes()): `rows` runs of
// `bytes` bytes, `stride` apart.
struct AmxWeightBytes {
  const void* base = nullptr;
  int64_t rows = 0, stride = 0, bytes = 0;
};

// Asks for the next block's weight bytes (into L2) a few lines per tile step while this block is
// multiplied, so that they arrive while the tiles work and the panel writer finds them there.
// Asked for from inside the panel writer instead (the next block's line beside each line read:
// all of them within the writing, a short time at many rows), they arrived late: in a standalone
// copy of this loop at 256 rows (int8, [5632, 2048], 2-vCPU Xeon, no output written) 4.9 ms a
// weight against 3.7 spread over the tiles, and 2.0 with no panel written at all. The int4 pairs
// asked for nothing.
class AmxPrefetcher {
 public:
  // The bytes to ask for while the coming block is multiplied (nothing when w.base is null).
  void start(const AmxWeightBytes& w) {
    src_ = w;
    per_row_ = (w.bytes + 63) / 64;
    total_ = w.base ? w.rows * per_row_ : 0;
    next_ = stop_ = per_step_ = 0;
  }
  // Lines up to the fraction part / parts of the total, spread over `steps` tile steps.
  void share(int64_t part, int64_t parts, int64_t steps) {
    stop_ = total_ * part / parts;
    per_step_ = steps > 0 ? (stop_ - next_ + steps - 1) / steps : 0;
  }
  void step() {
    for (int64_t e = 0; e < per_step_ && next_ < stop_; ++e, ++next_) {
      const int64_t r = next_ / per_row_, j = next_ % per_row_;
      _mm_prefetch(static_cast<const char*>(src_.base) + r * src_.stride + 64 * j, _MM_HINT_T1);
    }
  }

 private:
  AmxWeightBytes src_;
  int64_t per_row_ = 0, total_ = 0, next_ = 0, stop_ = 0, per_step_ = 0;
};

// r[i] (16 lanes of 32 bits) -> r[j] lane i = old r[i] lane j.
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(r[i + j], r[i + j + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xdd);
  }
}

// Panel writer for row-major weights ([N, K] codes, a scale per row), the weight as the A
// operand: rows n0..n0+31, k in [k0, k1), as bf16 in steps of 32 k: out[((k - k0) / 32 * 32 + r)
// * 32 + k % 32], so that a step's two A tiles are one contiguous 2 KB. w = lanes(p) * scale[n], one
// float32 rounding then one to bf16, as the int8 and float8 references dequantize; lanes(p) gives
// the exact float32 values of the 16 codes at p (before the row's scale).
template <typename T, class Lanes>
struct RowScalePanel {
  static constexpr bool kWeightRows = true;
  static constexpr bool kAsksAhead = true;
  static constexpr int64_t kPieceK = 256;
  using Elem = uint16_t;
  const T* q;
  const float* scale;
  int64_t K;
  Lanes lanes;
  // A step (32 k) at a time over the 32 rows, two steps per row while they last (a whole 64-byte
  // line of one-byte codes): the stores then fill each step's 2 KB in order. Row by row, the
  // stores went to lines 2 KB apart (two L1 sets) and the panel took twice as long.
  // The rows' bytes are asked for ahead (32 short row streams keep the hardware prefetcher
  // behind, as in the GEMVs, simd.h): with `ahead`, the next block's line beside each line read,
  // else by amx_linear_tiles during the tiles (AmxPrefetcher, from bytes()).
  AmxWeightBytes bytes(int64_t n0, int64_t k0, int64_t k1) const {
    return {q + n0 * K + k0, kAmxBlockN, K * int64_t(sizeof(T)), (k1 - k0) * int64_t(sizeof(T))};
  }
  void operator()(int64_t n0, int64_t k0, int64_t k1, uint16_t* out, bool ahead) const {
    __m512 sv[kAmxBlockN];
    for (int r = 0; r < kAmxBlockN; ++r) sv[r] = _mm512_set1_ps(scale[n0 + r]);
    auto step = [&](const T* row, __m512 s, uint16_t* o) {
      _mm512_storeu_si512(o, bf16_pack(_mm512_mul_ps(lanes(row), s), _mm512_mul_ps(lanes(row + 16), s)));
    };
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) {
      uint16_t* o = out + (k - k0) * 32;
      for (int r = 0; r < kAmxBlockN; ++r) {
        const T* row = q + (n0 + r) * K + k;
        if (ahead) _mm_prefetch(reinterpret_cast<const char*>(row + kAmxBlockN * K), _MM_HINT_T1);
        step(row, sv[r], o + r * 32);
        step(row + 32, sv[r], o + 1024 + r * 32);
      }
    }
    for (; k < k1; k += 32)
      for (int r = 0; r < kAmxBlockN; ++r) step(q + (n0 + r) * K + k, sv[r], out + (k - k0) * 32 + r * 32);
  }
};

// Panel writer for the int4 pairs layout (int4_pairs.h): a column pair's 32 bytes hold, in
// 32-bit lane i, nibble t of the low half the even column's code of row 8t + i and of the high
// half the odd column's, so shifting a lane gives one row's two codes: already the tiles' pair
// order. w = (q - P::offset) * s + z per group (separate multiply and add), rounded to bf16, as
// int4_dequant_block_bf16 and the reference compute it. (q - offset) comes from a 16-entry table
// (the permute reads the low 4 bits of each lane).
template <class P>
struct Int4PairsPanel {
  static constexpr bool kWeightRows = false;
  static constexpr bool kAsksAhead = false;
  static constexpr int64_t kPieceK = 256;
  using Elem = uint32_t;
  const uint8_t* w;  // the pairs layout, full blocks of 32 rows
  P params;
  int64_t K, gs;
  // A block's chunk of k is one run: 16 bytes per k (its 32 rows' codes).
  AmxWeightBytes bytes(int64_t n0, int64_t k0, int64_t k1) const { return {w + n0 * K / 2 + k0 * 16, 1, 0, (k1 - k0) * 16}; }
  void operator()(int64_t n0, int64_t k0, int64_t k1, uint32_t* panel, bool /*ahead*/) const {
    const uint8_t* blk = w + n0 * K / 2;
    alignas(64) float s[32], z[32];
    const __m512 table = _mm512_sub_ps(
        _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f),
        _mm512_set1_ps(P::offset));
    // Rows 16h..16h+15: lanes 0-7 from nibble 2h, lanes 8-15 from nibble 2h + 1; odd column +16.
    const __m512i shift_even[2] = {_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4),
                                   _mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 12, 12, 12, 12, 12, 12, 12, 12)};
    const __m512i shift_odd[2] = {_mm512_add_epi32(shift_even[0], _mm512_set1_epi32(16)),
                                  _mm512_add_epi32(shift_even[1], _mm512_set1_epi32(16))};
    // 32 bf16 [even 0..15, odd 0..15] -> 16 lanes (even i, odd i).
    const __m512i interleave = _mm512_setr_epi32(0x00100000, 0x00110001, 0x00120002, 0x00130003, 0x00140004, 0x00150005,
                                                 0x00160006, 0x00170007, 0x00180008, 0x00190009, 0x001A000A, 0x001B000B,
                                                 0x001C000C, 0x001D000D, 0x001E000E, 0x001F000F);
    for (int64_t g = k0 / gs; g < k1 / gs; ++g) {
      params(g, n0, kAmxBlockN, s, z);
      const __m512 sv[2] = {_mm512_load_ps(s), _mm512_load_ps(s + 16)};
      const __m512 zv[2] = {_mm512_load_ps(z), _mm512_load_ps(z + 16)};
      for (int64_t k = g * gs; k < (g + 1) * gs; k += 2) {
        const __m512i b = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + k * 16)));
        uint32_t* o = panel + (k - k0) / 2 * kAmxBlockN;
        for (int h = 0; h < 2; ++h) {
          const __m512 e = _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srlv_epi32(b, shift_even[h]), table), sv[h]), zv[h]);
          const __m512 d = _mm512_add_ps(_mm512_mul_ps(_mm512_permutexvar_ps(_mm512_srlv_epi32(b, shift_odd[h]), table), sv[h]), zv[h]);
          _mm512_storeu_si512(o + 16 * h, _mm512_permutexvar_epi16(interleave, bf16_pack(e, d)));
        }
      }
    }
  }
};

// Panel writer for int8 codes ([N, K], row-major), the weight as the A operand of the int8 tile
// multiply: rows n0..n0+31, k in [k0, k1), copied as they are in steps of 64 k: out[((k - k0) / 64
// * 32 + r) * 64 + k % 64], a step's two A tiles one contiguous 2 KB (as RowScalePanel's).
struct Int8RowsPanel {
  static constexpr bool kWeightRows = true;
  static constexpr bool kAsksAhead = false;
  static constexpr int64_t kPieceK = 256;
  using Elem = uint8_t;
  const int8_t* q;
  int64_t K;
  AmxWeightBytes bytes(int64_t n0, int64_t k0, int64_t k1) const { return {q + n0 * K + k0, kAmxBlockN, K, k1 - k0}; }
  void operator()(int64_t n0, int64_t k0, int64_t k1, uint8_t* out, bool /*ahead*/) const {
    for (int64_t k = k0; k < k1; k += 64)
      for (int r = 0; r < kAmxBlockN; ++r)
        _mm512_storeu_si512(out + (k - k0) * 32 + r * 64, _mm512_loadu_si512(q + (n0 + r) * K + k));
  }
};

// A growable buffer whose data starts on a 64-byte line, left uninitialised (its users write
// every value they read), and kept by its owner between calls unless larger than kAmxKeepBytes
// (release()). Each call's x blocks, panel and sums used to be fresh zero-filled vectors: a call
// with one block of 32 columns (K = 2048) took 155 us at 256 rows and 35 at 16, now 112 and 20.
// Tile loads of 64-byte rows from memory 16 bytes off a line (malloc's alignment; where it landed
// varied from process to process) touch two lines a row: the same call took 1.5-1.7x as long.
constexpr size_t kAmxKeepBytes = size_t(8) << 20;
template <typename T>
class AmxBuffer {
 public:
  T* resize(size_t n) {
    if (n > cap_) {
      raw_.reset();
      raw_.reset(new T[n + 64 / sizeof(T)]);  // default-initialised: not zeroed
      cap_ = n;
    }
    return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(raw_.get()) + 63) & ~uintptr_t(63));
  }
  // Frees the memory if it is more than a call should keep.
  void release() {
    if (cap_ * sizeof(T) > kAmxKeepBytes) {
      raw_.reset();
      cap_ = 0;
    }
  }

 private:
  std::unique_ptr<T[]> raw_;
  size_t cap_ = 0;
};

// A thread's buffers for amx_linear_tiles, whatever the format: the caller's x blocks, and each
// worker's panel and sums (one set per thread in each source file that includes this header).
struct AmxScratch {
  AmxBuffer<uint32_t> x, panel;
  AmxBuffer<float> sums;
};
inline AmxScratch& amx_scratch() {
  static thread_local AmxScratch s;
  return s;
}

// The k of each chunk: all of K when rows x K x bytes fits kAmxChunkBytes, else K split into as
// few chunks as keep each near that size, of even length in multiples of `align` (a multiple of
// the tile step, and of the format's group; the last chunk may be shorter).
inline int64_t amx_chunk_k(int64_t rows, int64_t K, int64_t bytes, int64_t align) {
  if (rows * K * bytes <= kAmxChunkBytes) return K;
  const int64_t chunks = (rows * K * bytes + kAmxChunkBytes - 1) / kAmxChunkBytes;
  return std::max(align, ((K + chunks - 1) / chunks + align - 1) / align * align);
}

// x [M, row_bytes] (rows ldx bytes apart; bf16 or int8 values) in steps of 64 bytes of k, the A
// operand where the weight is B: per block of 32 rows and step, the 32 rows' 64 bytes (2 KB, rows
// past M zero), so that a step's two A tiles are contiguous. Read in place, x's rows (4 KB apart
// at K = 2048 in bf16) put each tile's 16 rows in one L1 set.
inline void amx_pack_rows(const uint8_t* x, int64_t ldx, int64_t M, int64_t row_bytes, uint8_t* out) {
  const int64_t steps = row_bytes / 64, blocks = (M + 31) / 32;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t mb = b0; mb < b1; ++mb)
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t m = 32 * mb + r;
        for (int64_t s = 0; s < steps; ++s)
          _mm512_storeu_si512(out + ((mb * steps + s) * 32 + r) * 64,
                              m < M ? _mm512_loadu_si512(x + m * ldx + 64 * s) : _mm512_setzero_si512());
      }
  });
}

// x [M, row_bytes] (rows ldx bytes apart) as 32-bit lanes of consecutive k (bf16 pairs, or int8
// quads), the B operand where the weight is A: per block of 32 rows, [row_bytes / 4][32] (rows
// past M zero), so that one block's tiles for successive k are contiguous (2 KB a step), as the
// weight's panel is where it is B. A plain [K/2][M] layout put a tile's 16 rows M x 4 bytes apart,
// a stride the hardware prefetcher did not follow: at 256 rows the int8 kernel took 1.7x dense
// bf16's time instead of 0.6x at 64.
inline void amx_pack_lanes(const uint8_t* x, int64_t ldx, int64_t M, int64_t row_bytes, uint32_t* out) {
  const int64_t lanes = row_bytes / 4, blocks = (M + 31) / 32;
  at::parallel_for(0, blocks * (lanes / 16), 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t mb = t / (lanes / 16), p0 = t % (lanes / 16) * 16;
      for (int h = 0; h < 2; ++h) {
        const int64_t m0 = 32 * mb + 16 * h;
        __m512i r[16];
        for (int i = 0; i < 16; ++i)  // row m0 + i's lanes p0..p0+15 (row_bytes is a multiple of 64)
          r[i] = m0 + i < M ? _mm512_loadu_si512(x + (m0 + i) * ldx + 4 * p0) : _mm512_setzero_si512();
        transpose16x16_epi32(r);
        for (int j = 0; j < 16; ++j) _mm512_storeu_si512(out + (mb * lanes + p0 + j) * 32 + 16 * h, r[j]);
      }
    }
  });
}

// The sum tiles of a 32 x 32 block into c (32 x 32 float32, rows 128 bytes apart) in the tiles'
// own orientation: [m][n] where the weight is B, [n][m] where it is A. A half block (at most 16
// activation rows) has only the two tiles of activation rows 0-15: 0 and 2 where the weight is A
// (its rows 0-15 and 16-31 against x's B tile), 0 and 1 where it is B.
template <bool kHalf, bool kWeightRows>
inline void amx_store_sums(float* c) {
  _tile_stored(0, c, 128);
  if (!kHalf || !kWeightRows) _tile_stored(1, c + 16, 128);
  if (!kHalf || kWeightRows) _tile_stored(2, c + 16 * 32, 128);
  if (!kHalf) _tile_stored(3, c + 16 * 32 + 16, 128);
}

template <bool kHalf, bool kWeightRows>
inline void amx_load_sums(const float* c) {
  _tile_loadd(0, c, 128);
  if (!kHalf || !kWeightRows) _tile_loadd(1, c + 16, 128);
  if (!kHalf || kWeightRows) _tile_loadd(2, c + 16 * 32, 128);
  if (!kHalf) _tile_loadd(3, c + 16 * 32 + 16, 128);
}

// One block's multiply over k in [k0, k1): x's 32-row block at a (k-lanes or rows, as packed for
// the side it takes) against the panel w, into the sum tiles (zeroed first, or loaded from acc),
// stored to out. kHalf: the block's activation rows past 16 are all padding, so the tiles of rows
// 16-31 are neither loaded nor multiplied (half the tile work at 1-16 rows and in tails). pf asks
// for its share of the next block's weight a few lines a step. write(kp, kq) is called before the
// steps of each piece [kp, kq) of `piece` k (the panel written piece by piece inside the first
// block of rows' steps, or nothing).
template <int kBytes, bool kWeightRows, bool kHalf, class Write>
inline void amx_block(const uint32_t* a, const uint32_t* w, int64_t k0, int64_t k1, const float* acc, float* out,
                      AmxPrefetcher& pf, int64_t piece, const Write& write) {
  constexpr int64_t lanes_per_k = 4 / kBytes;
  if (acc == nullptr) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    amx_load_sums<kHalf, kWeightRows>(acc);
  }
  // Per step of 64 bytes of k, 2 KB of x's block and 2 KB of the panel, each holding two tiles:
  // rows (16 x 64 bytes, the second at +1 KB) or k-lanes (16 x 128 bytes, the second at +64
  // bytes).
  for (int64_t kp = k0; kp < k1; kp += piece) {
    const int64_t kq = std::min(k1, kp + piece);
    write(kp, kq);
    for (int64_t k = kp; k < kq; k += 16 * lanes_per_k) {
      const uint32_t* xs = a + k / lanes_per_k * 32;
      const uint32_t* ws = w + (k - k0) / lanes_per_k * 32;
      if constexpr (kWeightRows) {  // A: the weight's rows; B: x's k-lanes
        _tile_loadd(4, ws, 64);
        _tile_loadd(5, ws + 256, 64);
        _tile_loadd(6, xs, 128);
        if (!kHalf) _tile_loadd(7, xs + 16, 128);
      } else {  // A: x's rows; B: the weight's k-lanes
        _tile_loadd(4, xs, 64);
        if (!kHalf) _tile_loadd(5, xs + 256, 64);
        _tile_loadd(6, ws, 128);
        _tile_loadd(7, ws + 16, 128);
      }
      // Sum tile 2i + j: A tile 4 + i against B tile 6 + j.
      if constexpr (kBytes == 2) {
        _tile_dpbf16ps(0, 4, 6);
        if (!kHalf || !kWeightRows) _tile_dpbf16ps(1, 4, 7);
        if (!kHalf || kWeightRows) _tile_dpbf16ps(2, 5, 6);
        if (!kHalf) _tile_dpbf16ps(3, 5, 7);
      } else {
        _tile_dpbssd(0, 4, 6);
        if (!kHalf || !kWeightRows) _tile_dpbssd(1, 4, 7);
        if (!kHalf || kWeightRows) _tile_dpbssd(2, 5, 6);
        if (!kHalf) _tile_dpbssd(3, 5, 7);
      }
      pf.step();
    }
  }
  amx_store_sums<kHalf, kWeightRows>(out);
}

// The same multiply as amx_block's tiles, on AVX-512 dot products for a CPU without AMX: C[i][j]
// (out, 32 x 32 sums, rows of 32) += sum over the 4-byte lanes p of A row i's lane p dotted with
// B lane j's lane p, for A = rows*16 lanes a step (a[s * 512 + i * 16 + p]) and B = 16 lanes x 32
// columns a step (b[s * 512 + p * 32 + j]), the layouts amx_block's tiles load. bf16 (kInt8
// false): lanes of two bf16, float32 sums (VDPBF16PS, AVX512-BF16). int8 (kInt8): lanes of four
// bytes, int32 sums (VPDPBUSD, AVX-512 VNNI), A's bytes signed and B's unsigned (the caller makes
// one side unsigned and corrects the sums: int8dyn.cpp). R rows of A and NV vectors of 16 lanes
// of B at a time in registers over the steps; each A lane is broadcast to all lanes.
template <int R, int NV, bool kInt8>
inline void dot_rows(const uint32_t* a, const uint32_t* b, int64_t steps, const float* src, float* dst,
                     AmxPrefetcher* pf) {
  using Acc = std::conditional_t<kInt8, __m512i, __m512>;
  Acc c[R][NV];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      if constexpr (kInt8)
        c[r][v] = src ? _mm512_loadu_si512(src + r * 32 + 16 * v) : _mm512_setzero_si512();
      else
        c[r][v] = src ? _mm512_loadu_ps(src + r * 32 + 16 * v) : _mm512_setzero_ps();
    }
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* as = a + s * 512;
    const uint32_t* bs = b + s * 512;
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      __m512i bv[NV];
#pragma GCC unroll 2
      for (int v = 0; v < NV; ++v) bv[v] = _mm512_load_si512(bs + p * 32 + 16 * v);
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_set1_epi32(static_cast<int>(as[r * 16 + p]));
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          if constexpr (kInt8)
            c[r][v] = _mm512_dpbusd_epi32(c[r][v], bv[v], x);
          else
            c[r][v] = _mm512_dpbf16_ps(c[r][v], (__m512bh)x, (__m512bh)bv[v]);
        }
      }
    }
    if (pf) pf->step();
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      if constexpr (kInt8)
        _mm512_storeu_si512(dst + r * 32 + 16 * v, c[r][v]);
      else
        _mm512_storeu_ps(dst + r * 32 + 16 * v, c[r][v]);
    }
}

// dot_rows for bf16 where the weight is A and x's rows (B) are at most 8: each sum vector is the
// low 8 lanes of dot_rows' 16 (x's rows 0-7; the others are padding, never read), 256-bit
// VDPBF16PS in place of 512-bit ones (float8's panel 1.27-1.31x as fast at 2-8 rows on a Zen 4).
// Lane for lane the same operations in the same order as dot_rows<R, 1, false>, so the same bits.
template <int R>
inline void dot_rows8(const uint32_t* a, const uint32_t* b, int64_t steps, const float* src, float* dst,
                      AmxPrefetcher* pf) {
  __m256 c[R];
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) c[r] = src ? _mm256_loadu_ps(src + r * 32) : _mm256_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    const uint32_t* as = a + s * 512;
    const uint32_t* bs = b + s * 512;
#pragma GCC unroll 16
    for (int p = 0; p < 16; ++p) {
      const __m256i bv = _mm256_load_si256(reinterpret_cast<const __m256i*>(bs + p * 32));
#pragma GCC unroll 32
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_set1_epi32(static_cast<int>(as[r * 16 + p]));
        c[r] = _mm256_dpbf16_ps(c[r], (__m256bh)x, (__m256bh)bv);
      }
    }
    if (pf) pf->step();
  }
#pragma GCC unroll 32
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(dst + r * 32, c[r]);
}

// amx_block on AVX-512 dot products (bf16: kBytes 2; int8: kBytes 1, x as A only): the same
// arguments, the same sums in c's orientation, and `rows`, the block's activation rows that are
// not padding. Where x is A only those rows are multiplied, rounded up to 4 (up to 12 rows of a
// half block and 28 of a full one; above, all 16 or 32): their sums are all that is read of c (a
// tile multiplies all 16 or 32, padding included), so 20 rows cost 20 rows' dot products rather
// than 32's, and 8 rows 8 rather than 16. Where x is B, 16 of its rows share each vector, as in a
// tile, or 8 (256-bit dot products) where the block has at most 8. Each row's sums are the same
// bits either way.
template <int kBytes, bool kWeightRows, bool kHalf, class Write>
inline void dot_block(const uint32_t* x, const uint32_t* w, int64_t k0, int64_t k1, const float* acc, float* out,
                      AmxPrefetcher& pf, int64_t piece, const Write& write, int64_t rows) {
  static_assert(kBytes == 2 || !kWeightRows, "int8 dot products take x as A (signed) and the weight as B");
  constexpr int64_t lanes_per_k = 4 / kBytes;
  // A: the weight's rows (kWeightRows) or x's; B: the other's k-lanes. Half: only 16 of x's rows.
  constexpr int kRowsA = (kHalf && !kWeightRows) ? 16 : 32;
  constexpr int kNV = (kHalf && kWeightRows) ? 1 : 2;
  for (int64_t kp = k0; kp < k1; kp += piece) {
    const int64_t kq = std::min(k1, kp + piece);
    write(kp, kq);
    const uint32_t* xs = x + kp / lanes_per_k * 32;
    const uint32_t* ws = w + (kp - k0) / lanes_per_k * 32;
    const uint32_t* A = kWeightRows ? ws : xs;
    const uint32_t* B = kWeightRows ? xs : ws;
    const int64_t steps = (kq - kp) / (16 * lanes_per_k);
    const float* src = kp == k0 ? acc : out;
    // Groups of rows whose sums fit the registers (22 or 16 of the 32 zmm).
    auto group = [&](auto n, int64_t r0, AmxPrefetcher* p) {
      dot_rows<decltype(n)::value, kNV, kBytes == 1>(A + r0 * 16, B, steps, src ? src + r0 * 32 : nullptr,
                                                     out + r0 * 32, p);
    };
    if constexpr (kNV == 1) {  // A: the weight's 32 rows, B: 16 of x's (8 where that covers them)
      if (rows <= 8) {
        dot_rows8<16>(A, B, steps, src, out, &pf);
        dot_rows8<16>(A + 16 * 16, B, steps, src ? src + 16 * 32 : nullptr, out + 16 * 32, nullptr);
      } else {
        group(std::integral_constant<int, 16>{}, 0, &pf);
        group(std::integral_constant<int, 16>{}, 16, nullptr);
      }
    } else if (kRowsA == 16 && rows > 12) {  // A: 13-16 of x's rows
      group(std::integral_constant<int, 8>{}, 0, &pf);
      group(std::integral_constant<int, 8>{}, 8, nullptr);
    } else if (kWeightRows || rows > 28) {  // A: the weight's 32 rows, or 29-32 of x's
      group(std::integral_constant<int, 11>{}, 0, &pf);
      group(std::integral_constant<int, 11>{}, 11, nullptr);
      group(std::integral_constant<int, 10>{}, 22, nullptr);
    } else {  // A: x's rows, in groups of 8 and a last one of 4 where that covers them
      for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        AmxPrefetcher* p = r0 == 0 ? &pf : nullptr;
        if (rows - r0 > 4)
          group(std::integral_constant<int, 8>{}, r0, p);
        else
          group(std::integral_constant<int, 4>{}, r0, p);
      }
    }
  }
}

// c (32 x 32 sums of 4 bytes, [n][m] as the tiles leave them where the weight is A) into [m][n],
// 16 x 16 at a time.
inline void amx_transpose_block(float* c) {
  for (int bi = 0; bi < 2; ++bi)
    for (int bj = bi; bj < 2; ++bj) {  // swap the off-diagonal blocks pairwise, each transposed
      __m512i a[16], b[16];
      for (int i = 0; i < 16; ++i) a[i] = _mm512_load_si512(c + (16 * bi + i) * 32 + 16 * bj);
      transpose16x16_epi32(a);
      if (bi == bj) {
        for (int i = 0; i < 16; ++i) _mm512_store_si512(c + (16 * bi + i) * 32 + 16 * bj, a[i]);
        continue;
      }
      for (int i = 0; i < 16; ++i) b[i] = _mm512_load_si512(c + (16 * bj + i) * 32 + 16 * bi);
      transpose16x16_epi32(b);
      for (int i = 0; i < 16; ++i) {
        _mm512_store_si512(c + (16 * bj + i) * 32 + 16 * bi, a[i]);
        _mm512_store_si512(c + (16 * bi + i) * 32 + 16 * bj, b[i]);
      }
    }
}

// Output rows m0..m0+rows-1, columns n0..n0+31 of y (bf16, N columns): c's sums plus the bias,
// one rounding each. c is [m][n], or [n][m] (transposed here) when nm.
inline void amx_write_block(float* c, bool nm, const float* bias, int64_t n0, int64_t rows, uint16_t* y, int64_t N) {
  if (nm) amx_transpose_block(c);
  const __m512 bias0 = bias ? _mm512_loadu_ps(bias + n0) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_loadu_ps(bias + n0 + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r)
    _mm512_storeu_si512(y + r * N + n0, bf16_pack(_mm512_add_ps(_mm512_load_ps(c + r * 32), bias0),
                                                  _mm512_add_ps(_mm512_load_ps(c + r * 32 + 16), bias1)));
}

// The tile loop for x [M, K] (rows ldx bytes apart) and a weight [N, K] of kBytes-wide values:
// bf16 (2: TDPBF16PS, float32 sums) or int8 (1: TDPBSSD, int32 sums; without tiles VPDPBUSD,
// the weight as B), 64 bytes of k a step. The
// weight is written 32 output columns and a chunk of k [k0, k1) at a time by write_panel into a
// buffer of Panel::Elem: where Panel::kWeightRows, the weight rows n0..n0+31 in steps of 64 bytes
// (RowScalePanel's layout); else the k-lanes of 4 bytes of columns n0..n0+31 (panel[(p - p0) * 32
// + j] = W[n0 + j]'s lane p). write_panel(n0, k0, k1, out, ahead) also asks for the next block's
// rows as it reads its own when `ahead` (only a writer with kAsksAhead does), and bytes(n0, k0, k1)
// says where a block's weight bytes lie, for AmxPrefetcher. Each finished 32 x 32 block of sums
// goes to out(c, nm, n0, m0, rows):
// c holds the 4-byte sums, [n][m] when nm (the weight was A), else [m][n]. N a multiple of 32,
// K x kBytes of 64, `align` of 64 / kBytes and of the format's group (chunks of k start at its
// multiples).
template <int kBytes, class Panel, class Out, bool kTiles = true>
void amx_linear_tiles(const uint8_t* x, int64_t ldx, int64_t M, int64_t N, int64_t K, int64_t align,
                      const Panel& write_panel, const Out& out) {
  static_assert(kBytes == 1 || kBytes == 2, "bf16 or int8 values");
  static_assert(kTiles || kBytes == 2 || !Panel::kWeightRows, "int8 dot products take the weight as B");
  constexpr bool rows_panel = Panel::kWeightRows;
  constexpr int64_t lanes_per_k = 4 / kBytes;  // k per 4-byte lane; a step is 16 lanes, 64 bytes
  // x once per call, blocked for the tiles (M x K x kBytes, small beside the weight at prefill).
  AmxBuffer<uint32_t>& xbuf = amx_scratch().x;
  uint32_t* const xb = xbuf.resize((M + 31) / 32 * 32 * K / lanes_per_k);
  if (rows_panel)
    amx_pack_lanes(x, ldx, M, K * kBytes, xb);
  else
    amx_pack_rows(x, ldx, M, K * kBytes, reinterpret_cast<uint8_t*>(xb));
  const int64_t blocks = N / kAmxBlockN;
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    if constexpr (kTiles) amx_configure();
    const int64_t mine = b1 - b0;
    AmxBuffer<uint32_t>& panel_buf = amx_scratch().panel;
    AmxBuffer<float>& sums_buf = amx_scratch().sums;  // [block][32-row block][32 x 32] across chunks of k
    float* sums = nullptr;
    alignas(64) float c[32 * 32];
    AmxPrefetcher pf;
    for (int64_t mc0 = 0; mc0 < M; mc0 += kAmxMaxRows) {
      const int64_t mrows = std::min(kAmxMaxRows, M - mc0);
      const int64_t padded = (mrows + 31) / 32 * 32;
      const int64_t kc = amx_chunk_k(mrows, K, kBytes, align);
      const bool chunked = kc < K;
      // At most 64 rows the tiles take little time beside the panel's writing: a row panel
      // (kAsksAhead) then asks for the next block's rows as it reads its own, as it always did.
      // Measured, [5632, 2048] from DRAM, 2-vCPU Xeon: float8 at 16 rows 1.25-1.27 ms that way
      // against 1.36-1.38 asked during the tiles; the int4 pairs (which asked for nothing) 1.12-1.14
      // -> 1.04-1.09 asked during the tiles.
      const bool in_panel = Panel::kAsksAhead && padded <= 64;
      // Pieces of the panel (amx_block): Panel::kPieceK k rounded up to `align`, or the whole
      // chunk for a writer whose every call has a fixed cost (kPieceK 0).
      const int64_t piece = Panel::kPieceK > 0 ? (std::max(Panel::kPieceK, align) + align - 1) / align * align : kc;
      uint32_t* const panel = panel_buf.resize(kc / lanes_per_k * kAmxBlockN);
      if (chunked) sums = sums_buf.resize(mine * padded * kAmxBlockN);
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t k1 = std::min(K, k0 + kc);
        const bool first = k0 == 0, last = k1 == K;
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t n0 = b * kAmxBlockN;
          // The panel is written a piece of k at a time inside the first block of rows' steps,
          // each piece just before its tiles read it (from L1), the writing overlapping the
          // multiplies; the other blocks of rows read it whole.
          bool writing = true;
          const auto write_piece = [&](int64_t kp, int64_t kq) {
            if (writing)
              write_panel(n0, kp, kq, reinterpret_cast<typename Panel::Elem*>(panel + (kp - k0) / lanes_per_k * 32),
                          in_panel);
          };
          // While this block multiplies: the next block's bytes of this chunk of k, or after the
          // last block the first block's of the next chunk (none after the last chunk).
          if (in_panel)
            pf.start({});
          else if (b + 1 < b1)
            pf.start(write_panel.bytes(n0 + kAmxBlockN, k0, k1));
          else
            pf.start(last ? AmxWeightBytes{} : write_panel.bytes(b0 * kAmxBlockN, k1, std::min(K, k1 + kc)));
          const uint32_t* w = panel;
          const int64_t mblocks = padded / 32, steps = (k1 - k0) / (16 * lanes_per_k);
          for (int64_t m0 = 0; m0 < mrows; m0 += 32) {
            float* acc = chunked ? sums + ((b - b0) * padded + m0) * kAmxBlockN : nullptr;
            const uint32_t* a = xb + (mc0 + m0) / 32 * (K / lanes_per_k) * 32;
            const int64_t rows = std::min<int64_t>(32, mrows - m0);
            float* dst = last ? c : acc;
            pf.share(m0 / 32 + 1, mblocks, steps);
            const float* from = first ? nullptr : acc;
            writing = m0 == 0;
            const int64_t step_k = writing ? piece : k1 - k0;
            if constexpr (!kTiles) {
              if (rows <= 16)
                dot_block<kBytes, rows_panel, true>(a, w, k0, k1, from, dst, pf, step_k, write_piece, rows);
              else
                dot_block<kBytes, rows_panel, false>(a, w, k0, k1, from, dst, pf, step_k, write_piece, rows);
            } else if (rows <= 16) {
              amx_block<kBytes, rows_panel, true>(a, w, k0, k1, from, dst, pf, step_k, write_piece);
            } else {
              amx_block<kBytes, rows_panel, false>(a, w, k0, k1, from, dst, pf, step_k, write_piece);
            }
            if (last) out(c, rows_panel, n0, mc0 + m0, rows);
          }
        }
      }
    }
    if constexpr (kTiles) _tile_release();
    panel_buf.release();
    sums_buf.release();
  });
  xbuf.release();
}

// y [M, N] bf16 = x [M, K] (bf16, rows ldx apart) W^T (+ bias, float32 [N] or null), the weight
// written by write_panel (amx_linear_tiles; RowScalePanel or Int4PairsPanel), on AMX tiles
// (tiles) or AVX512-BF16's dot products. N a multiple of 32, K of 32 and of `align`.
template <class Panel>
void amx_linear_bf16(const uint16_t* x, int64_t ldx, int64_t M, int64_t N, int64_t K, int64_t align, const float* bias,
                     uint16_t* y, const Panel& write_panel, bool tiles) {
  const auto out = [&](float* c, bool nm, int64_t n0, int64_t m0, int64_t rows) {
    amx_write_block(c, nm, bias, n0, rows, y + m0 * N, N);
  };
  const uint8_t* xb = reinterpret_cast<const uint8_t*>(x);
  if (tiles)
    amx_linear_tiles<2, Panel, decltype(out), true>(xb, ldx * 2, M, N, K, align, write_panel, out);
  else
    amx_linear_tiles<2, Panel, decltype(out), false>(xb, ldx * 2, M, N, K, align, write_panel, out);
}

#pragma GCC pop_options
#endif  // HF_AOQ_AMX

// x as a contiguous bf16 [M, K] the kernels can read (K past x's k columns zero-filled), and the
// bias as float32 [N] (or undefined).
inline torch::Tensor amx_input(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.dtype() == torch::kBFloat16 && x.dim() == 2, "x: bfloat16 [M, k]");
  TORCH_CHECK(x.size(1) <= K, "x: at most ", K, " columns, got ", x.size(1));
  if (x.size(1) == K) return x.contiguous();
  auto padded = torch::zeros({x.size(0), K}, x.options());
  padded.narrow(1, 0, x.size(1)).copy_(x);
  return padded;
}

inline torch::Tensor amx_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value() || !bias->defined()) return torch::Tensor();
  TORCH_CHECK(bias->numel() == N, "bias: expected ", N, " values, got ", bias->numel());
  return bias->reshape({N}).to(torch::kFloat32).contiguous();
}

}  // namespace
