// The GEMM's register tile on AVX-512 (gemm.cpp's float32 weights, gemm_w16.cpp's 16-bit
// weights widened to fp32 on load): R rows x 32 columns, 2 R zmm accumulators over the whole K
// loop; per k, two 16-lane loads of the panel (L::at), R broadcasts of x, 2 R FMAs; each output
// one FMA chain in k order, then + bias.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

#include "gemm.h"

namespace pagedllm {

struct Load16F32 {  // 16 fp32 weights
  using W = float;
  static __m512 at(const float* p) { return _mm512_loadu_ps(p); }
};

struct Load16BF16 {  // 16 bf16 weights -> fp32 (exact)
  using W = uint16_t;
  static __m512 at(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
};

struct Load16F16 {  // 16 fp16 weights -> fp32 (exact)
  using W = uint16_t;
  static __m512 at(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
};

template <int R, typename L>
inline void avx512_tile(const float* x, int64_t ldx, const typename L::W* w, int64_t k_n,
                        const float* bias, float* y, int64_t ldy, int64_t n_valid,
                        GemmAhead ahead) {
  __m512 a0[R], a1[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k_n; ++k) {
    const __m512 w0 = L::at(w + k * GEMM_PANEL), w1 = L::at(w + k * GEMM_PANEL + 16);
    gemm_prefetch(ahead, k);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
    }
  }
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  const __mmask16 m0 = n_valid >= 16 ? 0xFFFF : (1u << n_valid) - 1;
  const __mmask16 m1 = n_valid >= 32 ? 0xFFFF : n_valid <= 16 ? 0 : (1u << (n_valid - 16)) - 1;
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(m0, bias);
    b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, bias ? _mm512_add_ps(a0[r], b0) : a0[r]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, bias ? _mm512_add_ps(a1[r], b1) : a1[r]);
  }
}

}  // namespace pagedllm
#endif
