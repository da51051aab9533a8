// gemm.cpp's float32 and gemm_bf16.cpp's bfloat16 GEMM on a packed weight, for the ops that
// call them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace pagedllm {

constexpr int64_t GEMM_PANEL = 32;  // output columns per packed panel
// under this many multiply-adds a call stays on the calling thread (gemm_panels' min_macs)
constexpr int64_t GEMM_PARALLEL_MIN_MACS = 1 << 20;
// How gemm_panels walks x: `chunk` rows at a time pass over a thread's panels (they stay in L2
// meanwhile; m rows are cut into chunks of equal size, not full chunks and a remainder: a small
// last chunk streams every panel again for few rows), each chunk cut into register tiles of
// equal height, at most `tile` rows (9 rows at 8: 4 + 5, not 8 + 1: a 1-row tile waits on its
// two accumulators' FMA latency for as long as a full tile computes). The heights change no
// output's bits (each is one FMA chain in k order).
struct GemmRows {
  int tile;
  int64_t chunk;
};
// gemm_bf16.cpp's rows: 8-row tiles (16 zmm accumulators for 8 x 32), chunks of 64 rows
constexpr int GEMM_MR = 8;
constexpr GemmRows GEMM_ROWS_BF16{GEMM_MR, 64};

// The share of the thread's next panel one register tile fetches while it computes: from
// `base`, `step` bytes per iteration of the tile's k loop (at most 128, rounded up: the share's
// end may be fetched twice, or a line past it).
struct GemmAhead {
  const char* base;
  int64_t step;
};

// Whether a call of `macs` multiply-adds on `weight_bytes` of weights stays on the calling
// thread: few multiply-adds, and a weight small enough to come from cache. A decode step's
// weight comes from memory, where one core streams at about half the machine's rate (125M model,
// 1 row: qkv and o_proj are under 2^20 multiply-adds but 2.4-3.9 MB; on one thread they took
// twice as long as on two).
constexpr int64_t GEMM_PARALLEL_MIN_BYTES = 1 << 20;
inline bool gemm_serial(int64_t macs, int64_t weight_bytes, int64_t min_macs) {
  return macs < min_macs && weight_bytes < GEMM_PARALLEL_MIN_BYTES;
}

// The weight the call after this one reads (decoder_layer.cpp: the layer's next linear), so that
// each thread's last panel fetches, in place of a panel of its own, the first panel that thread
// computes in that call: the next call then starts on weights in cache instead of waiting for
// memory until the hardware prefetchers catch up (a decode step makes ~4 GEMM calls a layer).
// Empty (base null): no call follows, or it is not known.
struct GemmNext {
  const char* base = nullptr;
  int64_t panels = 0, panel_bytes = 0;
  bool parallel = false;  // whether that call splits its panels over the threads

  // where thread `tid` of `threads` starts in that call; null where it computes nothing there
  const char* start(int64_t tid, int64_t threads) const {
    if (base == nullptr || panels <= 0) return nullptr;
    const int64_t used = parallel ? std::min(threads, panels) : 1;
    const int64_t first = tid * ((panels + used - 1) / used);
    return tid < used && first < panels ? base + first * panel_bytes : nullptr;
  }
};

// GemmNext for a packed weight (any of the GEMMs' [panels, ...] layouts) read by a call of m
// rows; empty where `packed` is not one (a oneDNN weight) or absent.
inline GemmNext gemm_next(const std::optional<at::Tensor>& packed, int64_t m, int64_t min_macs) {
  if (!packed.has_value() || packed->dim() != 3 || !packed->is_contiguous() ||
      packed->size(0) == 0)
    return {};
  const int64_t panels = packed->size(0);
  return {static_cast<const char*>(packed->data_ptr()), panels, packed->nbytes() / panels,
          !gemm_serial(m * packed->numel(), packed->nbytes(), min_macs)};
}

// The lines of `ahead` for iteration i of a tile's k loop: the share is spread evenly over it,
// two fetches half a step apart (a step is at most two lines). The address is a byte offset
// that the k loop advances by one add: it was a 16.16 line count shifted back into bytes, two
// shifts per fetch, and shifts issue on port 0, one of the FMA ports (1.03-1.07x, AVX-512 GEMM
// at 186 rows, Intel Xeon, 2 threads; same bits: fetches only). Locality 1 (toward outer caches: a
// panel of the next call is larger than L1); 3 and 1 measured within noise on 125M decode.
inline void gemm_prefetch(GemmAhead ahead, int64_t i) {
  const char* at = ahead.base + i * ahead.step;
  __builtin_prefetch(at, 0, 1);
  __builtin_prefetch(at + ahead.step / 2, 0, 1);
}

// How a GEMM packs rows for its tiles before they read them: src[0:h] (row stride ldx) of k
// values -> dst[kk * h + r] (gemm_tile.h's gemm_pack_rows); null: the tiles read x in place.
template <typename T>
using GemmPack = void (*)(const T* src, int64_t ldx, int64_t h, int64_t k, T* dst);

