// Float math shared by the kernels.
#pragma once

#include "half.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace aioserve {

#if defined(__AVX512F__)
// 16 values widened to float32: bf16 by a shift, fp16 by the conversion instruction.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// 32 bf16 values (a 64-byte load) as two float32 vectors, exactly: the even
// elements (each 32-bit word's low half, shifted up) and the odd ones (its
// high half, the low half masked off). Two integer instructions, where
// vdpbf16ps (which widens inside) runs at half the rate of an FMA.
struct SplitPairs {
  __m512 even, odd;
};
inline SplitPairs split_pairs(const BFloat16* p) {
  const __m512i x = _mm512_loadu_si512(p);
  return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16)),
          _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
}

// 16 float32 values as bf16 holds them, as float32: round_to<BFloat16> 16
// at a time (round to nearest even, a NaN as bf16's quiet NaN).
inline __m512 held_as_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd),
                                           _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc00000)));
}

// round_to<T> and from_float<T> (stored) 16 values at a time, bit for bit.
template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return held_as_bf16(v);
  } else if constexpr (std::is_same_v<T, Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}
// 16 values' bf16 bits (from_float<BFloat16> 16 at a time), packed.
inline __m256i bf16_bits16(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(held_as_bf16(v)), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(BFloat16* p, __m512 v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits16(v)); }
inline void store16(Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

#if defined(__AVX2__) && defined(__F16C__)
// 8 values widened to float32, the same way in AVX2's 256-bit registers.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}
inline __m256 load8(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
#endif

// exp(x) by range reduction to 2^n * exp(r), |r| <= ln2 / 2, and Cephes'
// polynomial (about 1 ulp): plain float arithmetic that vectorizes, where a
// call to std::exp does not. Overflows to inf as std::exp does (so silu(-inf)
// is NaN, as torch's); below -86.6 it stays at exp(-86.6) ~ 2e-38, which
// silu's 1 + exp(-x) cannot tell from 0. NaN stays NaN.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -86.6f), 88.8f);
  // Round to nearest by adding and removing 1.5 * 2^23 (std::floor does not vectorize).
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2^n as 2^(n-1) * 2: n reaches 128, one past the largest float exponent.
  const int32_t bits = (static_cast<int32_t>(n) + 126) << 23;
  float half_scale;
  std::memcpy(&half_scale, &bits, sizeof half_scale);
  return p * half_scale * 2.f;
}

#if defined(__AVX512F__)
// exp_approx 16 values at a time: the same operations in the same order (so
// the same bits, where the caller does not let the compiler fuse a multiply
// and an add, as elementwise.cpp does not), the clamps written so that a
// NaN passes them as std::min and std::max let it.
inline __m512 exp_approx16(__m512 x) {
  x = _mm512_min_ps(_mm512_set1_ps(88.8f), _mm512_max_ps(_mm512_set1_ps(-86.6f), x));
  const __m512 big = _mm512_set1_ps(12582912.f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), big), big);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(126)), 23);
  return _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(bits)), _mm512_set1_ps(2.f));
}

// Sixteen vectors' horizontal reductions (max or sum) into one vector, lane
// i for vector i: a tree of 15 merges, each two shuffles and one operation
// (16 separate reductions take four shuffles and four operations apiece,
// each waiting on the last). The tree leaves the rows permuted; one
// permute, its index found once by running the tree on vectors 0..15, puts
// them in order.
template <typename Op>
inline __m512 reduce16_unordered(const __m512* v, Op op) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // 512 -> 256 bits a vector, two vectors a register
    a[i] = op(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44), _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // -> 128 bits
    b[i] = op(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // -> 64 bits
    c[i] = op(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  }
  return op(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));  // -> 32 bits
}

inline __m512 max_op(__m512 x, __m512 y) { return _mm512_max_ps(x, y); }
inline __m512 add_op(__m512 x, __m512 y) { return _mm512_add_ps(x, y); }

// The permute that puts reduce16_unordered's lanes in row order.
inline __m512i reduce16_order() {
  static const __m512i order = [] {
    __m512 rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = _mm512_set1_ps(static_cast<float>(i));
    alignas(64) float where[16];
    _mm512_store_ps(where, reduce16_unordered(rows, max_op));
    alignas(64) int32_t index[16];
    for (int lane = 0; lane < 16; ++lane) index[static_cast<int>(where[lane])] = lane;
    return _mm512_load_si512(index);
  }();
  return order;
}

template <typename Op>
inline __m512 reduce16(const __m512* v, Op op) {
  return _mm512_permutexvar_ps(reduce16_order(), reduce16_unordered(v, op));
}
#endif

// The first index in p[0, n) holding `target` (a NaN when `nan`), which is
// there: blocks are tested with a vectorized any(), then one block's elements
// one by one (a plain scan, which stops early, does not vectorize).
inline int64_t find_first(const float* p, int64_t n, float target, bool nan) {
  constexpr int64_t kBlock = 64;
  int64_t start = 0;
  for (; start + kBlock <= n; start += kBlock) {
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t i = 0; i < kBlock; ++i) hit |= nan ? p[start + i] != p[start + i] : p[start + i] == target;
    if (hit) break;
  }
  while (nan ? !std::isnan(p[start]) : p[start] != target) ++start;
  return start;
}

// The max of p[0, n) and the first index holding it; a NaN counts as the max
// (torch.argmax's answer for a row with NaN is its first NaN), so the
// sampler sees the row as not finite.
inline std::pair<float, int64_t> max_argmax(const float* p, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  int has_nan = 0;
#pragma omp simd reduction(max : best) reduction(| : has_nan)
  for (int64_t i = 0; i < n; ++i) {
    best = p[i] > best ? p[i] : best;
    has_nan |= p[i] != p[i];
  }
  const int64_t index = find_first(p, n, best, has_nan);
  return {p[index], index};
}

// Merging max_argmax's answers for consecutive stretches of one row, in
// order: whether the later stretch's max takes over from the best so far.
// Only a strictly larger one (the first index wins ties), or a first NaN,
// which then stays: the answer one pass over the whole row gives.
inline bool later_max_wins(float best, float later) { return best == best && (later != later || later > best); }

}  // namespace aioserve
