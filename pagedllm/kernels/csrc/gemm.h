// gemm.cpp's float32 GEMM on a packed weight, for the decoder-layer ops that call it.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace pagedllm {

constexpr int64_t GEMM_PANEL = 32;  // output columns per packed panel

at::Tensor gemm_packed(const at::Tensor& x, const at::Tensor& packed, int64_t n,
                       const std::optional<at::Tensor>& bias);

}  // namespace pagedllm
