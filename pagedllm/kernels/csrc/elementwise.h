// The fused elementwise ops of elementwise.cpp, for the other kernels of the library that chain
// them (decoder_layer.cpp).
#pragma once

#include <ATen/core/Tensor.h>

namespace pagedllm {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps);
void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);

}  // namespace pagedllm
