// Fused elementwise chains of the Llama layer, one pass over the data each instead of one torch
// op per step (each op a dispatch, an allocation and a pass over memory):
//
//   rms_norm(x, w, eps)                 w * to_dtype(x * rsqrt(mean(x^2) + eps)), fp32 inside
//   add_rms_norm_(x, residual, w, eps)  residual <- to_dtype(x + residual); x <- rms_norm(residual)
//   rotary_(q, k, cos, sin)             HF rotate_half RoPE, q and k in place, fp32 inside
//   silu_and_mul(x)                     to_dtype(silu(gate)) * up for x = gate | up
//
// Each rounds to the tensor's dtype where the unfused torch ops round (so bf16 results match
// them), and the file is built with -ffp-contract=off: no multiply-add is fused where torch
// rounds twice. Rotary and the residual add match the torch ops bit for bit; RMSNorm's sum of
// squares and SiLU's exp may differ from torch's in the last bit.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "common.h"
#include "elementwise.h"

namespace pagedllm {
namespace {

// Rows of about this many elements or more per thread are split over threads; smaller inputs
// (decode steps) run on the calling thread.
constexpr int64_t GRAIN = 1 << 15;

inline int64_t grain_rows(int64_t row_elems) { return std::max<int64_t>(1, GRAIN / row_elems); }

template <typename T>
inline T round_to(float x) {
  return static_cast<T>(x);
}

// f(T{}) with T the C++ type of dtype t (fp32, bf16 or fp16).
template <typename F>
void dispatch_float(at::ScalarType t, const char* name, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, " must be fp32, bf16 or fp16, got ", t);
  }
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name,
              " must be a CPU tensor [T, H] with a contiguous last dim");
}

template <typename T>
void norm_row(const T* x, const T* w, float eps, int64_t h, T* y) {
  float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) {
    float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i)
    y[i] = round_to<T>(static_cast<float>(w[i]) * static_cast<float>(round_to<T>(static_cast<float>(x[i]) * r)));
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [H] of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t h = x.size(1);
  dispatch_float(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), grain_rows(h), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        norm_row(x.data_ptr<scalar_t>() + t * x.stride(0), w, static_cast<float>(eps), h,
                 out.data_ptr<scalar_t>() + t * h);
    });
  });
  return out;
}

void add_rms_norm_(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual differ in shape or dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be contiguous [H] of x's dtype");
  const int64_t h = x.size(1);
  dispatch_float(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0), grain_rows(h), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        scalar_t* xr = x.data_ptr<scalar_t>() + t * x.stride(0);
        scalar_t* rr = residual.data_ptr<scalar_t>() + t * residual.stride(0);
        for (int64_t i = 0; i < h; ++i)
          rr[i] = round_to<scalar_t>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
        norm_row(rr, w, static_cast<float>(eps), h, xr);
      }
    });
  });
}

void rotary_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) &&
                  q.stride(2) == 1 && k.stride(2) == 1 && q.scalar_type() == k.scalar_type(),
              "q [T, Hq, D] and k [T, Hk, D] of one dtype, contiguous last dim");
  const int64_t t_n = q.size(0), half = q.size(2) / 2;
  TORCH_CHECK(q.size(2) % 2 == 0, "head_dim must be even");
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->scalar_type() == at::kFloat && c->size(0) == t_n &&
                    c->size(-1) == half && c->stride(-1) == 1,
                "cos and sin must be fp32 [T, ..., D/2] with a contiguous last dim");
  dispatch_float(q.scalar_type(), "rotary_", [&](auto tag) {
    using scalar_t = decltype(tag);
    const int64_t hq = q.size(1), hk = k.size(1);
    at::parallel_for(0, t_n, grain_rows((hq + hk) * 2 * half), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = cos.data_ptr<float>() + t * cos.stride(0);
        const float* s = sin.data_ptr<float>() + t * sin.stride(0);
        for (int64_t j = 0; j < hq + hk; ++j) {
          scalar_t* x = j < hq ? q.data_ptr<scalar_t>() + t * q.stride(0) + j * q.stride(1)
                               : k.data_ptr<scalar_t>() + t * k.stride(0) + (j - hq) * k.stride(1);
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            x[i] = round_to<scalar_t>(x1 * c[i] - x2 * s[i]);
            x[i + half] = round_to<scalar_t>(x2 * c[i] + x1 * s[i]);
          }
        }
      }
    });
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must be [T, 2 * I] (gate | up)");
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  dispatch_float(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    at::parallel_for(0, x.size(0), grain_rows(2 * n), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const scalar_t* g = x.data_ptr<scalar_t>() + t * x.stride(0);
        scalar_t* y = out.data_ptr<scalar_t>() + t * n;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16) {
          const __m512 a = load16(g + i);
          const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
          const __m512 act = round16<scalar_t>(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
          store16(y + i, _mm512_mul_ps(act, load16(g + i + n)));
        }
#elif defined(__AVX2__)
        if constexpr (std::is_same_v<scalar_t, float>) {  // AVX2 builds compute in fp32
          for (; i + 8 <= n; i += 8) {
            const __m256 a = _mm256_loadu_ps(g + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
            const __m256 act = _mm256_div_ps(a, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
            _mm256_storeu_ps(y + i, _mm256_mul_ps(act, _mm256_loadu_ps(g + i + n)));
          }
        }
#endif
        for (; i < n; ++i) {
          const float a = static_cast<float>(g[i]);
          const scalar_t act = round_to<scalar_t>(a / (1.0f + exp_approx(-a)));
          y[i] = round_to<scalar_t>(static_cast<float>(act) * static_cast<float>(g[i + n]));
        }
      }
    });
  });
  return out;
}

}  // namespace pagedllm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &pagedllm::rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
        &pagedllm::add_rms_norm_);
  m.def("rotary_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()", &pagedllm::rotary_);
  m.def("silu_and_mul(Tensor x) -> Tensor", &pagedllm::silu_and_mul);
}
