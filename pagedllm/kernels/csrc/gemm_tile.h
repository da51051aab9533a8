// The GEMM's register tile for the ISA this build targets, on float32 x and panels of weights of
// element type L::W (gemm.cpp: float32; gemm_w16.cpp: bf16 / fp16 widened to fp32 on load).
// One dispatch for both GEMMs: `WeightF32` / `WeightBF16` / `WeightF16` name the weight format,
// and each ISA maps it to its own loader (AVX-512: 16 lanes, gemm_avx512.h; AVX2 + FMA: 8 lanes,
// gemm_avx2.h; otherwise plain loops). Every path sums each output in k order, then + bias, so
// all of them give the same bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "gemm.h"
#include "gemm_avx2.h"
#include "gemm_avx512.h"

namespace pagedllm {

#if defined(__AVX512F__)
using WeightF32 = Load16F32;
using WeightBF16 = Load16BF16;
using WeightF16 = Load16F16;
template <int R, typename L>
inline void gemm_tile(const float* x, int64_t ldx, const typename L::W* w, int64_t k_n,
                      const float* bias, float* y, int64_t ldy, int64_t n_valid,
                      GemmAhead ahead) {
  avx512_tile<R, L>(x, ldx, w, k_n, bias, y, ldy, n_valid, ahead);
}
#elif defined(__AVX2__) && defined(__FMA__)
using WeightF32 = LoadF32;
using WeightBF16 = LoadBF16;
using WeightF16 = LoadF16;
template <int R, typename L>
inline void gemm_tile(const float* x, int64_t ldx, const typename L::W* w, int64_t k_n,
                      const float* bias, float* y, int64_t ldy, int64_t n_valid,
                      GemmAhead ahead) {
  avx2_tile<R, L>(x, ldx, w, k_n, bias, y, ldy, n_valid, ahead);
}
#else
struct WeightF32 {
  using W = float;
  static float at(float v) { return v; }
};
struct WeightBF16 {
  using W = uint16_t;
  static float at(uint16_t v) { return c10::BFloat16(v, c10::BFloat16::from_bits()); }
};
struct WeightF16 {
  using W = uint16_t;
  static float at(uint16_t v) { return c10::Half(v, c10::Half::from_bits()); }
};
template <int R, typename L>
inline void gemm_tile(const float* x, int64_t ldx, const typename L::W* w, int64_t k_n,
                      const float* bias, float* y, int64_t ldy, int64_t n_valid, GemmAhead) {
  constexpr int64_t P = GEMM_PANEL;
  float acc[R][P] = {};
  for (int64_t k = 0; k < k_n; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int64_t j = 0; j < P; ++j) acc[r][j] += xv * L::at(w[k * P + j]);
    }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n_valid; ++j) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.0f);
}
#endif

// gemm_panels' table: GEMM_TILES<L>[R] is the tile of R rows, R = 1..GEMM_MR.
template <typename L>
constexpr GemmTile<float, typename L::W> GEMM_TILES[GEMM_MR + 1] = {
    nullptr,           gemm_tile<1, L>, gemm_tile<2, L>, gemm_tile<3, L>, gemm_tile<4, L>,
    gemm_tile<5, L>, gemm_tile<6, L>, gemm_tile<7, L>, gemm_tile<8, L>};

}  // namespace pagedllm
