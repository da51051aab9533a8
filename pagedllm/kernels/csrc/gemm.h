// gemm.cpp's float32 and gemm_bf16.cpp's bfloat16 GEMM on a packed weight, for the ops that
// call them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <optional>

namespace pagedllm {

constexpr int64_t GEMM_PANEL = 32;  // output columns per packed panel
// under this many multiply-adds a call stays on the calling thread (gemm_panels' min_macs)
constexpr int64_t GEMM_PARALLEL_MIN_MACS = 1 << 20;
constexpr int GEMM_MR = 8;          // rows per register tile
constexpr int64_t GEMM_M_CHUNK = 64;  // rows of x walked over a thread's panels at a time

// One register tile: rows x[0:R] (row stride ldx) times a panel of k_n values per column ->
// y[0:R, 0:n_valid] (row stride ldy), plus bias[0:n_valid] where bias is not null. ``ahead``:
// the panel to fetch into the cache while this one is computed (the tile may ignore it).
template <typename T>
using GemmTile = void (*)(const T* x, int64_t ldx, const T* panel, int64_t k_n, const T* bias,
                          T* y, int64_t ldy, int64_t n_valid, const T* ahead);

// The loop both GEMMs share: y[m, n] from x[m, k] (row stride ldx) and panels of panel_size
// elements. Panels are split over the threads (each thread's panels stay in its L1/L2 while it
// walks all M rows, and no thread waits on another's rows); calls under min_macs multiply-adds
// stay on the calling thread, where waking the others costs more than they save. tiles[R] is
// the tile of R rows, R = 1..GEMM_MR.
template <typename T>
void gemm_panels(const T* x, int64_t ldx, const T* w, int64_t panel_size, const T* bias, T* y,
                 int64_t m, int64_t n, int64_t k, const GemmTile<T>* tiles, int64_t min_macs) {
  const int64_t panels = (n + GEMM_PANEL - 1) / GEMM_PANEL;
  const int64_t grain = m * n * k < min_macs ? panels : 1;
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    for (int64_t r0 = 0; r0 < m; r0 += GEMM_M_CHUNK)  // these rows of x stay in L2
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col = p * GEMM_PANEL, n_valid = std::min(GEMM_PANEL, n - col);
        // the first tile over a panel fetches this thread's next one (a small M is otherwise
        // as long waiting for the weight as computing on it); the others re-fetch their own
        const T* panel = w + p * panel_size;
        const T* next = p + 1 < p1 ? panel + panel_size : panel;
        for (int64_t r = r0; r < std::min(m, r0 + GEMM_M_CHUNK); r += GEMM_MR) {
          const int64_t rows = std::min<int64_t>(GEMM_MR, m - r);
          tiles[rows](x + r * ldx, ldx, panel, k, bias ? bias + col : nullptr, y + r * n + col, n,
                      n_valid, r == r0 ? next : panel);
        }
      }
  });
}

at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias);

bool gemm_bf16_vectorized();
at::Tensor pack_gemm_weight_bf16(const at::Tensor& w);
at::Tensor gemm_packed_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const std::optional<at::Tensor>& bias);

}  // namespace pagedllm
