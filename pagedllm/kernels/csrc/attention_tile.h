// The two inner loops of the decode kernel, over one tile of K or V rows of one kv head (row
// pointers padded to a multiple of 16 with a zero row, so vector code needs no tail):
//
//   scores:  s[j][i]  = q[j] . k_row[i]                 j < g query heads, i < n positions
//   values:  acc[j]  += sum_i p[j][i] * v_row[i]
//
// Rows are read where they lie, in their own element type T (fp32, bf16 or fp16; int8 / fp8
// rows arrive converted to fp32 by the caller) and widened to fp32 in registers; every sum is
// an fp32 sum. With AVX-512 and head_dim a multiple of 16 (up to 128), templated on the vectors
// per row: scores hold q[j] in registers and reduce 16 dot products at once with a shuffle tree
// instead of one horizontal sum per product; values keep blocks of acc rows in registers, with
// two accumulator sets for even and odd positions so the FMA chains do not wait on each other.
// bf16 q against bf16 K (AVX512-BF16, head_dim a multiple of 32) scores with `vdpbf16ps`: the
// products of two bf16 values are exact in fp32 and summed in fp32 (denormal inputs read as
// zero), so it computes what widening both would, in half the instructions; q stays unscaled
// (a bf16 q times a softmax scale is not a bf16 value) and the 16 sums are scaled instead.
// With AVX2 (no AVX-512) and head_dim a multiple of 8 (up to 128): the same two loops on 8-lane
// vectors (scores_avx2, values_avx2). Anything else takes the plain loops (vectorised by the
// compiler over head_dim).
#pragma once

#include <cstdint>

#include "common.h"

namespace pagedllm {

constexpr int64_t TILE = 64;  // positions per online-softmax update, a multiple of 16

// q: fp32 [g, d] pre-scaled by the softmax scale (post unused), or for scores_dpbf16 bf16
// [g, d] unscaled, the scores then multiplied by post.
using ScoresFn = void (*)(const void* q, float post, int64_t g, int64_t d,
                          const void* const* rows, int64_t n, float* s);
using ValuesFn = void (*)(float* acc, int64_t g, int64_t d, const float* p,
                          const void* const* rows, int64_t n);
// Loops over int8 / fp8 rows as stored, each times its scale sc[i] in registers, with the sums
// of the loops above (AVX2 builds; qscores_fn / qvalues_fn give null elsewhere).
using QScoresFn = void (*)(const float* q, int64_t g, const void* const* rows, const float* sc,
                           int64_t n, float* s);
using QValuesFn = void (*)(float* acc, int64_t g, const float* p, const void* const* rows,
                           const float* sc, int64_t n);

template <typename T>
inline float dot_t(const float* __restrict a, const T* __restrict b, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    return dot(a, b, n);
  } else {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += a[i] * widen(b, i);
    return s;
  }
}

template <typename T>
void scores_plain(const void* qv, float, int64_t g, int64_t d, const void* const* rows,
                  int64_t n, float* s) {
  const float* q = static_cast<const float*>(qv);
  for (int64_t j = 0; j < g; ++j)
    for (int64_t i = 0; i < n; ++i)
      s[j * TILE + i] = dot_t(q + j * d, static_cast<const T*>(rows[i]), d);
}

template <typename T>
void values_plain(float* acc, int64_t g, int64_t d, const float* p, const void* const* rows,
                  int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T* v = static_cast<const T*>(rows[i]);
    for (int64_t j = 0; j < g; ++j) {
      float* y = acc + j * d;
      const float a = p[j * TILE + i];
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) y[c] += a * widen(v, c);
    }
  }
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

template <int NV, typename T>
void scores_avx512(const void* qp, float, int64_t g, int64_t, const void* const* rows,
                   int64_t n, float* s) {
  const float* q = static_cast<const float*>(qp);
  for (int64_t j = 0; j < g; ++j) {
    __m512 qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = _mm512_loadu_ps(q + j * NV * 16 + c * 16);
    for (int64_t i = 0; i < n; i += 16) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) {
        const T* k = static_cast<const T*>(rows[i + t]);
        a[t] = _mm512_mul_ps(qv[0], load16<T>(k));
        for (int c = 1; c < NV; ++c) a[t] = _mm512_fmadd_ps(qv[c], load16<T>(k + c * 16), a[t]);
      }
      _mm512_storeu_ps(s + j * TILE + i, reduce16(a));
    }
  }
}

