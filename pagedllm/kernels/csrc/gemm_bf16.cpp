// bfloat16 linear layers on a weight packed once: y[M, N] = x[M, K] @ W[N, K]^T (+ bias), x, W,
// bias and y in bf16, each output one fp32 sum rounded once to bf16 (nearest even).
//
// The same scheme as gemm.cpp's float32 GEMM, on AVX512-BF16's `vdpbf16ps`, which multiplies
// pairs of bf16 values and adds both products to one fp32 lane. So W is packed into panels of
// 32 output columns with two consecutive k of a column side by side:
//
//     packed[p, kk, 2 j + i] = W[32 p + j, 2 kk + i]   (zero past N and past K)
//                                                       -> [ceil(N/32), ceil(K/2), 64]
//
// Per k pair a 32-column panel is 128 bytes, two zmm loads; a tile of MR rows x 32 columns keeps
// 2 * MR fp32 accumulators in registers over the whole K loop: per pair, MR broadcasts of
// (x[r, 2 kk], x[r, 2 kk + 1]) as one 32-bit lane, 2 * MR `vdpbf16ps`. An odd K's last k
// broadcasts x's last value beside a zero (the row may end there, and past it could be a NaN,
// which times the packed zero is still NaN). Panels are split over threads as in gemm.cpp.
// While a panel is computed its tiles prefetch the thread's next one, two cache lines per k pair
// in all (gemm_panels in gemm.h): at the rows of a decode step the weight comes from memory,
// and without it each panel's load and its compute took turns (125M shapes, M = 4-64:
// 1.05-1.25x faster with the first tile alone fetching it).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "gemm.h"

namespace pagedllm {
namespace {

constexpr int64_t PANEL = GEMM_PANEL;

#if defined(__AVX512BF16__)
inline __m512bh pair(const uint16_t* p) {  // (p[0], p[1]) in every 32-bit lane
  uint32_t u;
  std::memcpy(&u, p, 4);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(u)));
}

inline __m512 widen(__mmask16 m, const uint16_t* p) {  // 16 bf16 -> fp32, zero where not in m
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void narrow(__mmask16 m, uint16_t* p, __m512 v) {  // round to nearest even, store
  _mm256_mask_storeu_epi16(p, m, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

template <int R>
inline void tile(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k_n,
                 const uint16_t* bias, uint16_t* y, int64_t ldy, int64_t n_valid,
                 GemmAhead ahead) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  const int64_t pairs = k_n / 2;
  for (int64_t kk = 0; kk < pairs; ++kk) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + kk * 2 * PANEL));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + kk * 2 * PANEL + 32));
    gemm_prefetch(ahead, kk);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = pair(x + r * ldx + 2 * kk);
      a0[r] = _mm512_dpbf16_ps(a0[r], xb, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xb, w1);
    }
  }
  if (k_n % 2 == 1) {
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + pairs * 2 * PANEL));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + pairs * 2 * PANEL + 32));
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512bh xb =
          reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * ldx + k_n - 1])));
      a0[r] = _mm512_dpbf16_ps(a0[r], xb, w0);
      a1[r] = _mm512_dpbf16_ps(a1[r], xb, w1);
    }
  }
  const __mmask16 m0 = n_valid >= 16 ? 0xFFFF : (1u << n_valid) - 1;
  const __mmask16 m1 = n_valid >= 32 ? 0xFFFF : n_valid <= 16 ? 0 : (1u << (n_valid - 16)) - 1;
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = widen(m0, bias);
    b1 = widen(m1, bias + 16);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    narrow(m0, y + r * ldy, bias ? _mm512_add_ps(a0[r], b0) : a0[r]);
    narrow(m1, y + r * ldy + 16, bias ? _mm512_add_ps(a1[r], b1) : a1[r]);
  }
}

template <size_t... R>
constexpr std::array<GemmTile<uint16_t>, GEMM_MR + 1> tiles(std::index_sequence<R...>) {
  return {nullptr, tile<R + 1>...};
}
constexpr auto TILES = tiles(std::make_index_sequence<GEMM_MR>{});
#endif

}  // namespace

// Whether this build has the kernel (compiled for a CPU with AVX512-BF16: -march=native on the
// machine that runs it) and the CPU running it has the instructions.
bool gemm_bf16_vectorized() {
#if defined(__AVX512BF16__)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

at::Tensor pack_gemm_weight_bf16(const at::Tensor& w) {
  TORCH_CHECK(gemm_bf16_vectorized(), "pagedllm's bfloat16 GEMM needs a CPU with AVX512-BF16 "
              "(torch.ops.pagedllm.gemm_bf16_vectorized() is False here)");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + PANEL - 1) / PANEL;
  at::Tensor packed = at::zeros({panels, (k + 1) / 2, 2 * PANEL}, w.options());
  const at::Tensor wc = w.contiguous();
  const uint16_t* src = static_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(packed.data_ptr());
  const int64_t panel_size = (k + 1) / 2 * 2 * PANEL;
  for (int64_t row = 0; row < n; ++row)
    for (int64_t kk = 0; kk < k; ++kk)
      dst[(row / PANEL) * panel_size + (kk / 2) * 2 * PANEL + (row % PANEL) * 2 + kk % 2] =
          src[row * k + kk];
  return packed;
}

at::Tensor gemm_packed_bf16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                            const std::optional<at::Tensor>& bias, GemmNext after) {
  TORCH_CHECK(gemm_bf16_vectorized(), "pagedllm's bfloat16 GEMM needs a CPU with AVX512-BF16");
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 &&
                  packed.size(1) == (x.size(1) + 1) / 2 && packed.size(2) == 2 * PANEL &&
                  packed.size(0) == (n + PANEL - 1) / PANEL && packed.is_contiguous(),
              "packed must be pack_gemm_weight's bfloat16 [ceil(N/32), ceil(K/2), 64] of a "
              "weight with K = x's");
  const uint16_t* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->numel() == n &&
                    bias->is_contiguous(), "bias must be bfloat16 [N]");
    b = static_cast<const uint16_t*>(bias->data_ptr());
  }
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
#if defined(__AVX512BF16__)
  gemm_panels(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0),
              static_cast<const uint16_t*>(packed.data_ptr()), packed.size(1) * 2 * PANEL, b,
              static_cast<uint16_t*>(y.data_ptr()), m, n, k, TILES.data(), GEMM_PARALLEL_MIN_MACS,
              GEMM_ROWS_BF16, GemmPack<uint16_t>{}, 128, after);
#endif
  return y;
}

}  // namespace pagedllm
