// float32 linear layers on a weight packed once: y[M, N] = x[M, K] @ W[N, K]^T (+ bias).
//
// Why not oneDNN: at the rows a decode step runs (M = 1-64) and the widths of small models
// (K = 256-2048), oneDNN's per-call cost (primitive descriptor, memory descriptors, a scratch
// allocation) and its thread split are a large share of the call; this kernel has none of it.
//
// Layout: W is packed into panels of 32 output columns, K-major,
//
//     packed[p, k, j] = W[32 p + j, k]      (zero where 32 p + j >= N)   -> [ceil(N/32), K, 32]
//
// so a 32-column panel is one contiguous K x 128-byte strip. A tile of MR rows x 32 columns
// keeps its 2 * MR accumulators in zmm registers over the whole K loop: per k, two loads of
// the panel, MR broadcasts of x (on AVX-512 from rows packed k-major per tile, MR up to 14),
// 2 * MR FMAs. Panels are split over threads (each thread's panels stay in its L1/L2 while it
// walks all M rows); each output is one fp32 sum in k order.
// While a panel is computed its tiles prefetch the thread's next one (gemm_panels in gemm.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <algorithm>
#include <ctime>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gemm.h"
#include "gemm_tile.h"

namespace pagedllm {
namespace {

constexpr int64_t PANEL = GEMM_PANEL;

}  // namespace

// Whether the tiles are AVX-512 or AVX2+FMA code; elsewhere they are plain loops, slower than
// oneDNN.
bool gemm_vectorized() {
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  return true;
#else
  return false;
#endif
}

// The ISA of this build's vector code: "avx512", "avx2" or "generic".
std::string gemm_isa() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  return "avx2";
#else
  return "generic";
#endif
}

// The machine's peak fp32 multiply-add rate in GFLOP/s (2 flops per lane), for this build's
// vector width: every thread runs `iters` rounds of independent FMA chains on registers alone
// (no loads, no barrier, in a function of its own: a memory clobber in the loop, and then the loop
// inlined into the parallel region's lambda, kept the chains in memory or spilled them, and the
// loop measured 1/3-2/3 of the rate the GEMM itself reached; 16 chains on AVX-512's 32 zmm
// registers, 12 on AVX2's 16 ymm; either count covers an FMA's latency on two FMA ports; no
// fast-math, so every FMA runs), and the flops of all
// threads are divided by the slowest thread's CPU time (not wall time: on a shared machine a
// thread taken off its core would lower the peak, not the machine). The linears' GFLOP/s over
// this is the fraction of peak `pagedllm bench linear` reports.
double thread_seconds() {  // CPU time of the calling thread
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

#if defined(__AVX512F__)
using PeakV = __m512;
constexpr int PEAK_LANES = 16, PEAK_CHAINS = 16;
inline PeakV peak_fma(PeakV a, PeakV b, PeakV c) { return _mm512_fmadd_ps(a, b, c); }
inline PeakV peak_set(float v) { return _mm512_set1_ps(v); }
inline float peak_sum(PeakV v) { return _mm512_reduce_add_ps(v); }
inline PeakV peak_load(const float* p) { return _mm512_loadu_ps(p); }
inline PeakV peak_add(PeakV a, PeakV b) { return _mm512_add_ps(a, b); }
#elif defined(__AVX2__) && defined(__FMA__)
using PeakV = __m256;
constexpr int PEAK_LANES = 8, PEAK_CHAINS = 12;
inline PeakV peak_fma(PeakV a, PeakV b, PeakV c) { return _mm256_fmadd_ps(a, b, c); }
inline PeakV peak_set(float v) { return _mm256_set1_ps(v); }
inline float peak_sum(PeakV v) {
  float t[8];
  _mm256_storeu_ps(t, v);
  return t[0] + t[1] + t[2] + t[3] + t[4] + t[5] + t[6] + t[7];
}
inline PeakV peak_load(const float* p) { return _mm256_loadu_ps(p); }
inline PeakV peak_add(PeakV a, PeakV b) { return _mm256_add_ps(a, b); }
#else
using PeakV = float;
constexpr int PEAK_LANES = 1, PEAK_CHAINS = 16;
inline PeakV peak_fma(PeakV a, PeakV b, PeakV c) { return a * b + c; }
inline PeakV peak_set(float v) { return v; }
inline float peak_sum(PeakV v) { return v; }
inline PeakV peak_load(const float* p) { return *p; }
inline PeakV peak_add(PeakV a, PeakV b) { return a + b; }
#endif

// One thread's share of gemm_fma_peak: the CPU seconds of `iters` rounds of PEAK_CHAINS FMAs,
// and their sum in `sink` (used, so the loop is kept).
__attribute__((noinline)) double peak_rounds(int64_t iters, float* sink) {
  PeakV acc[PEAK_CHAINS];
  for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = peak_set(0.001f * c);
  const PeakV a = peak_set(0.999999f), b = peak_set(1e-7f);
  const double start = thread_seconds();
  for (int64_t i = 0; i < iters; ++i) {
#pragma GCC unroll 16
    for (int c = 0; c < PEAK_CHAINS; ++c) acc[c] = peak_fma(acc[c], a, b);
  }
  const double seconds = thread_seconds() - start;
  PeakV s = acc[0];
  for (int c = 1; c < PEAK_CHAINS; ++c) s = peak_fma(s, a, acc[c]);
  *sink = peak_sum(s);
  return seconds;
}

double gemm_fma_peak(int64_t iters) {
  const int threads = at::get_num_threads();
  std::vector<double> seconds(threads, 0.0);
  std::vector<float> sink(threads, 0.0f);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) seconds[t] = peak_rounds(iters, &sink[t]);
  });
  const double slowest = *std::max_element(seconds.begin(), seconds.end());
  const double flops = 2.0 * PEAK_LANES * PEAK_CHAINS * static_cast<double>(iters) * threads;
  return sink[0] == 12345.0f ? 0.0 : flops / std::max(slowest, 1e-9) / 1e9;
}