template <int NV, typename T>
void values_avx512(float* acc, int64_t g, int64_t, const float* p, const void* const* rows,
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
      const T *r0 = static_cast<const T*>(rows[i]), *r1 = static_cast<const T*>(rows[i + 1]);
      for (int jj = 0; jj < JB; ++jj) {
        if (jj >= jn) break;
        const float* pj = p + (j0 + jj) * TILE + i;
        __m512 p0 = _mm512_set1_ps(pj[0]), p1 = _mm512_set1_ps(pj[1]);
        for (int c = 0; c < NV; ++c) {
          a0[jj][c] = _mm512_fmadd_ps(p0, load16<T>(r0 + c * 16), a0[jj][c]);
          a1[jj][c] = _mm512_fmadd_ps(p1, load16<T>(r1 + c * 16), a1[jj][c]);
        }
      }
    }
    for (int jj = 0; jj < jn; ++jj)
      for (int c = 0; c < NV; ++c)
        _mm512_storeu_ps(acc + (j0 + jj) * NV * 16 + c * 16, _mm512_add_ps(a0[jj][c], a1[jj][c]));
  }
}

#if defined(__AVX512BF16__)
// NP = head_dim / 32 pairs-vectors per row; q and rows bf16.
template <int NP>
void scores_dpbf16(const void* qp, float post, int64_t g, int64_t, const void* const* rows,
                   int64_t n, float* s) {
  const c10::BFloat16* q = static_cast<const c10::BFloat16*>(qp);
  const __m512 scale = _mm512_set1_ps(post);
  for (int64_t j = 0; j < g; ++j) {
    __m512bh qv[NP];
    for (int c = 0; c < NP; ++c)
      qv[c] = (__m512bh)_mm512_loadu_si512(q + j * NP * 32 + c * 32);
    for (int64_t i = 0; i < n; i += 16) {
      __m512 a[16];
      for (int t = 0; t < 16; ++t) {
        const c10::BFloat16* k = static_cast<const c10::BFloat16*>(rows[i + t]);
        a[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k));
        for (int c = 1; c < NP; ++c)
          a[t] = _mm512_dpbf16_ps(a[t], qv[c], (__m512bh)_mm512_loadu_si512(k + c * 32));
      }
      _mm512_storeu_ps(s + j * TILE + i, _mm512_mul_ps(reduce16(a), scale));
    }
  }
}
#endif
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
// The AVX2 loops for head_dim a multiple of 8 (up to 128): 8-lane vectors, 16 ymm registers.
template <typename T>
inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// out[t] = sum of the 8 lanes of a[t], t < 8.
inline __m256 reduce8(const __m256* a) {
  const __m256 b0 = _mm256_hadd_ps(a[0], a[1]), b1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 b2 = _mm256_hadd_ps(a[4], a[5]), b3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 c0 = _mm256_hadd_ps(b0, b1), c1 = _mm256_hadd_ps(b2, b3);  // per 128-bit half
  return _mm256_add_ps(_mm256_permute2f128_ps(c0, c1, 0x20), _mm256_permute2f128_ps(c0, c1, 0x31));
}

// 8 values of an int8 / fp8 row in fp32, times the row's scale `sc`: the values to_float
// writes (an 8-bit value times a bf16 scale is exact in fp32), so the loops give the same bits
// as over converted rows, without writing and reading them again. fp8 codes become fp16 bits
// (F16C widens those): e5m2 is fp16's top byte; e4m3's exponent and mantissa shifted under
// fp16's field, which reads them 2^(15 - 7) too small (subnormals too), so e4m3 rows' scales
// come times 256 (tile_rows_q). (fp8 by fp8_bits_to_float's arithmetic here, ~10 instructions
// per 8 values, measured slower than converting rows first.)
template <typename T>
inline __m256 row8(const T* p, __m256 sc) {
  if constexpr (std::is_same_v<T, int8_t>) {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sc);
  } else if constexpr (std::is_same_v<T, c10::Float8_e5m2>) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_slli_epi16(b, 8)), sc);
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    // sign-extended and shifted: the sign lands in bit 15, the code's bit 7 also in bit 14
    const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h =
        _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<short>(0xBF80)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), sc);
  } else {
    return load8<T>(p);
  }
}

