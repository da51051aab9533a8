// The GEMM's register tile on AVX2 + FMA (gemm.cpp's float32 weights, gemm_w16.cpp's 16-bit
// weights widened to fp32 in registers): the same panels and the same per-output sum as the
// AVX-512 tile (one FMA per k, in k order, then + bias), so both ISAs give the same bits.
//
// AVX2 has 16 ymm registers of 8 lanes, so a 32-column panel row is four vectors and an 8-row
// tile would need 32 accumulators. The tile (up to 6 rows: gemm_tile.h's GEMM_MR_X32) is cut by
// columns instead:
//
//     columns  0..15 | 16..31          each half: R rows x 16 columns,
//     rows 0..R-1    |                 2 R accumulators + 2 weight vectors + 1 broadcast <= 15
//
// A half reads its half of each k row of the panel (64 of its 128 bytes, or 32 of 64 for 16-bit
// weights) and fetches half of the tile's share of the next panel (gemm_prefetch), so the fetch
// spans both halves' compute: at decode rows, where the weights come from memory, 1.10x over
// the first half fetching it all (125M shapes, 8-15 rows, 2 threads).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "gemm.h"

namespace pagedllm {

struct LoadF32 {  // 8 fp32 weights
  using W = float;
  static __m256 at(const float* p) { return _mm256_loadu_ps(p); }
};

struct LoadBF16 {  // 8 bf16 weights -> fp32 (exact: the bf16 bits are the fp32's high half)
  using W = uint16_t;
  static __m256 at(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
};

struct LoadF16 {  // 8 fp16 weights -> fp32 (F16C; exact)
  using W = uint16_t;
  static __m256 at(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};

inline __m256i avx2_mask(int64_t n) {  // lanes [0, n) of 8 set
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline void avx2_store(float* y, __m256 v, int64_t n) {  // y[0:n] = v[0:n], n in 0..8
  if (n >= 8)
    _mm256_storeu_ps(y, v);
  else if (n > 0)
    _mm256_maskstore_ps(y, avx2_mask(n), v);
}

inline __m256 avx2_load(const float* p, int64_t n) {  // p[0:n], zero past n
  return n >= 8 ? _mm256_loadu_ps(p) : n > 0 ? _mm256_maskload_ps(p, avx2_mask(n))
                                             : _mm256_setzero_ps();
}

// R rows x 16 columns from w (row stride GEMM_PANEL weights per k); `cols` (1..16) are stored.
template <int R, typename L>
inline void avx2_part(const float* x, int64_t ldx, const typename L::W* w, int64_t k_n,
                      const float* bias, float* y, int64_t ldy, int64_t cols, GemmAhead ahead) {
  __m256 a0[R], a1[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps();
  // Row pointers held in registers and the k loop unrolled by 4: the address arithmetic and
  // loop counter otherwise take issue slots on the FMA ports (6 x 16 tile, 2 threads, Intel
  // Xeon forced to AVX2: 0.76 -> 0.86 of the FMA peak at 64-186 rows; same bits).
  const float* xr[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) xr[r] = x + r * ldx;
#pragma GCC unroll 4
  for (int64_t k = 0; k < k_n; ++k) {
    const __m256 w0 = L::at(w + k * GEMM_PANEL), w1 = L::at(w + k * GEMM_PANEL + 8);
    gemm_prefetch(ahead, k);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xr[r] + k);
      a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
    }
  }
  const int64_t c0 = std::min<int64_t>(cols, 8), c1 = cols - c0;
  const __m256 b0 = bias ? avx2_load(bias, c0) : _mm256_setzero_ps();
  const __m256 b1 = bias ? avx2_load(bias + 8, c1) : _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    avx2_store(y + r * ldy, bias ? _mm256_add_ps(a0[r], b0) : a0[r], c0);
    avx2_store(y + r * ldy + 8, bias ? _mm256_add_ps(a1[r], b1) : a1[r], c1);
  }
}

// gemm.h's GemmTile for R = 1..6 rows over a 32-column panel of L's weights.
template <int R, typename L>
inline void avx2_tile(const float* x, int64_t ldx, const typename L::W* w, int64_t k_n,
                      const float* bias, float* y, int64_t ldy, int64_t n_valid,
                      GemmAhead ahead) {
  static_assert(R >= 1 && R <= 6, "an AVX2 half-tile holds 2 R accumulators of 16 ymm");
  const GemmAhead half{ahead.base, ahead.step / 2};
  const GemmAhead second{ahead.base + half.step * k_n, ahead.step - half.step};
  avx2_part<R, L>(x, ldx, w, k_n, bias, y, ldy, std::min<int64_t>(n_valid, 16), half);
  if (n_valid > 16)
    avx2_part<R, L>(x, ldx, w + 16, k_n, bias ? bias + 16 : nullptr, y + 16, ldy,
                    std::min<int64_t>(n_valid - 16, 16), second);
}

}  // namespace pagedllm
#endif
