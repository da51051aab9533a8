// The GEMM's register tile for the ISA this build targets, on float32 x and panels of weights of
// element type L::W (gemm.cpp: float32; gemm_w16.cpp: bf16 / fp16 widened to fp32 on load).
// One dispatch for both GEMMs: `WeightF32` / `WeightBF16` / `WeightF16` name the weight format,
// and each ISA maps it to its own loader (AVX-512: 16 lanes, gemm_avx512.h; AVX2 + FMA: 8 lanes,
// gemm_avx2.h; otherwise plain loops). Every path sums each output in k order, then + bias, so
// all of them give the same bits.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "gemm.h"
#include "gemm_avx2.h"
#include "gemm_avx512.h"

namespace pagedllm {

#if defined(__AVX512F__)
using WeightF32 = Load16F32;
using WeightBF16 = Load16BF16;
using WeightF16 = Load16F16;
// x packed k-major per tile, so a tile's broadcasts read one stream at fixed offsets from one
// pointer: with x in place each row is a stream of its own (8 rows: 0.66-0.69 of the FMA peak
// at 64-188 rows, 2 threads, Intel Xeon), and twelve or more row pointers spill. Packed, the tile
// can be 14 rows (28 of the 32 zmm registers; the panel read once from L2 per 14 rows, not 8):
// 0.72-0.76 at 64-188 rows. Same bits: each output is the same FMA chain in k order.
constexpr int GEMM_MR_X32 = 14;
inline void gemm_pack_rows(const float* src, int64_t ldx, int64_t h, int64_t k, float* dst) {
  avx512_pack_rows(src, ldx, h, k, dst);
}
constexpr GemmPack<float> GEMM_PACK_X32 = gemm_pack_rows;
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

#if !defined(__AVX512F__)
// AVX2 and plain loops read x in place, in tiles of up to 6 rows (gemm_rows_x32 says why)
constexpr int GEMM_MR_X32 = 6;
constexpr GemmPack<float> GEMM_PACK_X32 = nullptr;
#endif

// gemm_panels' table: GEMM_TILES<L>[R] is the tile of R rows, R = 1..GEMM_MR_X32.
template <typename L, size_t... R>
constexpr std::array<GemmTile<float, typename L::W>, sizeof...(R) + 1> gemm_tile_table(
    std::index_sequence<R...>) {
  return {nullptr, gemm_tile<R + 1, L>...};
}
template <typename L>
constexpr auto GEMM_TILES = gemm_tile_table<L>(std::make_index_sequence<GEMM_MR_X32>{});

// How the float32-x GEMMs (gemm.cpp, gemm_w16.cpp) walk x's rows for a K of k. With x packed
// (AVX-512), tiles of 14 rows (28 zmm accumulators) and chunks of a quarter of L2 (512 KiB of x,
// 170 rows at K = 768). In place (AVX2 and plain loops), tiles of 6 rows and chunks of 64: AVX2's
// 16 ymm registers hold 6 x 16 of a panel's half (12 accumulators, gemm_avx2.h); 7- or 8-row
// tiles, cut into two parts of 3-4 rows that each read the panel again, kept too few FMA chains
// in flight to hide the FMA's latency and measured slower.
inline GemmRows gemm_rows_x32(int64_t k) {
  if (GEMM_PACK_X32 == nullptr) return {GEMM_MR_X32, 64};
  const int64_t fit = (int64_t{512} << 10) / (std::max<int64_t>(k, 1) * int64_t{sizeof(float)});
  return {GEMM_MR_X32, std::max<int64_t>(GEMM_MR_X32, fit)};
}

}  // namespace pagedllm
