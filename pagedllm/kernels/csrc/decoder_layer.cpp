// A Llama decoder layer as two ops around its attention, so that a CPU step makes two calls
// per layer from Python instead of ~25 (each torch op called from Python costs a few us of
// argument parsing and dispatch, which on a small model is as much as the op's own work):
//
//   attn_in(x, residual?, ...)   residual? <- x + residual; h = rms_norm(...);
//                                qkv = h @ Wqkv^T (+ b); rotary on q, k; k, v -> their cache slots
//                                -> q [T, Hq, D] (a view of qkv)
//   attn_out_mlp(o, residual, ...)
//                                h = o @ Wo^T (+ b); residual <- h + residual; h = rms_norm(...);
//                                -> down(silu_and_mul(gate_up(h)))
//
// A decode step with LoRA adapters ("dense" method) adds each linear's deltas right after it,
// as the modules do (add_lora_; the op's lora_* arguments).
//
// ``after`` (each op's last argument): the packed weight of the linear that runs after the op's
// last one (the layer's o_proj after attn_in, the next layer's qkv_proj or the LM head after
// attn_out_mlp), so that every GEMM fetches the start of the one after it (gemm.h GemmNext).
// The same ops the Python modules run, in the same order, on the same kernels: a linear runs
// pagedllm's GEMM (gemm.cpp) or oneDNN (mkldnn::_linear_pointwise) on its packed weight, or
// at::linear on its plain weight, by the rule of Linear.matmul (layers/linear.py), so the
// results are bit-identical to the module path in every dtype. What the fused path does not cover (tensor parallelism,
// quantized KV, CUDA, no kernels) the model runs through its modules.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <cstring>
#include <optional>

#include "elementwise.h"
#include "gemm.h"

namespace pagedllm {
namespace {

using OptTensor = std::optional<at::Tensor>;

// x [T, in] @ W^T (+ bias): oneDNN on ``packed`` unless it is absent, or ``weight`` is given
// (Linear.gemv) and x is one row; at::linear on ``weight`` otherwise. ``after``: the packed
// weight of the linear that runs next, whose first panels pagedllm's GEMM fetches (GemmNext).
at::Tensor linear(const at::Tensor& x, const OptTensor& packed, const OptTensor& weight,
                  const OptTensor& bias, const OptTensor& after = std::nullopt) {
  if (!packed.has_value() || (weight.has_value() && x.size(0) == 1)) {
    TORCH_CHECK(weight.has_value(), "a linear needs its packed or its plain weight");
    return at::linear(x, *weight, bias);
  }
  if (packed->dim() == 3)  // pack_gemm_weight's panels (Linear.kind "gemm": N = 32 * panels)
    return gemm_packed(x.contiguous(), *packed, packed->size(0) * GEMM_PANEL, bias,
                       gemm_next(after, x.size(0), GEMM_PARALLEL_MIN_MACS));
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, *packed, bias, std::string("none"),
                          c10::List<std::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// rows x [T, H, D] (rows of H * D contiguous elements) -> cache [num_blocks, block_size, H, D]
// at slots[t]; the torch op (with its dtype cast) where the cache's dtype or layout differ.
void write_slots(const at::Tensor& x, const at::Tensor& cache, const at::Tensor& slots) {
  const int64_t t_n = x.size(0), row = x.size(1) * x.size(2);
  const int64_t n_slots = cache.size(0) * cache.size(1);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.size(0) == t_n &&
                  slots.is_contiguous(), "slot_mapping must be int64 [T]");
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) * cache.size(3) == row,
              "the KV cache must be [num_blocks, block_size, Hkv, D]");
  if (cache.scalar_type() != x.scalar_type() || !cache.is_contiguous() || x.stride(2) != 1 ||
      x.stride(1) != x.size(2)) {
    cache.view({n_slots, x.size(1), x.size(2)}).index_copy_(0, slots, x.to(cache.scalar_type()));
    return;
  }
  const int64_t* s = slots.data_ptr<int64_t>();
  const int64_t bytes = row * x.element_size();
  char* dst = static_cast<char*>(cache.data_ptr());
  const char* src = static_cast<const char*>(x.data_ptr());
  for (int64_t t = 0; t < t_n; ++t) {
    TORCH_CHECK(s[t] >= 0 && s[t] < n_slots, "slot ", s[t], " outside the KV cache (", n_slots,
                " slots)");
    std::memcpy(dst + s[t] * bytes, src + t * x.stride(0) * x.element_size(), bytes);
  }
}

// y += the step's adapter deltas for x: lora/ops.py's "dense" method (LoRAMapping.apply), the
// same ops in the same order, so the same bits as the module path. lora: [A_flat packed,
// B_flat_j^T packed for each shard j]; dims: [rank, width_j ...]; onehot [T, S, 1] (each token's
// slot; the base model's tokens all zero). Empty lora: no adapter of the step targets the linear.
void add_lora_(const at::Tensor& x, const at::Tensor& y, const OptTensor& onehot,
               at::TensorList lora, at::IntArrayRef dims) {
  if (lora.empty()) return;
  TORCH_CHECK(onehot.has_value() && onehot->dim() == 3 && lora.size() >= 2 &&
                  dims.size() == lora.size(),
              "a linear's LoRA arguments are [A, B_j ...] with [rank, width_j ...] and onehot");
  const int64_t t = x.size(0), s = onehot->size(1), r = dims[0];
  const int64_t n = static_cast<int64_t>(lora.size()) - 1;
  const at::Tensor h = gemm_packed(x.contiguous(), lora[0], s * n * r, std::nullopt)
                           .view({t, s, -1})
                           .mul(*onehot);  // [T, S, n R]
  for (int64_t j = 0, off = 0; j < n; off += dims[j + 1], ++j) {
    const at::Tensor hj = h.narrow(2, j * r, r).reshape({t, s * r});
    y.narrow(1, off, dims[j + 1])
        .add_(gemm_packed(hj.contiguous(), lora[j + 1], dims[j + 1], std::nullopt));
  }
}

}  // namespace