// 8 dot products at once (8 K rows against q[j]), q read from L1 (NV vectors would not all
// fit beside the 8 accumulators).
template <int NV, typename T>
void scores_avx2(const void* qp, float, int64_t g, int64_t, const void* const* rows, int64_t n,
                 float* s) {
  const float* q = static_cast<const float*>(qp);
  for (int64_t j = 0; j < g; ++j) {
    const float* qj = q + j * NV * 8;
    for (int64_t i = 0; i < n; i += 8) {
      __m256 a[8];
#pragma GCC unroll 8
      for (int t = 0; t < 8; ++t) {
        const T* k = static_cast<const T*>(rows[i + t]);
        a[t] = _mm256_mul_ps(_mm256_loadu_ps(qj), load8<T>(k));
#pragma GCC unroll 16
        for (int c = 1; c < NV; ++c)
          a[t] = _mm256_fmadd_ps(_mm256_loadu_ps(qj + c * 8), load8<T>(k + c * 8), a[t]);
      }
      _mm256_storeu_ps(s + j * TILE + i, reduce8(a));
    }
  }
}

// acc[j] += sum_i p[j][i] v_i over column chunks of CW vectors, two accumulator sets (even and
// odd positions) of CW registers each.
template <int NV, typename T>
void values_avx2(float* acc, int64_t g, int64_t, const float* p, const void* const* rows,
                 int64_t n) {
  constexpr int CW = NV % 6 == 0 ? 6 : NV % 5 == 0 ? 5 : NV % 4 == 0 ? 4 : NV % 7 == 0 ? 7 : NV;
  for (int64_t j = 0; j < g; ++j) {
    const float* pj = p + j * TILE;
    for (int c0 = 0; c0 < NV; c0 += CW) {
      float* y = acc + j * NV * 8 + c0 * 8;
      __m256 a0[CW], a1[CW];
#pragma GCC unroll 8
      for (int c = 0; c < CW; ++c) {
        a0[c] = _mm256_loadu_ps(y + c * 8);
        a1[c] = _mm256_setzero_ps();
      }
      for (int64_t i = 0; i < n; i += 2) {  // rows and p are padded to 16 (zero rows, p = 0)
        const T* r0 = static_cast<const T*>(rows[i]) + c0 * 8;
        const T* r1 = static_cast<const T*>(rows[i + 1]) + c0 * 8;
        const __m256 p0 = _mm256_set1_ps(pj[i]), p1 = _mm256_set1_ps(pj[i + 1]);
#pragma GCC unroll 8
        for (int c = 0; c < CW; ++c) {
          a0[c] = _mm256_fmadd_ps(p0, load8<T>(r0 + c * 8), a0[c]);
          a1[c] = _mm256_fmadd_ps(p1, load8<T>(r1 + c * 8), a1[c]);
        }
      }
#pragma GCC unroll 8
      for (int c = 0; c < CW; ++c) _mm256_storeu_ps(y + c * 8, _mm256_add_ps(a0[c], a1[c]));
    }
  }
}

// The loops over int8 / fp8 rows, which cost a few instructions each to widen: each row is
// widened once for a block of JB query rows (the GQA group, or a prefill chunk's rows), not
// once per query row. Every sum runs in the order the loops above give it over the same values
// in fp32 (scores: the products over head_dim in order, then the lanes in reduce8's tree, which
// reduce4 repeats; values: even and odd positions in two sums, added at the end), so the bits
// are theirs (tested against the values in an fp32 cache).
inline __m128 reduce4(const __m256* a) {  // out[t] = sum of the 8 lanes of a[t], t < 4
  const __m256 c = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(c), _mm256_extractf128_ps(c, 1));
}

