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
// so one k row of a panel is 64 bytes, one cache line (gemm_tile.h's tile for the build's ISA,
// on WeightBF16 / WeightF16). gemm_packed takes it where x is float32
// and the packed weight 16-bit (gemm_bf16.cpp's k-pair layout is for bf16 x on AVX512-BF16).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <optional>

#include "gemm.h"
#include "gemm_tile.h"

namespace pagedllm {
namespace {

constexpr int64_t PANEL = GEMM_PANEL;

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
                           const std::optional<at::Tensor>& bias, GemmNext after) {
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
  const auto* tiles = packed.scalar_type() == at::kBFloat16 ? GEMM_TILES<WeightBF16>.data()
                                                            : GEMM_TILES<WeightF16>.data();
  gemm_panels<float, uint16_t>(x.data_ptr<float>(), x.stride(0),
                               static_cast<const uint16_t*>(packed.data_ptr()), k * PANEL, b,
                               y.data_ptr<float>(), m, n, k, tiles, GEMM_PARALLEL_MIN_MACS,
                               gemm_rows_x32(k), GEMM_PACK_X32, 64, after);
  return y;
}

}  // namespace pagedllm
