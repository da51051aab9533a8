// Greedy sampling's argmax over each row of a step's logits [B, V], read in the LM head's own
// dtype (fp32, bf16 or fp16: widening to fp32 is exact and keeps the order, so the result is
// the argmax of the fp32 logits without a converted copy of them), rows split over threads.
//
// torch.argmax's answer exactly: the first index of the row's maximum, and where a row holds a
// NaN, the first NaN (torch treats NaN as larger than everything). Two passes over each row
// (it is in cache: the LM head just wrote it): the maximum, with a NaN check, then the first
// position equal to it.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "common.h"

namespace pagedllm {
namespace {

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(mx);
  __mmask16 vnan = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = load16<T>(x + i);
    vnan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    vm = _mm512_max_ps(vm, v);
  }
  nan = vnan != 0;
  mx = _mm512_reduce_max_ps(vm);
#endif
  for (; i < n; ++i) {
    const float v = widen(x, i);
    nan |= std::isnan(v);
    mx = std::max(mx, v);
  }
  if (nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(widen(x, j))) return j;
  }
  i = 0;
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(mx);
  for (; i + 16 <= n; i += 16) {
    const __mmask16 eq = _mm512_cmp_ps_mask(load16<T>(x + i), target, _CMP_EQ_OQ);
    if (eq) return i + __builtin_ctz(static_cast<unsigned>(eq));
  }
#endif
  for (; i < n; ++i)
    if (widen(x, i) == mx) return i;
  return 0;  // n == 0 is refused by the caller; unreachable otherwise
}

template <typename T>
void argmax_rows_t(const at::Tensor& x, at::Tensor& out) {
  const T* base = static_cast<const T*>(x.data_ptr());
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  int64_t* o = out.data_ptr<int64_t>();
  // a row of the 32k-vocabulary models is ~3 us: below ~4 rows a second thread costs more
  // than it saves
  const int64_t grain = std::max<int64_t>(1, (1 << 17) / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row(base + r * stride, n);
  });
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.size(1) > 0 && x.stride(1) == 1,
              "argmax_rows takes CPU logits [B, V] (V > 0) with a contiguous last dim");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  switch (x.scalar_type()) {
    case at::kFloat: argmax_rows_t<float>(x, out); break;
    case at::kBFloat16: argmax_rows_t<c10::BFloat16>(x, out); break;
    case at::kHalf: argmax_rows_t<c10::Half>(x, out); break;
    default: TORCH_CHECK(false, "argmax_rows: logits must be fp32, bf16 or fp16, not ",
                         x.scalar_type());
  }
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("argmax_rows(Tensor logits) -> Tensor", &pagedllm::argmax_rows);
}