template <int NV, int JB, typename T>
void qscores_block(const float* q, const void* const* rows, const float* sc, int64_t n,
                   float* s) {  // query rows q[0, JB) against 4 K rows at a time
  for (int64_t i = 0; i < n; i += 4) {
    __m256 a[JB][4];
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
      const T* k = static_cast<const T*>(rows[i + t]);
      const __m256 st = _mm256_set1_ps(sc[i + t]);
      const __m256 w = row8<T>(k, st);
#pragma GCC unroll 4
      for (int jj = 0; jj < JB; ++jj) a[jj][t] = _mm256_mul_ps(_mm256_loadu_ps(q + jj * NV * 8), w);
#pragma GCC unroll 16
      for (int c = 1; c < NV; ++c) {
        const __m256 wc = row8<T>(k + c * 8, st);
#pragma GCC unroll 4
        for (int jj = 0; jj < JB; ++jj)
          a[jj][t] = _mm256_fmadd_ps(_mm256_loadu_ps(q + jj * NV * 8 + c * 8), wc, a[jj][t]);
      }
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < JB; ++jj) _mm_storeu_ps(s + jj * TILE + i, reduce4(a[jj]));
  }
}

template <int NV, typename T>
void qscores_avx2(const float* q, int64_t g, const void* const* rows, const float* sc,
                  int64_t n, float* s) {
  int64_t j = 0;
  for (; j + 3 <= g; j += 3) qscores_block<NV, 3, T>(q + j * NV * 8, rows, sc, n, s + j * TILE);
  if (g - j == 2) qscores_block<NV, 2, T>(q + j * NV * 8, rows, sc, n, s + j * TILE);
  if (g - j == 1) qscores_block<NV, 1, T>(q + j * NV * 8, rows, sc, n, s + j * TILE);
}

template <int NV, int JB, typename T>
void qvalues_block(float* acc, const float* p, const void* const* rows, const float* sc,
                   int64_t n) {  // acc rows [0, JB), one column chunk of 8 at a time
  for (int c = 0; c < NV; ++c) {
    __m256 a0[JB], a1[JB];
#pragma GCC unroll 4
    for (int jj = 0; jj < JB; ++jj) {
      a0[jj] = _mm256_loadu_ps(acc + jj * NV * 8 + c * 8);
      a1[jj] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < n; i += 2) {  // rows and p are padded to 16 (zero rows, p = 0)
      const __m256 w0 = row8<T>(static_cast<const T*>(rows[i]) + c * 8, _mm256_set1_ps(sc[i]));
      const __m256 w1 =
          row8<T>(static_cast<const T*>(rows[i + 1]) + c * 8, _mm256_set1_ps(sc[i + 1]));
#pragma GCC unroll 4
      for (int jj = 0; jj < JB; ++jj) {
        a0[jj] = _mm256_fmadd_ps(_mm256_set1_ps(p[jj * TILE + i]), w0, a0[jj]);
        a1[jj] = _mm256_fmadd_ps(_mm256_set1_ps(p[jj * TILE + i + 1]), w1, a1[jj]);
      }
    }
#pragma GCC unroll 4
    for (int jj = 0; jj < JB; ++jj)
      _mm256_storeu_ps(acc + jj * NV * 8 + c * 8, _mm256_add_ps(a0[jj], a1[jj]));
  }
}

template <int NV, typename T>
void qvalues_avx2(float* acc, int64_t g, const float* p, const void* const* rows,
                  const float* sc, int64_t n) {
  int64_t j = 0;
  for (; j + 4 <= g; j += 4) qvalues_block<NV, 4, T>(acc + j * NV * 8, p + j * TILE, rows, sc, n);
  if (g - j == 3) qvalues_block<NV, 3, T>(acc + j * NV * 8, p + j * TILE, rows, sc, n);
  if (g - j == 2) qvalues_block<NV, 2, T>(acc + j * NV * 8, p + j * TILE, rows, sc, n);
  if (g - j == 1) qvalues_block<NV, 1, T>(acc + j * NV * 8, p + j * TILE, rows, sc, n);
}
#endif

