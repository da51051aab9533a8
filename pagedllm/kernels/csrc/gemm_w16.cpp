// Linear layers with 16-bit weights and float32 activations: y[M, N] = x[M, K] @ W[N, K]^T
// (+ bias), W in bfloat16 or float16, x, bias and y in float32. For CPUs without bf16 (or fp16)
// arithmetic: decode reads every weight once per step, so half the bytes is the win even though
// the math is fp32. Each weight is widened to fp32 in registers (bf16: a 16-bit shift; fp16:
// F16C's vcvtph2ps), both exact, and each output is one fp32 sum in k order as in gemm.cpp: the
// result has the same bits as gemm.cpp's GEMM on W.float().
//
// Layout: gemm.cpp's panels, in the weight's own dtype,
//
//     packed[p, k, j] = W[32 p + j, k]      (zero where 32 p + j >= N)   -> [ceil(N/32), K, 32]
//
// so one k row of a panel is 64 bytes, one cache line (AVX-512: two 16-lane widenings per k;
// AVX2: gemm_avx2.h's tile with LoadBF16 / LoadF16). gemm_packed takes it where x is float32
// and the packed weight 16-bit (gemm_bf16.cpp's k-pair layout is for bf16 x on AVX512-BF16).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <optional>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "gemm.h"
#include "gemm_avx2.h"
#include "gemm_avx512.h"

namespace pagedllm {
namespace {

constexpr int64_t PANEL = GEMM_PANEL;

#if defined(__AVX512F__)
template <int R, typename L>
inline void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t k_n, const float* bias,
                 float* y, int64_t ldy, int64_t n_valid, GemmAhead ahead) {
  avx512_tile<R, L>(x, ldx, w, k_n, bias, y, ldy, n_valid, ahead);
}
using BF16 = Load16BF16;
using F16 = Load16F16;
#elif defined(__AVX2__) && defined(__FMA__)
template <int R, typename L>
inline void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t k_n, const float* bias,
                 float* y, int64_t ldy, int64_t n_valid, GemmAhead ahead) {
  avx2_tile<R, L>(x, ldx, w, k_n, bias, y, ldy, n_valid, ahead);
}
using BF16 = LoadBF16;
using F16 = LoadF16;
#else
struct BF16 {
  static float at(uint16_t v) { return c10::BFloat16(v, c10::BFloat16::from_bits()); }
};
struct F16 {
  static float at(uint16_t v) { return c10::Half(v, c10::Half::from_bits()); }
};
template <int R, typename L>
inline void tile(const float* x, int64_t ldx, const uint16_t* w, int64_t k_n, const float* bias,
                 float* y, int64_t ldy, int64_t n_valid, GemmAhead) {
  float acc[R][PANEL] = {};
  for (int64_t k = 0; k < k_n; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < PANEL; ++j) acc[r][j] += x[r * ldx + k] * L::at(w[k * PANEL + j]);
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n_valid; ++j) y[r * ldy + j] = acc[r][j] + (bias ? bias[j] : 0.0f);
}
#endif

template <typename L>
constexpr GemmTile<float, uint16_t> TILES[GEMM_MR + 1] = {
    nullptr, tile<1, L>, tile<2, L>, tile<3, L>, tile<4, L>,
    tile<5, L>, tile<6, L>, tile<7, L>, tile<8, L>};

}  // namespace

at::Tensor pack_gemm_weight_w16(const at::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.dim() == 2 &&
                  (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kHalf),
              "pack_gemm_weight_w16 takes a bfloat16 or float16 CPU weight [N, K]");
  const int64_t n = w.size(0), k = w.size(1), panels = (n + PANEL - 1) / PANEL;
  at::Tensor packed = at::zeros({panels, k, PANEL}, w.options());
  const at::Tensor wc = w.contiguous();
  const uint16_t* src = static_cast<const uint16_t*>(wc.data_ptr());
  uint16_t* dst = static_cast<uint16_t*>(packed.data_ptr());
  for (int64_t row = 0; row < n; ++row)
    for (int64_t kk = 0; kk < k; ++kk)
      dst[((row / PANEL) * k + kk) * PANEL + row % PANEL] = src[row * k + kk];
  return packed;
}

at::Tensor gemm_packed_w16(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat &&
                  (packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kHalf) &&
                  packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == PANEL &&
                  packed.size(0) == (n + PANEL - 1) / PANEL && packed.is_contiguous(),
              "a 16-bit packed weight with float32 x must be pack_gemm_weight_w16's "
              "[ceil(N/32), K, 32] of a weight with K = x's");
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n && bias->is_contiguous(),
                "bias must be float32 [N]");
    b = bias->data_ptr<float>();
  }
  const int64_t m = x.size(0), k = x.size(1);
  at::Tensor y = at::empty({m, n}, x.options());
  const auto* tiles = packed.scalar_type() == at::kBFloat16 ? TILES<BF16> : TILES<F16>;
  gemm_panels<float, uint16_t>(x.data_ptr<float>(), x.stride(0),
                               static_cast<const uint16_t*>(packed.data_ptr()), k * PANEL, b,
                               y.data_ptr<float>(), m, n, k, tiles, GEMM_PARALLEL_MIN_MACS, 64);
  return y;
}

}  // namespace pagedllm
