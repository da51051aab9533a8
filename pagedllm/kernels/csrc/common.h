// Element conversions and small vector loops shared by the CPU kernels. Loops are plain C++
// under `omp simd` (built with -O3 -march=native -fopenmp), so the compiler vectorises them for
// the machine that builds them; fp16 uses F16C conversions where the CPU has them.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagedllm {

enum class Kind { F32, F16, BF16, I8, E4M3, E5M2 };

inline Kind kind_of(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat: return Kind::F32;
    case at::kHalf: return Kind::F16;
    case at::kBFloat16: return Kind::BF16;
    case at::kChar: return Kind::I8;
    case at::kFloat8_e4m3fn: return Kind::E4M3;
    case at::kFloat8_e5m2: return Kind::E5M2;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", t);
  }
}

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Element i of x (fp32, bf16 or fp16) as fp32, exactly.
template <typename T>
inline float widen(const T* x, int64_t i) {
  if constexpr (std::is_same_v<T, float>)
    return x[i];
  else if constexpr (std::is_same_v<T, c10::BFloat16>)
    return bf16_to_float(reinterpret_cast<const uint16_t*>(x)[i]);
  else
    return c10::detail::fp16_ieee_to_fp32_value(reinterpret_cast<const uint16_t*>(x)[i]);
}

// fp8 bit patterns -> fp32, exact (a table per format, built once from c10's conversions).
inline const float* fp8_table(Kind k) {
  static const auto tables = [] {
    std::array<std::array<float, 256>, 2> t{};
    for (int i = 0; i < 256; ++i) {
      t[0][i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i),
                                                      c10::Float8_e4m3fn::from_bits()));
      t[1][i] = static_cast<float>(c10::Float8_e5m2(static_cast<uint8_t>(i),
                                                    c10::Float8_e5m2::from_bits()));
    }
    return t;
  }();
  return (k == Kind::E4M3 ? tables[0] : tables[1]).data();
}

// An fp8 value (E exponent bits, M mantissa bits, bias 2^(E-1) - 1) as fp32, exactly, for every
// finite value (a quantized cache holds no NaN or infinity: values are clamped to the format's
// largest): normal values move their exponent and mantissa into fp32's fields; subnormal ones
// (exponent 0) are m * 2^(1 - bias - M). The same values as fp8_table (both tested over every
// code: tests/attention/test_cpu_kernel.py, with PAGEDLLM_ISA=avx2 for the table).
template <int E, int M>
inline float fp8_bits_to_float(uint8_t b) {
  constexpr int BIAS = (1 << (E - 1)) - 1;
  const uint32_t e = (b >> M) & ((1u << E) - 1), m = b & ((1u << M) - 1);
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24;
  const uint32_t normal = sign | ((e + 127 - BIAS) << 23) | (m << (23 - M));
  const float sub_mag = static_cast<float>(m) * (1.0f / static_cast<float>(1u << (BIAS - 1 + M)));
  uint32_t sub;
  std::memcpy(&sub, &sub_mag, 4);
  const uint32_t bits = e == 0 ? (sign | sub) : normal;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// dst[0:n] = src[0:n] (of kind k) * s, in fp32. Dequantizing is exact: an 8-bit value times a
// bf16 scale fits an fp32 mantissa, so this equals attention/quant.py's dequantize bit for bit.
inline void to_float(Kind k, const void* src, float s, float* __restrict dst, int64_t n) {
  switch (k) {
    case Kind::F32: {
      const float* x = static_cast<const float*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = x[i] * s;
      break;
    }
    case Kind::BF16: {
      const uint16_t* x = static_cast<const uint16_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(x[i]) * s;
      break;
    }
    case Kind::F16: {
      const uint16_t* x = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8) {
        __m256 f = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
        _mm256_storeu_ps(dst + i, _mm256_mul_ps(f, _mm256_set1_ps(s)));
      }
#endif
      for (; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(x[i]) * s;
      break;
    }
    case Kind::I8: {
      const int8_t* x = static_cast<const int8_t*>(src);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(x[i]) * s;
      break;
    }
    case Kind::E4M3:
    case Kind::E5M2: {
      const uint8_t* x = static_cast<const uint8_t*>(src);
#if defined(__AVX512F__)
      // 16 codes at once as fp16 bits, widened by vcvtph2ps: e5m2 is fp16's top byte; e4m3's
      // exponent and mantissa shifted under fp16's field read 2^(15 - 7) too small (subnormals
      // too), so its scale goes in times 256 (exact: a power of two), and every value comes out
      // as fp8_bits_to_float's, times s (row8 in attention_tile.h does the same on AVX2). Intel
      // Xeon, 1 thread, 32 decode rows x 512 e4m3 keys: 4.97 ms by that arithmetic, 2.30 ms
      // (docs/features/cpu-isa.md); the arithmetic had replaced 16 table gathers.
      const bool e4 = k == Kind::E4M3;
      const __m512 sv = _mm512_set1_ps(e4 ? s * 256.0f : s);
      int64_t i = 0;
      for (; i + 16 <= n; i += 16) {
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
        const __m256i h =  // e4m3: the sign lands in bit 15, the code's bit 7 also in bit 14
            e4 ? _mm256_and_si256(_mm256_slli_epi16(_mm256_cvtepi8_epi16(b), 7),
                                  _mm256_set1_epi16(static_cast<short>(0xBF80)))
               : _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8);
        _mm512_storeu_ps(dst + i, _mm512_mul_ps(_mm512_cvtph_ps(h), sv));
      }
      for (; i < n; ++i)
        dst[i] = (e4 ? fp8_bits_to_float<4, 3>(x[i]) : fp8_bits_to_float<5, 2>(x[i])) * s;
#else
      const float* lut = fp8_table(k);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) dst[i] = lut[x[i]] * s;
#endif
      break;
    }
  }
}