// Whether scores_fn(..., q_bf16 = true) exists here: then q goes in as bf16, unscaled.
inline bool dpbf16_scores(Kind rows, int64_t d) {
#if defined(__AVX512BF16__)
  return rows == Kind::BF16 && d % 32 == 0 && d <= 128;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
// fn<head_dim / 16, T> where a template exists for head_dim d.
#define PAGEDLLM_BY_NV(fn, T)                                                              \
  switch (d) {                                                                             \
    case 16: return fn<1, T>;  case 32: return fn<2, T>;  case 48: return fn<3, T>;        \
    case 64: return fn<4, T>;  case 80: return fn<5, T>;  case 96: return fn<6, T>;        \
    case 112: return fn<7, T>; case 128: return fn<8, T>; default: break;                  \
  }
#define PAGEDLLM_SCORES scores_avx512
#define PAGEDLLM_VALUES values_avx512
#elif defined(__AVX2__) && defined(__FMA__)
// fn<head_dim / 8, T> where a template exists for head_dim d.
#define PAGEDLLM_BY_NV(fn, T)                                                              \
  switch (d) {                                                                             \
    case 16: return fn<2, T>;  case 32: return fn<4, T>;  case 48: return fn<6, T>;        \
    case 64: return fn<8, T>;  case 80: return fn<10, T>; case 96: return fn<12, T>;       \
    case 112: return fn<14, T>; case 128: return fn<16, T>; default: break;                \
  }
#define PAGEDLLM_SCORES scores_avx2
#define PAGEDLLM_VALUES values_avx2
#else
#define PAGEDLLM_BY_NV(fn, T)
#endif

template <typename T>
ScoresFn scores_for(int64_t d) {
  PAGEDLLM_BY_NV(PAGEDLLM_SCORES, T)
  return scores_plain<T>;
}

template <typename T>
ValuesFn values_for(int64_t d) {
  PAGEDLLM_BY_NV(PAGEDLLM_VALUES, T)
  return values_plain<T>;
}
#undef PAGEDLLM_BY_NV
#undef PAGEDLLM_SCORES
#undef PAGEDLLM_VALUES

// The loops over int8 / fp8 rows as stored for head_dim d, where they exist (AVX2 builds;
// `bench kernel`, 125M shapes, e4m3: 0.97-1.13x and 0.59-0.62x of contiguous SDPA at context
// 512 and 2048, from 1.88-1.97x and 1.00-1.07x widening rows once per query row); else null
// (AVX-512 builds convert rows first).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGEDLLM_Q(fn)                                                                       \
  switch (rows) {                                                                            \
    case Kind::I8: PAGEDLLM_Q_NV(fn, int8_t)                                                 \
    case Kind::E4M3: PAGEDLLM_Q_NV(fn, c10::Float8_e4m3fn)                                   \
    case Kind::E5M2: PAGEDLLM_Q_NV(fn, c10::Float8_e5m2)                                     \
    default: break;                                                                          \
  }
#define PAGEDLLM_Q_NV(fn, T)                                                                 \
  switch (d) {                                                                               \
    case 32: return fn<4, T>;  case 64: return fn<8, T>;  case 96: return fn<12, T>;         \
    case 128: return fn<16, T>; default: return nullptr;                                     \
  }
#else
#define PAGEDLLM_Q(fn)
#endif

inline QScoresFn qscores_fn(Kind rows, int64_t d) {
  PAGEDLLM_Q(qscores_avx2)
  (void)rows, (void)d;
  return nullptr;
}

inline QValuesFn qvalues_fn(Kind rows, int64_t d) {
  PAGEDLLM_Q(qvalues_avx2)
  (void)rows, (void)d;
  return nullptr;
}
#undef PAGEDLLM_Q
#undef PAGEDLLM_Q_NV

// The scores loop for K rows of kind `rows` (F32, F16 or BF16) and head_dim d; q_bf16: q
// goes in as bf16 (only where dpbf16_scores says so).
inline ScoresFn scores_fn(Kind rows, int64_t d, bool q_bf16) {
#if defined(__AVX512BF16__)
  if (q_bf16) {
    switch (d) {
      case 32: return scores_dpbf16<1>;
      case 64: return scores_dpbf16<2>;
      case 96: return scores_dpbf16<3>;
      case 128: return scores_dpbf16<4>;
      default: break;
    }
  }
#endif
  TORCH_CHECK(!q_bf16, "no bf16 scores loop for head_dim ", d);
  switch (rows) {
    case Kind::BF16: return scores_for<c10::BFloat16>(d);
    case Kind::F16: return scores_for<c10::Half>(d);
    default: return scores_for<float>(d);
  }
}

inline ValuesFn values_fn(Kind rows, int64_t d) {
  switch (rows) {
    case Kind::BF16: return values_for<c10::BFloat16>(d);
    case Kind::F16: return values_for<c10::Half>(d);
    default: return values_for<float>(d);
  }
}

}  // namespace pagedllm
