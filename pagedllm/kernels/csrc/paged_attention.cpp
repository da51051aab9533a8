// Paged attention on CPU (decode tokens and prefill chunks), reading K/V rows in place through
// the block table.
//
// One work item = (request r, up to 16 of its query tokens, kv heads [h0, h1)): all of r's kv
// heads unless there are fewer items than threads. Query token t at position pos attends
// [lo, pos] (lo = pos + 1 - window with a sliding window, else 0); an item walks the union of
// its tokens' ranges in tiles of TILE positions, and for each kv head h: points at the tile's K
// rows (fp32 / fp16 / bf16 rows are read where they lie and widened in registers; int8 / fp8
// rows are converted, times their scale, into an fp32 buffer that stays in L1), scores them
// against the item's query rows of h (tokens x G = Hq / Hkv query heads, attention_tile.h),
// updates each row's online softmax over the positions it may attend (running max m, sum l,
// fp32 accumulator rescaled by exp(m_old - m_new)), then accumulates the tile's V rows.
//
//   position p of request r:  block = block_tables[r, p / block_size], offset = p % block_size
//   K row (p, h) = k_cache[block, offset, h, :]   (strides from the tensor; last dim contiguous)
//
// Work items are claimed by at::parallel_for threads one at a time, costliest (positions read x
// query rows) first, so a batch of ragged lengths or a late thread does not leave one idle.
// Each item's arithmetic does not depend on who runs it: the output has the same bits at any
// thread count.
//
// Nor, for one query row, on the rest of the batch: items split query tokens and heads, never a
// row's positions; a row's sums run over its own positions in tile order, and the positions of
// a tile it may not attend add exact zeros. So a row's bits depend on the tiles' grid alone.
// Without a sliding window every item's tiles start at position 0: the same bits whether the
// prompt ran in one chunk or many, beside any requests, or after a prefix-cache hit. With a
// window an item's tiles start where its first token's window does, unless fixed_tiles puts
// them on the grid of multiples of TILE (batch-invariant mode; up to TILE - 1 positions more
// read per item).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "attention_tile.h"
#include "common.h"