// dst[0:n] (of kind k: fp32 / fp16 / bf16, round to nearest even) = src[0:n] * s.
inline void from_float(Kind k, const float* src, float s, void* dst, int64_t n) {
  switch (k) {
    case Kind::F32: {
      float* y = static_cast<float*>(dst);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y[i] = src[i] * s;
      break;
    }
    case Kind::F16: {
      c10::Half* y = static_cast<c10::Half*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = c10::Half(src[i] * s);
      break;
    }
    case Kind::BF16: {
      c10::BFloat16* y = static_cast<c10::BFloat16*>(dst);
      for (int64_t i = 0; i < n; ++i) y[i] = c10::BFloat16(src[i] * s);
      break;
    }
    default: TORCH_CHECK(false, "outputs are fp32, fp16 or bf16");
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
#if defined(__AVX512F__)
  if (n % 16 == 0) {  // one 16-lane accumulator, one tree reduction (GCC's own epilogue for
    __m512 acc = _mm512_setzero_ps();  // a `simd reduction` loop sums 16 lanes one by one)
    for (int64_t i = 0; i < n; i += 16)
      acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#endif
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* __restrict y, float a, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// The largest of init and x[0, n), in vector registers: max is exact in any order, so this is
// the scalar loop's value (a scalar loop is one 4-cycle dependency chain per element).
inline float max_from(const float* x, int64_t n, float init) {
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 v = _mm512_set1_ps(init);
  for (; i + 16 <= n; i += 16) v = _mm512_max_ps(v, _mm512_loadu_ps(x + i));
  if (i < n)
    v = _mm512_max_ps(v, _mm512_mask_loadu_ps(v, (__mmask16)((1u << (n - i)) - 1), x + i));
  return _mm512_reduce_max_ps(v);
#else
#if defined(__AVX2__)
  __m256 v = _mm256_set1_ps(init);
  for (; i + 8 <= n; i += 8) v = _mm256_max_ps(v, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (float l : lanes) init = std::max(init, l);
#endif
  for (; i < n; ++i) init = std::max(init, x[i]);
  return init;
#endif
}

inline void scale_row(float* y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

// exp(x) for x <= ~88 (Cephes' expf: range reduction by ln 2, degree-5 polynomial, 2^n from
// the exponent bits), within 2 ulp; branch-free so `omp simd` loops vectorise it. Inputs below
// -87.3 give 0.
#pragma omp declare simd
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.33654f), 88.37626f);
  float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float p;
  std::memcpy(&p, &bits, 4);
  return y * p;
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// exp_approx on 8 lanes (AVX2 builds), the same operations in the same order: the same bits as
// the scalar loop and as exp16 (elementwise.cpp is built with -ffp-contract=off, so no multiply
// and add below is fused).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
  __m256 n = _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                           _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f))),
                           _mm256_mul_ps(n, _mm256_set1_ps(2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    y = _mm256_add_ps(_mm256_mul_ps(y, r), _mm256_set1_ps(c));
  y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, r), r), r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
#endif

#if defined(__AVX512F__)
// exp_approx on 16 lanes, the same operations in the same order (so the same bits). Written
// with intrinsics because GCC turns the scalar clamp into range splits with duplicated work.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.37626f));
  __m512 n = _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                           _mm512_set1_ps(0.5f));
  n = _mm512_roundscale_ps(n, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                           _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  for (float c : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f,
                  5.0000001201e-1f})
    y = _mm512_add_ps(_mm512_mul_ps(y, r), _mm512_set1_ps(c));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, r), r), r), _mm512_set1_ps(1.0f));
  __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
}

// 16 elements of T <-> fp32 lanes (bf16 / fp16 rounded to nearest even, like c10's casts for
// finite values).
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) { return _mm512_loadu_ps(p); }
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

template <typename T>
inline void store16(T* p, __m512 x);
template <>
inline void store16<float>(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
template <>
inline void store16<c10::BFloat16>(c10::BFloat16* p, __m512 x) {
  __m512i u = _mm512_castps_si512(x);
  __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  u = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(u));
}
template <>
inline void store16<c10::Half>(c10::Half* p, __m512 x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// x rounded to T and back (the rounding an unfused torch op applies between two steps).
template <typename T>
inline __m512 round16(__m512 x) {
  if constexpr (std::is_same_v<T, float>) {
    return x;
  } else {
    alignas(64) T tmp[16];
    store16<T>(tmp, x);
    return load16<T>(tmp);
  }
}
#endif

}  // namespace pagedllm