// One thread's share of gemm_read_bandwidth: the CPU seconds to read p[0:n] once with vector
// loads (4 independent sums, so the adds never wait on each other), the sum in `sink`.
__attribute__((noinline)) double read_once(const float* p, int64_t n, float* sink) {
  constexpr int64_t STEP = 4 * PEAK_LANES;
  PeakV acc[4] = {peak_set(0.0f), peak_set(0.0f), peak_set(0.0f), peak_set(0.0f)};
  const double start = thread_seconds();
  for (int64_t i = 0; i + STEP <= n; i += STEP)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) acc[c] = peak_add(acc[c], peak_load(p + i + c * PEAK_LANES));
  const double seconds = thread_seconds() - start;
  *sink = peak_sum(peak_add(peak_add(acc[0], acc[1]), peak_add(acc[2], acc[3])));
  return seconds;
}

// The machine's memory read rate in GB/s at this build's vector width, the rate a decode step's
// GEMMs stream their weights at best: every thread reads its share of a `bytes` buffer (far
// larger than the caches) once per rep; bytes over the slowest thread's CPU time, the best of
// `reps` (as gemm_fma_peak: load on a shared machine only ever lowers it).
double gemm_read_bandwidth(int64_t bytes, int64_t reps) {
  const int threads = at::get_num_threads();
  const int64_t share = std::max<int64_t>(bytes / 4 / threads / 64 * 64, 64);
  const at::Tensor buf = at::ones({share * threads}, at::kFloat);  // touched: no page faults below
  const float* p = buf.data_ptr<float>();
  std::vector<float> sink(threads, 0.0f);
  double best = 0.0;
  for (int64_t r = 0; r < std::max<int64_t>(reps, 1); ++r) {
    std::vector<double> seconds(threads, 0.0);
    at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) seconds[t] = read_once(p + t * share, share, &sink[t]);
    });
    const double slowest = *std::max_element(seconds.begin(), seconds.end());
    best = std::max(best, 4.0 * share * threads / std::max(slowest, 1e-9) / 1e9);
  }
  return sink[0] == -1.0f ? 0.0 : best;
}

at::Tensor pack_gemm_weight(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 &&
                  (w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16),
              "pack_gemm_weight takes a float32 or bfloat16 CPU weight [N, K]");
  if (w.scalar_type() == at::kBFloat16) return pack_gemm_weight_bf16(w);
  const int64_t n = w.size(0), k = w.size(1), panels = (n + PANEL - 1) / PANEL;
  at::Tensor packed = at::zeros({panels, k, PANEL}, w.options());
  const at::Tensor wc = w.contiguous();
  const float* src = wc.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  for (int64_t row = 0; row < n; ++row)
    for (int64_t kk = 0; kk < k; ++kk)
      dst[((row / PANEL) * k + kk) * PANEL + row % PANEL] = src[row * k + kk];
  return packed;
}

at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias, GemmNext after) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1 &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be a float32 or bfloat16 CPU tensor [M, K], contiguous rows");
  if (x.scalar_type() == at::kBFloat16) return gemm_packed_bf16(x, packed, n, bias, after);
  if (packed.scalar_type() != at::kFloat) return gemm_packed_w16(x, packed, n, bias, after);
  TORCH_CHECK(packed.scalar_type() == at::kFloat && packed.dim() == 3 &&
                  packed.size(1) == x.size(1) && packed.size(2) == PANEL &&
                  packed.size(0) == (n + PANEL - 1) / PANEL && packed.is_contiguous(),
              "packed must be pack_gemm_weight's float32 [ceil(N/32), K, 32] of a weight with "
              "K = x's");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
  gemm_panels(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), k * PANEL, b,
              y.data_ptr<float>(), m, n, k, GEMM_TILES<WeightF32>.data(), GEMM_PARALLEL_MIN_MACS,
              gemm_rows_x32(k), GEMM_PACK_X32, 128, after);
  return y;
}

// The op: gemm_packed, and `after` the packed weight the caller multiplies by next (GemmNext).
at::Tensor gemm_packed_op(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                          const std::optional<at::Tensor>& bias,
                          const std::optional<at::Tensor>& after) {
  return gemm_packed(x, packed, n, bias, gemm_next(after, x.size(0), GEMM_PARALLEL_MIN_MACS));
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("gemm_vectorized() -> bool", &pagedllm::gemm_vectorized);
  m.def("gemm_bf16_vectorized() -> bool", &pagedllm::gemm_bf16_vectorized);
  m.def("gemm_isa() -> str", &pagedllm::gemm_isa);
  m.def("gemm_fma_peak(int iters) -> float", &pagedllm::gemm_fma_peak);
  m.def("gemm_read_bandwidth(int bytes, int reps) -> float", &pagedllm::gemm_read_bandwidth);
  m.def("pack_gemm_weight_w16(Tensor w) -> Tensor", &pagedllm::pack_gemm_weight_w16);
  m.def("pack_gemm_weight(Tensor w) -> Tensor", &pagedllm::pack_gemm_weight);
  m.def("gemm_packed(Tensor x, Tensor packed, int n, Tensor? bias, Tensor? after=None) -> Tensor",
        &pagedllm::gemm_packed_op);
}
