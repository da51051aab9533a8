// The GEMM's register tile on AVX-512 (gemm.cpp's float32 weights, gemm_w16.cpp's 16-bit
// weights widened to fp32 on load): R rows x 32 columns, 2 R zmm accumulators over the whole K
// loop; per k, two 16-lane loads of the panel (L::at), R broadcasts of x from the tile's packed
// rows (x[k * R + r], avx512_pack_rows), 2 R FMAs, and a fetch into L1 of the panel's lines
// GEMM_L1_AHEAD iterations ahead; each output one FMA chain in k order, then + bias.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gemm.h"

namespace pagedllm {

struct Load16F32 {  // 16 fp32 weights
  using W = float;
  static __m512 at(const float* p) { return _mm512_loadu_ps(p); }
};

struct Load16BF16 {  // 16 bf16 weights -> fp32 (exact)
  using W = uint16_t;
  static __m512 at(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};

struct Load16F16 {  // 16 fp16 weights -> fp32 (exact)
  using W = uint16_t;
  static __m512 at(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

// Rows src[0:h] (row stride ldx, h <= 16) of k values packed k-major for avx512_tile:
// dst[kk * h + r] = src[r * ldx + kk]. 16 x 16 blocks transposed in registers (unpack, then
// 128-bit lane shuffles), each k's h values stored under a mask.
inline void avx512_pack_rows(const float* src, int64_t ldx, int64_t h, int64_t k, float* dst) {
  const __mmask16 out = h >= 16 ? 0xFFFF : (1u << h) - 1;
  for (int64_t k0 = 0; k0 < k; k0 += 16) {
    const int64_t n = std::min<int64_t>(16, k - k0);
    const __mmask16 in = n == 16 ? 0xFFFF : (1u << n) - 1;
    __m512 r[16], t[16];
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i)
      r[i] = i < h ? _mm512_maskz_loadu_ps(in, src + i * ldx + k0) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {  // per 128-bit lane L: (a[4L], b[4L], a[4L+1], b[4L+1]), ...
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {  // r[4 i + j], lane L: rows 4 i .. 4 i + 3 of column 4 L + j
      r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {  // column 4 L + j: lane L of r[j], r[4 + j], r[8 + j], r[12 + j]
      const __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
      const __m512 u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
      const __m512 u2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
      const __m512 u3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
      t[j] = _mm512_shuffle_f32x4(u0, u2, 0x88);
      t[4 + j] = _mm512_shuffle_f32x4(u0, u2, 0xDD);
      t[8 + j] = _mm512_shuffle_f32x4(u1, u3, 0x88);
      t[12 + j] = _mm512_shuffle_f32x4(u1, u3, 0xDD);
    }
    for (int64_t c = 0; c < n; ++c) _mm512_mask_storeu_ps(dst + (k0 + c) * h, out, t[c]);
  }
}

// How many iterations of its k loop ahead a tile fetches its panel's lines into L1. A tile reads
// its panel from L2 (96 KB at K = 768, 384 KB at 3,072: larger than L1), and the hardware's own
// fetches left the FMAs waiting on it: 14 x 32 tile alone, 8 panels of K = 768 in L2, one
// thread, 0.79-0.80 -> 0.81-0.84 of the FMA peak (4, 8 and 16 ahead within noise). Prefetches
// past the panel's end fault nothing (the next panel's first lines, or none). Tiles of under
// GEMM_L1_ROWS rows (decode: 1-3 rows, the panel from memory) wait on memory, not on L2, and do
// without: their fetches measured even to 0.96x on 16-bit weights. The AVX2 tile (gemm_avx2.h: a
// half panel row a k, 6 rows) measured even with them (0.99-1.04x) and goes without.
constexpr int64_t GEMM_L1_AHEAD = 8;
constexpr int GEMM_L1_ROWS = 4;

template <int R, typename L>
inline void avx512_tile(const float* x, int64_t /*ldx: R*/, const typename L::W* w, int64_t k_n,
                        const float* bias, float* y, int64_t ldy, int64_t n_valid,
                        GemmAhead ahead) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  // The tile's output lines fetched for writing before its K loop: a 2,048-row call's output
  // (6-32 MB) is in no cache, and the stores after the loop otherwise wait on those reads
  // (2,048 x 2,304 x 768, 2 threads: 1.11-1.13x; bench linear at 64 requests: 0.66-0.69 ->
  // 0.74-0.75 of the FMA peak). Fetches only: the same bits.
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    __builtin_prefetch(y + r * ldy, 1, 3);
    __builtin_prefetch(y + r * ldy + 16, 1, 3);
  }
  for (int64_t k = 0; k < k_n; ++k) {
    const __m512 w0 = L::at(w + k * GEMM_PANEL), w1 = L::at(w + k * GEMM_PANEL + 16);
    gemm_prefetch(ahead, k);
    if constexpr (R >= GEMM_L1_ROWS) {
      const char* on = reinterpret_cast<const char*>(w + (k + GEMM_L1_AHEAD) * GEMM_PANEL);
#pragma GCC unroll 2
      for (int64_t b = 0; b < GEMM_PANEL * int64_t{sizeof(*w)}; b += 64)
        _mm_prefetch(on + b, _MM_HINT_T0);
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[k * R + r]);
      a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
    }
  }
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  const __mmask16 m0 = n_valid >= 16 ? 0xFFFF : (1u << n_valid) - 1;
  const __mmask16 m1 = n_valid >= 32 ? 0xFFFF : n_valid <= 16 ? 0 : (1u << (n_valid - 16)) - 1;
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(m0, bias);
    b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, bias ? _mm512_add_ps(a0[r], b0) : a0[r]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, bias ? _mm512_add_ps(a1[r], b1) : a1[r]);
  }
}

}  // namespace pagedllm
#endif