// One register tile: rows x[0:R] times a panel of k_n values per column -> y[0:R, 0:n_valid]
// (row stride ldy), plus bias[0:n_valid] where bias is not null, fetching its share of the next
// panel (gemm_prefetch; the tile may ignore it). Row r's k-th value is x[r * ldx + k] where
// gemm_panels runs without a GemmPack, else x[k * R + r] (packed; ldx is then R).
// W: the panel's element type where it differs from x's (gemm_w16.cpp: 16-bit weights, fp32 x).
template <typename T, typename W = T>
using GemmTile = void (*)(const T* x, int64_t ldx, const W* panel, int64_t k_n, const T* bias,
                          T* y, int64_t ldy, int64_t n_valid, GemmAhead ahead);

// The loop both GEMMs share: y[m, n] from x[m, k] (row stride ldx) and panels of panel_size
// elements, iter_bytes of panel per iteration of a tile's k loop (fp32: 128, one k; bf16: 128,
// a k pair; gemm_w16.cpp's 16-bit weights: 64, one k); x's rows walked as `rows_of` says.
// Panels are split over the threads (each thread's panels stay in its L1/L2 while it walks all
// M rows, and no thread waits on another's rows); calls under min_macs multiply-adds stay on
// the calling thread, where waking the others costs more than they save. tiles[R] is the tile
// of R rows, R = 1..rows_of.tile. With `pack`, each thread first packs a chunk's rows, tile by
// tile, into a buffer of its own (a chunk's packing is a few % of its FMAs; one buffer for both
// threads put half of it in the other core's cache). At decode rows the weight comes from
// memory, so while a panel is computed its tiles fetch the thread's next panel, each tile an
// equal share: the fetch then spans the whole panel's compute, not only its first tile's (125M
// decode step, 15 rows: 1.2x).
template <typename T, typename W = T>
void gemm_panels(const T* x, int64_t ldx, const W* w, int64_t panel_size, const T* bias, T* y,
                 int64_t m, int64_t n, int64_t k, const GemmTile<T, W>* tiles, int64_t min_macs,
                 GemmRows rows_of, GemmPack<T> pack, int64_t iter_bytes = 128,
                 GemmNext after = {}) {
  const int64_t panels = (n + GEMM_PANEL - 1) / GEMM_PANEL;
  const int64_t bytes = panel_size * static_cast<int64_t>(sizeof(W));
  const int64_t grain = gemm_serial(m * n * k, panels * bytes, min_macs) ? panels : 1;
  const int64_t lines = bytes / 64, iters = bytes / iter_bytes;
  const int64_t threads = grain == 1 ? at::get_num_threads() : 1;
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    const char* then = after.start(at::get_thread_num(), threads);  // the next call's first panel
    static thread_local std::vector<T> xp;  // this thread's packed rows of the chunk
    const int64_t chunks = (m + rows_of.chunk - 1) / rows_of.chunk;
    for (int64_t c = 0; c < chunks; ++c) {  // these rows of x stay in L2
      const int64_t r0 = m * c / chunks, rows = m * (c + 1) / chunks - r0;
      const int64_t count = (rows + rows_of.tile - 1) / rows_of.tile;
      // one row packed is the row itself (x[k * 1 + 0]): a 1-row decode call copies nothing
      const bool packs = pack != nullptr && rows > 1;
      if (packs) {
        if (static_cast<int64_t>(xp.size()) < rows * k) xp.resize(rows * k);
        for (int64_t t = 0; t < count; ++t) {
          const int64_t s0 = rows * t / count, h = rows * (t + 1) / count - s0;
          pack(x + (r0 + s0) * ldx, ldx, h, k, xp.data() + s0 * k);
        }
      }
      // after the thread's last panel: its first again for the next rows, else the next call's
      const char* wrap = reinterpret_cast<const char*>(w + p0 * panel_size);
      if (c + 1 == chunks && then != nullptr) wrap = then;
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t col = p * GEMM_PANEL, n_valid = std::min(GEMM_PANEL, n - col);
        const W* panel = w + p * panel_size;
        const char* next = p + 1 < p1 ? reinterpret_cast<const char*>(panel + panel_size) : wrap;
        for (int64_t t = 0; t < count; ++t) {
          const int64_t s0 = rows * t / count, height = rows * (t + 1) / count - s0;
          const int64_t l0 = lines * t / count, l1 = lines * (t + 1) / count;
          const int64_t span = (l1 - l0) * 64, its = std::max<int64_t>(iters, 1);
          const GemmAhead ahead{next + l0 * 64, (span + its - 1) / its};
          const T* xt = packs ? xp.data() + s0 * k : x + (r0 + s0) * ldx;
          tiles[height](xt, packs ? height : ldx, panel, k, bias ? bias + col : nullptr,
                        y + (r0 + s0) * n + col, n, n_valid, ahead);
        }
      }
    }
  });
}

at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias, GemmNext after = {});

bool gemm_vectorized();
bool gemm_bf16_vectorized();
at::Tensor pack_gemm_weight_w16(const at::Tensor& w);
at::Tensor gemm_packed_w16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const std::optional<at::Tensor>& bias, GemmNext after = {});
at::Tensor pack_gemm_weight_bf16(const at::Tensor& w);
at::Tensor gemm_packed_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const std::optional<at::Tensor>& bias, GemmNext after = {});

}  // namespace pagedllm