at::Tensor attn_in(at::Tensor x, const OptTensor& residual, const at::Tensor& norm_weight,
                   double eps, const OptTensor& qkv_packed, const OptTensor& qkv_weight,
                   const OptTensor& qkv_bias, const at::Tensor& cos, const at::Tensor& sin,
                   int64_t num_heads, int64_t num_kv_heads, const at::Tensor& k_cache,
                   const at::Tensor& v_cache, const at::Tensor& slot_mapping,
                   const OptTensor& after, const OptTensor& lora_onehot, at::TensorList qkv_lora,
                   at::IntArrayRef qkv_lora_dims) {
  at::Tensor h;
  if (residual.has_value()) {
    add_rms_norm_(x, *residual, norm_weight, eps);
    h = x;
  } else {
    h = rms_norm(x, norm_weight, eps);
  }
  const at::Tensor qkv = linear(h, qkv_packed, qkv_weight, qkv_bias, after);  // [T, (Hq+2Hkv) D]
  add_lora_(h, qkv, lora_onehot, qkv_lora, qkv_lora_dims);
  const int64_t t = qkv.size(0), d = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * d,
              "qkv_proj's output is not (num_heads + 2 * num_kv_heads) * head_dim");
  at::Tensor q = qkv.narrow(1, 0, num_heads * d).view({t, num_heads, d});
  at::Tensor k = qkv.narrow(1, num_heads * d, num_kv_heads * d).view({t, num_kv_heads, d});
  at::Tensor v = qkv.narrow(1, (num_heads + num_kv_heads) * d, num_kv_heads * d)
                     .view({t, num_kv_heads, d});
  rotary_(q, k, cos, sin);
  write_slots(k, k_cache, slot_mapping);
  write_slots(v, v_cache, slot_mapping);
  return q;
}

at::Tensor attn_out_mlp(const at::Tensor& o, at::Tensor residual, const OptTensor& o_packed,
                        const OptTensor& o_weight, const OptTensor& o_bias,
                        const at::Tensor& norm_weight, double eps,
                        const OptTensor& gate_up_packed, const OptTensor& gate_up_weight,
                        const OptTensor& gate_up_bias, const OptTensor& down_packed,
                        const OptTensor& down_weight, const OptTensor& down_bias,
                        const OptTensor& after, const OptTensor& lora_onehot,
                        at::TensorList o_lora, at::IntArrayRef o_lora_dims,
                        at::TensorList gate_up_lora, at::IntArrayRef gate_up_lora_dims,
                        at::TensorList down_lora, at::IntArrayRef down_lora_dims) {
  const at::Tensor o2 = o.reshape({o.size(0), -1});
  at::Tensor h = linear(o2, o_packed, o_weight, o_bias, gate_up_packed);
  add_lora_(o2, h, lora_onehot, o_lora, o_lora_dims);
  add_rms_norm_(h, residual, norm_weight, eps);
  const at::Tensor gate_up = linear(h, gate_up_packed, gate_up_weight, gate_up_bias, down_packed);
  add_lora_(h, gate_up, lora_onehot, gate_up_lora, gate_up_lora_dims);
  const at::Tensor act = silu_and_mul(gate_up);
  const at::Tensor y = linear(act, down_packed, down_weight, down_bias, after);
  add_lora_(act, y, lora_onehot, down_lora, down_lora_dims);
  return y;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "attn_in(Tensor(a!) x, Tensor(b!)? residual, Tensor norm_weight, float eps, "
      "Tensor? qkv_packed, Tensor? qkv_weight, Tensor? qkv_bias, Tensor cos, Tensor sin, "
      "int num_heads, int num_kv_heads, Tensor(c!) k_cache, Tensor(d!) v_cache, "
      "Tensor slot_mapping, Tensor? after, Tensor? lora_onehot, Tensor[] qkv_lora, "
      "int[] qkv_lora_dims) -> Tensor",
      &pagedllm::attn_in);
  m.def(
      "attn_out_mlp(Tensor o, Tensor(a!) residual, Tensor? o_packed, Tensor? o_weight, "
      "Tensor? o_bias, Tensor norm_weight, float eps, Tensor? gate_up_packed, "
      "Tensor? gate_up_weight, Tensor? gate_up_bias, Tensor? down_packed, Tensor? down_weight, "
      "Tensor? down_bias, Tensor? after, Tensor? lora_onehot, Tensor[] o_lora, "
      "int[] o_lora_dims, Tensor[] gate_up_lora, int[] gate_up_lora_dims, Tensor[] down_lora, "
      "int[] down_lora_dims) -> Tensor",
      &pagedllm::attn_out_mlp);
}
