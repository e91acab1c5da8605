// The machine's read bandwidth as the GEMVs could see it: one pass over a buffer that only loads
// (64 bytes per vector, four independent streams per thread, XOR-folded so the loads cannot be
// dropped), split over aten's threads. One of scripts/bench_machine.py's three probes, beside
// torch's sum and a copy, none of which is always the fastest: on a 2-core AMD EPYC Zen 4 VM
// torch's reductions read 28-36 GB/s on 4 KiB or 2 MiB pages, a standalone copy of this loop 54
// GB/s from 2 MiB pages in one quiet minute (28 on 4 KiB pages), llama.cpp's f16 decode moved 48,
// and in a slower minute this probe read 32 GB/s against the copy's 43 (read + write bytes).
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "hf_aoq_cpu.h"

namespace {

// XOR of the 8-byte words of p[0, n) (n a multiple of 256), four accumulators.
uint64_t xor_words(const uint8_t* p, int64_t n) {
#if defined(__AVX512F__)
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 256) {
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + i + 192));
  }
  alignas(64) uint64_t w[8];
  _mm512_store_si512(w, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
#elif defined(__AVX2__)
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < n; i += 128) {
    a0 = _mm256_xor_si256(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_xor_si256(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_xor_si256(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_xor_si256(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) uint64_t w[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(w), _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3)));
#else
  uint64_t w[4] = {0, 0, 0, 0};
  for (int64_t i = 0; i < n; i += 32)
    for (int j = 0; j < 4; ++j) {
      uint64_t v;
      std::memcpy(&v, p + i + 8 * j, 8);
      w[j] ^= v;
    }
#endif
  uint64_t r = 0;
  for (uint64_t v : w) r ^= v;
  return r;
}

}  // namespace

// The XOR of buf's 8-byte words (a trailing part word zero-padded), computed by reading every
// byte once; the value only proves the reads happened (tests check it).
int64_t read_xor(torch::Tensor buf) {
  TORCH_CHECK(buf.dtype() == torch::kUInt8 && buf.dim() == 1 && buf.is_contiguous() && buf.device().is_cpu(),
              "read_xor: buf must be a contiguous 1-D uint8 CPU tensor");
  const uint8_t* p = buf.data_ptr<uint8_t>();
  const int64_t n = buf.numel(), kStep = 256, blocks = n / kStep;
  const int64_t grain = std::max<int64_t>(1, blocks / std::max(1, at::get_num_threads()));
  std::vector<uint64_t> parts(static_cast<size_t>(std::max(1, at::get_num_threads())) * 8, 0);
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    parts[static_cast<size_t>(at::get_thread_num()) * 8] ^= xor_words(p + b0 * kStep, (b1 - b0) * kStep);
  });
  uint64_t r = 0;
  for (uint64_t v : parts) r ^= v;
  for (int64_t i = blocks * kStep; i < n; i += 8) {
    uint64_t v = 0;
    std::memcpy(&v, p + i, static_cast<size_t>(std::min<int64_t>(8, n - i)));
    r ^= v;
  }
  return static_cast<int64_t>(r);
}