namespace pagedllm {
namespace {

struct CacheView {  // one layer's K or V cache, as raw bytes and element strides
  const char* data;
  int64_t elem;
  Kind kind;
  int64_t s_block, s_off, s_head;
  const uint16_t* scale;  // bf16 bits [num_blocks, block_size, Hkv], or null (unquantized)
  int64_t c_block, c_off, c_head;
};

CacheView view_of(const at::Tensor& cache, const std::optional<at::Tensor>& scale,
                  const char* name) {
  TORCH_CHECK(cache.dim() == 4 && cache.stride(3) == 1, name,
              " cache must be [num_blocks, block_size, Hkv, D] with a contiguous last dim");
  CacheView v{static_cast<const char*>(cache.data_ptr()), cache.element_size(),
              kind_of(cache.scalar_type(), name), cache.stride(0), cache.stride(1),
              cache.stride(2), nullptr, 0, 0, 0};
  bool quantized = v.kind == Kind::I8 || v.kind == Kind::E4M3 || v.kind == Kind::E5M2;
  TORCH_CHECK(quantized == scale.has_value(), name,
              quantized ? " cache is int8/fp8 and needs its scales"
                        : " cache is not quantized but scales were given");
  if (quantized) {
    const at::Tensor& s = *scale;
    TORCH_CHECK(s.scalar_type() == at::kBFloat16 && s.dim() == 3 && s.size(0) == cache.size(0) &&
                    s.size(1) == cache.size(1) && s.size(2) == cache.size(2),
                name, " scales must be bf16 [num_blocks, block_size, Hkv]");
    v.scale = static_cast<const uint16_t*>(s.data_ptr());
    v.c_block = s.stride(0);
    v.c_off = s.stride(1);
    v.c_head = s.stride(2);
  }
  return v;
}

// The element type the tile loops read a cache's rows in: its own, or fp32 for int8 / fp8
// (converted by tile_rows).
Kind row_kind(Kind k) { return k == Kind::F16 || k == Kind::BF16 ? k : Kind::F32; }

// One cache's (K's or V's) rows in the tile: byte offsets of its positions' rows of kv head 0
// and (int8 / fp8 caches) the indices of their scales, filled once per tile (`place`); then,
// per head, the row pointers the loops read, with the rows' scales (int8 / fp8 loops) or the
// rows converted into `buf`.
struct TileSide {
  std::vector<int64_t> at, st;
  std::vector<const void*> rows;
  std::vector<float> sc, buf;
  explicit TileSide(int64_t d) : at(TILE), st(TILE), rows(TILE), sc(TILE), buf(TILE * d) {}
  void place(const CacheView& c, int64_t i, int64_t blk, int64_t off) {
    at[i] = (blk * c.s_block + off * c.s_off) * c.elem;
    if (c.scale) st[i] = blk * c.c_block + off * c.c_off;
  }
};

struct Scratch {
  std::vector<float> q, acc, m, l, p, zero;
  std::vector<c10::BFloat16> qb;  // q unscaled, for the bf16 scores loop
  TileSide k, v;
  Scratch(int64_t heads, int64_t d)
      : q(heads * d), acc(heads * d), m(heads), l(heads), p(heads * TILE), zero(d), qb(heads * d),
        k(d), v(d) {}
};

// Row pointers of head h at the tile's n positions (then zero rows up to n16): into the cache
// for fp32 / fp16 / bf16, else converted (and scaled) into t.buf.
// (The vectors' data are read into locals: a store through t.rows may alias their pointers.)
void tile_rows(const CacheView& c, TileSide& t, const float* zero, int64_t n, int64_t n16,
               int64_t h, int64_t d) {
  const char* head = c.data + h * c.s_head * c.elem;
  const int64_t *at = t.at.data(), *st = t.st.data();
  const void** rows = t.rows.data();
  if (!c.scale) {
    for (int64_t i = 0; i < n; ++i) rows[i] = head + at[i];
  } else {
    const uint16_t* scale = c.scale + h * c.c_head;
    for (int64_t i = 0; i < n; ++i) {
      float* row = t.buf.data() + i * d;
      to_float(c.kind, head + at[i], bf16_to_float(scale[st[i]]), row, d);
      rows[i] = row;
    }
  }
  for (int64_t i = n; i < n16; ++i) rows[i] = zero;
}

// tile_rows for the int8 / fp8 loops (QScoresFn / QValuesFn): the rows as stored and their
// scales (zero rows scaled by 0 past n); e4m3 scales times 256, exactly (attention_tile.h row8).
void tile_rows_q(const CacheView& c, TileSide& t, const float* zero, int64_t n, int64_t n16,
                 int64_t h) {
  const float unit = c.kind == Kind::E4M3 ? 256.0f : 1.0f;
  const char* head = c.data + h * c.s_head * c.elem;
  const uint16_t* scale = c.scale + h * c.c_head;
  const int64_t *at = t.at.data(), *st = t.st.data();
  const void** rows = t.rows.data();
  float* sc = t.sc.data();
  for (int64_t i = 0; i < n; ++i) {
    rows[i] = head + at[i];
    sc[i] = bf16_to_float(scale[st[i]]) * unit;
  }
  for (int64_t i = n; i < n16; ++i) rows[i] = zero, sc[i] = 0.0f;
}

// Ask for the K or V rows of heads [h0, h1) at positions [p0, p1) of a request (its block
// table `table`) to be brought into cache: the next tile's, issued before this one's arithmetic,
// since its blocks lie anywhere in the pool and no hardware prefetcher can guess them.
void prefetch_rows(const CacheView& c, const int32_t* table, int64_t block_size, int64_t p0,
                   int64_t p1, int64_t h0, int64_t h1, int64_t d) {
  const int64_t bytes = ((h1 - h0 - 1) * c.s_head + d) * c.elem;  // heads h0..h1-1 of one slot
  for (int64_t p = p0, bi = p0 / block_size, off = p0 % block_size; p < p1; ++p) {
    const char* row = c.data + (table[bi] * c.s_block + off * c.s_off + h0 * c.s_head) * c.elem;
    for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(row + b, 0, 3);
    if (++off == block_size) off = 0, ++bi;
  }
}

struct Problem {
  const at::Tensor& q;
  at::Tensor& out;
  CacheView k, v;
  const int32_t* tables;
  int64_t table_stride, block_size, group, d;
  float scale;
  std::optional<int64_t> window;
  bool fixed_tiles;  // tiles start at multiples of TILE (batch-invariant mode)
  Kind q_kind, out_kind;
  bool q_bf16;  // scores take q as bf16, unscaled (dpbf16_scores)
  ScoresFn scores;
  ValuesFn values;
  QScoresFn qscores;  // int8 / fp8 K / V rows read as stored (null: converted by tile_rows)
  QValuesFn qvalues;
};

// One work item: query tokens [t0, t1) of request r (token t at position base + t, query row
// row0 + t), kv heads [h0, h1).
struct Item {
  int64_t r, row0, base, t0, t1, h0, h1;
};

// Positions token t may attend: [lo, base + t + 1), lo = 0 or the window's first.
int64_t first_pos(const Problem& pb, int64_t pos) {
  return pb.window ? std::max<int64_t>(0, pos + 1 - *pb.window) : 0;
}

// The out rows of item `it`. Scratch row of (kv head h, token t, group member g) is
// ((h - h0) * nt + (t - t0)) * group + g: each kv head's query rows are one block, scored
// together against its K rows. Query head h * group + g is HF's repeat_kv order.
void attend(const Problem& pb, Scratch& s, const Item& it) {
  const int64_t d = pb.d, gn = pb.group, nt = it.t1 - it.t0, rows = nt * gn;
  const int64_t nq = (it.h1 - it.h0) * rows;
  for (int64_t j = 0; j < nq; ++j) {  // q pre-scaled by the softmax scale, in fp32 (or bf16 as is)
    const int64_t hg = it.h0 * gn + j / rows * gn + j % gn, t = it.t0 + j % rows / gn;
    const char* src = static_cast<const char*>(pb.q.data_ptr()) +
                      ((it.row0 + t) * pb.q.stride(0) + hg * pb.q.stride(1)) * pb.q.element_size();
    if (pb.q_bf16)
      std::memcpy(s.qb.data() + j * d, src, d * sizeof(c10::BFloat16));
    else
      to_float(pb.q_kind, src, pb.scale, s.q.data() + j * d, d);
    s.m[j] = -1e30f;  // finite: exp(m_old - m_new) underflows to 0 on the first tile
    s.l[j] = 0.0f;
  }
  std::fill(s.acc.begin(), s.acc.begin() + nq * d, 0.0f);
  const int32_t* table = pb.tables + it.r * pb.table_stride;
  // Tiles start at the item's first position, or, with fixed_tiles, on the grid of multiples
  // of TILE from position 0 (what an item's first token may attend then depends on the item:
  // on the grid, a row's tiles, its softmax updates and its sums are the same in any item).
  const int64_t first = first_pos(pb, it.base + it.t0), hi = it.base + it.t1;
  const int64_t lo = pb.fixed_tiles ? first / TILE * TILE : first;
  for (int64_t p0 = lo; p0 < hi; p0 += TILE) {
    const int64_t n = std::min(TILE, hi - p0), n16 = (n + 15) / 16 * 16;
    for (int64_t i = 0, bi = p0 / pb.block_size, off = p0 % pb.block_size; i < n; ++i) {
      const int64_t blk = table[bi];
      s.k.place(pb.k, i, blk, off);
      s.v.place(pb.v, i, blk, off);
      if (++off == pb.block_size) off = 0, ++bi;
    }
    const int64_t p1 = std::min(hi, p0 + 2 * TILE);
    prefetch_rows(pb.k, table, pb.block_size, p0 + n, p1, it.h0, it.h1, d);
    prefetch_rows(pb.v, table, pb.block_size, p0 + n, p1, it.h0, it.h1, d);
    for (int64_t h = it.h0; h < it.h1; ++h) {
      const int64_t j0 = (h - it.h0) * rows;
      float *pj0 = s.p.data() + j0 * TILE, *acc = s.acc.data() + j0 * d;
      const void* qj = pb.q_bf16 ? static_cast<const void*>(s.qb.data() + j0 * d)
                                 : static_cast<const void*>(s.q.data() + j0 * d);
      if (pb.qscores) {
        tile_rows_q(pb.k, s.k, s.zero.data(), n, n16, h);
        pb.qscores(s.q.data() + j0 * d, rows, s.k.rows.data(), s.k.sc.data(), n16, pj0);
      } else {
        tile_rows(pb.k, s.k, s.zero.data(), n, n16, h, d);
        pb.scores(qj, pb.scale, rows, d, s.k.rows.data(), n16, pj0);
      }
      for (int64_t j = j0; j < j0 + rows; ++j) {  // online softmax over the tile's positions
        float* pj = s.p.data() + j * TILE;    // [a, b) this token may attend (causal, window)
        const int64_t pos = it.base + it.t0 + (j - j0) / gn;
        const int64_t a = std::max<int64_t>(0, first_pos(pb, pos) - p0);
        const int64_t b = std::min(n, pos + 1 - p0);
        if (a >= b) {  // nothing here for this row: it keeps its state
          std::fill(pj, pj + n16, 0.0f);
          continue;
        }
        float *x = pj + a, mx = s.m[j], sum = 0.0f;
        const int64_t m = b - a;
        mx = max_from(x, m, mx);
#pragma omp simd reduction(+ : sum)
        for (int64_t i = 0; i < m; ++i) {
          x[i] = exp_approx(x[i] - mx);
          sum += x[i];
        }
        std::fill(pj, pj + a, 0.0f);
        std::fill(pj + b, pj + n16, 0.0f);
        float alpha = exp_approx(s.m[j] - mx);
        s.l[j] = s.l[j] * alpha + sum;
        s.m[j] = mx;
        if (alpha != 1.0f) scale_row(s.acc.data() + j * d, alpha, d);
      }
      if (pb.qvalues) {
        tile_rows_q(pb.v, s.v, s.zero.data(), n, n16, h);
        pb.qvalues(acc, rows, pj0, s.v.rows.data(), s.v.sc.data(), n16);
      } else {
        tile_rows(pb.v, s.v, s.zero.data(), n, n16, h, d);
        pb.values(acc, rows, d, pj0, s.v.rows.data(), n16);
      }
    }
  }
  for (int64_t j = 0; j < nq; ++j) {
    const int64_t hg = it.h0 * gn + j / rows * gn + j % gn, t = it.t0 + j % rows / gn;
    char* dst = static_cast<char*>(pb.out.data_ptr()) +
                ((it.row0 + t) * pb.out.stride(0) + hg * pb.out.stride(1)) * pb.out.element_size();
    from_float(pb.out_kind, s.acc.data() + j * d, 1.0f / s.l[j], dst, d);
  }
}

}  // namespace

// Attention for every request with at most max_query_len query tokens (the last ones of its
// sequence, causal; 1 = decode only); rows of other requests are left untouched in out.
void paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                     const std::optional<at::Tensor>& k_scale, const at::Tensor& v_cache,
                     const std::optional<at::Tensor>& v_scale, const at::Tensor& block_tables,
                     const at::Tensor& seq_lens, const at::Tensor& query_start_loc, at::Tensor out,
                     double scale, std::optional<int64_t> sliding_window, int64_t max_query_len,
                     bool fixed_tiles) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_attention runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [T, Hq, D], contiguous last dim");
  TORCH_CHECK(out.sizes() == q.sizes() && out.stride(2) == 1 && out.scalar_type() == q.scalar_type(),
              "out must be like q");
  const Kind q_kind = kind_of(q.scalar_type(), "q");
  TORCH_CHECK(q_kind == Kind::F32 || q_kind == Kind::F16 || q_kind == Kind::BF16,
              "q must be fp32, fp16 or bf16");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes(), "k_cache and v_cache shapes differ");
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3), hq = q.size(1);
  TORCH_CHECK(q.size(2) == d && hq % hkv == 0, "q heads/dim do not fit the cache's");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1 && t->device().is_cpu(),
                "block_tables, seq_lens, query_start_loc must be int32 CPU tensors with a "
                "contiguous last dim");
  const int64_t num_reqs = seq_lens.size(0);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= num_reqs &&
                  query_start_loc.size(0) == num_reqs + 1,
              "block_tables [B, max_blocks], query_start_loc [B + 1] for seq_lens [B]");
  TORCH_CHECK(!sliding_window.has_value() || *sliding_window >= 1, "sliding_window must be >= 1");
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  const CacheView kv = view_of(k_cache, k_scale, "k"), vv = view_of(v_cache, v_scale, "v");
  const bool q_bf16 = q_kind == Kind::BF16 && dpbf16_scores(row_kind(kv.kind), d);
  Problem pb{q, out, kv, vv, block_tables.data_ptr<int32_t>(), block_tables.stride(0), block_size,
             hq / hkv, d, static_cast<float>(scale), sliding_window, fixed_tiles, q_kind, q_kind,
             q_bf16,
             scores_fn(row_kind(kv.kind), d, q_bf16), values_fn(row_kind(vv.kind), d),
             qscores_fn(kv.kind, d), qvalues_fn(vv.kind, d)};

  // Work items: (request, QCHUNK of its query tokens), all kv heads in one item (its K/V rows
  // read in address order) unless there are fewer such items than threads.
  constexpr int64_t QCHUNK = 16;
  std::vector<Item> chunks;
  for (int64_t r = 0; r < num_reqs; ++r) {
    const int64_t nt = qsl[r + 1] - qsl[r], len = lens[r];
    if (nt < 1 || nt > max_query_len) continue;
    TORCH_CHECK(len >= nt && len <= max_blocks * block_size, "seq_lens[", r, "] = ", len,
                " does not fit its block table or its ", nt, " query tokens");
    for (int64_t t0 = 0; t0 < nt; t0 += QCHUNK)
      chunks.push_back({r, qsl[r], len - nt, t0, std::min(nt, t0 + QCHUNK), 0, hkv});
  }
  if (chunks.empty()) return;
  const int64_t threads = at::get_num_threads(), nc = static_cast<int64_t>(chunks.size());
  const int64_t splits = std::min(hkv, (threads + nc - 1) / nc), per = (hkv + splits - 1) / splits;
  std::vector<Item> items;
  std::vector<int64_t> cost;  // (positions read + an overhead) x query rows
  for (const Item& c : chunks)
    for (int64_t h0 = 0; h0 < hkv; h0 += per) {
      items.push_back({c.r, c.row0, c.base, c.t0, c.t1, h0, std::min(hkv, h0 + per)});
      const int64_t span = c.base + c.t1 - first_pos(pb, c.base + c.t0);
      cost.push_back((span + 16) * (c.t1 - c.t0) * per);
    }
  const int64_t n_items = static_cast<int64_t>(items.size());
  int64_t max_tokens = 1;  // per item: scratch for that many query tokens, no more
  for (const Item& c : chunks) max_tokens = std::max(max_tokens, c.t1 - c.t0);
  const int64_t max_rows = per * pb.group * max_tokens;
  // Items claimed one at a time, costliest first, by whichever thread is free: a thread that
  // starts late (woken from sleep, or kept off its core by another process) takes less work
  // instead of holding up the others at the end of the region.
  std::vector<int64_t> order(n_items);
  for (int64_t i = 0; i < n_items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return cost[a] > cost[b];
  });
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, n_items), 1, [&](int64_t, int64_t) {
    Scratch s(max_rows, d);
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n_items;)
      attend(pb, s, items[order[i]]);
  });
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "paged_attention(Tensor q, Tensor k_cache, Tensor? k_scale, Tensor v_cache, Tensor? v_scale, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor(a!) out, float scale, "
      "int? sliding_window, int max_query_len, bool fixed_tiles=False) -> ()",
      &pagedllm::paged_attention);
}
