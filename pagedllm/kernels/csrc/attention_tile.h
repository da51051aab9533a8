// The two inner loops of the decode kernel, over one tile of fp32 K or V rows of one kv head
// (row pointers padded to a multiple of 16 with a zero row, so vector code needs no tail):
//
//   scores:  s[j][i]  = q[j] . k_row[i]                 j < g query heads, i < n positions
//   values:  acc[j]  += sum_i p[j][i] * v_row[i]
//
// With AVX-512 and head_dim a multiple of 16 (up to 128), templated on the vectors per row:
// scores hold q[j] in registers and reduce 16 dot products at once with a shuffle tree instead
// of one horizontal sum per product; values keep blocks of acc rows in registers, with two
// accumulator sets for even and odd positions so the FMA chains do not wait on each other.
// Anything else takes the plain loops (vectorised by the compiler over head_dim).
#pragma once

#include <cstdint>

#include "common.h"

namespace pagedllm {

constexpr int64_t TILE = 64;  // positions per online-softmax update, a multiple of 16

using ScoresFn = void (*)(const float* q, int64_t g, int64_t d, const float* const* rows,
                          int64_t n, float* s);
using ValuesFn = void (*)(float* acc, int64_t g, int64_t d, const float* p,
                          const float* const* rows, int64_t n);

inline void scores_plain(const float* q, int64_t g, int64_t d, const float* const* rows,
                         int64_t n, float* s) {
  for (int64_t j = 0; j < g; ++j)
    for (int64_t i = 0; i < n; ++i) s[j * TILE + i] = dot(q + j * d, rows[i], d);
}

inline void values_plain(float* acc, int64_t g, int64_t d, const float* p,
                         const float* const* rows, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < g; ++j) axpy(acc + j * d, p[j * TILE + i], rows[i], d);
}

#if defined(__AVX512F__)
// out[t] = sum of the 16 lanes of a[t], t < 16.
inline __m512 reduce16(__m512* a) {
  __m512 b[8], c[4], e[2];
  for (int t = 0; t < 8; ++t)  // lanes per 128-bit group: [x0+x2, y0+y2, x1+x3, y1+y3]
    b[t] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * t], a[2 * t + 1]),
                         _mm512_unpackhi_ps(a[2 * t], a[2 * t + 1]));
  for (int t = 0; t < 4; ++t) {  // per 128-bit group: the group's sum of 4 consecutive tokens
    __m512d x = _mm512_castps_pd(b[2 * t]), y = _mm512_castps_pd(b[2 * t + 1]);
    c[t] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int t = 0; t < 2; ++t)  // add 128-bit groups pairwise: 0+1 and 2+3
    e[t] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * t], c[2 * t + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * t], c[2 * t + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                       _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

template <int NV>
void scores_avx512(const float* q, int64_t g, int64_t, const float* const* rows, int64_t n,
                   float* s) {
  for (int64_t j = 0; j < g; ++j) {
    __m512 qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + j * NV * 16 + c * 16);
    for (int64_t i = 0; i < n; i += 16) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) {
        const float* k = rows[i + t];
        a[t] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int c = 1; c < NV; ++c) a[t] = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(k + c * 16), a[t]);
      }
      _mm512_storeu_ps(s + j * TILE + i, reduce16(a));
    }
  }
}

template <int NV>
void values_avx512(float* acc, int64_t g, int64_t, const float* p, const float* const* rows,
                   int64_t n) {
  constexpr int JB = NV >= 8 ? 1 : 8 / NV;  // acc rows per register block
  for (int64_t j0 = 0; j0 < g; j0 += JB) {
    const int jn = static_cast<int>(std::min<int64_t>(JB, g - j0));
    __m512 a0[JB][NV], a1[JB][NV];
    for (int jj = 0; jj < JB; ++jj)
      for (int c = 0; c < NV; ++c) {
        a0[jj][c] = jj < jn ? _mm512_loadu_ps(acc + (j0 + jj) * NV * 16 + c * 16)
                            : _mm512_setzero_ps();
        a1[jj][c] = _mm512_setzero_ps();
      }
    for (int64_t i = 0; i < n; i += 2) {  // rows and p are padded to 16 (zero rows, p = 0)
      const float *v0 = rows[i], *v1 = rows[i + 1];
      for (int jj = 0; jj < JB; ++jj) {
        if (jj >= jn) break;
        const float* pj = p + (j0 + jj) * TILE + i;
        __m512 p0 = _mm512_set1_ps(pj[0]), p1 = _mm512_set1_ps(pj[1]);
        for (int c = 0; c < NV; ++c) {
          a0[jj][c] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + c * 16), a0[jj][c]);
          a1[jj][c] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + c * 16), a1[jj][c]);
        }
      }
    }
    for (int jj = 0; jj < jn; ++jj)
      for (int c = 0; c < NV; ++c)
        _mm512_storeu_ps(acc + (j0 + jj) * NV * 16 + c * 16, _mm512_add_ps(a0[jj][c], a1[jj][c]));
  }
}
#endif

// The tile loops for head_dim d.
inline void tile_fns(int64_t d, ScoresFn& scores, ValuesFn& values) {
  scores = scores_plain;
  values = values_plain;
#if defined(__AVX512F__)
  switch (d) {
#define PAGEDLLM_NV(nv)            \
  case nv * 16:                    \
    scores = scores_avx512<nv>;    \
    values = values_avx512<nv>;    \
    break;
    PAGEDLLM_NV(1) PAGEDLLM_NV(2) PAGEDLLM_NV(3) PAGEDLLM_NV(4)
    PAGEDLLM_NV(5) PAGEDLLM_NV(6) PAGEDLLM_NV(7) PAGEDLLM_NV(8)
#undef PAGEDLLM_NV
    default: break;
  }
#endif
}

}  // namespace pagedllm
