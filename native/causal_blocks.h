// What both flash-style prompt kernels do alike (prefill_attention.cpp on
// AMX tiles, prefill_attention_f32.cpp on FMAs): the call's shapes, the
// first block of 32 keys a block of query rows sees, which keys a query row
// sees, the row's largest visible score, and the factor a row's running
// output is rescaled by when its max moves.
#pragma once

#include "vec_math.h"

#include <algorithm>
#include <cstdint>
#include <limits>

namespace aioserve {

// `count` requests' chunks side by side, each q_len queries over kv_len keys
// (its last q_len the chunk's own); strides in elements.
struct CausalShapes {
  int64_t count, q_len, kv_len, heads, kv_heads, dim;
  int64_t q_tok, q_head, k_tok, k_head, v_tok, v_head;
  int64_t window;  // > 0: a query sees no key `window` or more behind it
  float scale;
};

constexpr int64_t kBlockKeys = 32;  // keys of a score block: two 16-lane vectors a row

// The first key block a block of query rows from `first_position` sees:
// with a window, the blocks wholly before its first row's window hold no
// key any of its rows sees.
inline int64_t first_key_block(int64_t first_position, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, first_position - window + 1) / kBlockKeys * kBlockKeys : 0;
}

}  // namespace aioserve

#if defined(__AVX512F__)
namespace aioserve {

// The keys k0 .. k0 + 15 (lo) and k0 + 16 .. k0 + 31 (hi) of a block that
// the query at `position` sees: those up to it and, with a window (> 0),
// none `window` or more behind it.
struct VisibleKeys {
  __mmask16 lo, hi;
};

inline VisibleKeys visible_keys(int64_t position, int64_t k0, int64_t window) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i upper = _mm512_add_epi32(lanes, _mm512_set1_epi32(16));
  auto lane_of = [k0](int64_t key) {  // the key's lane in the block, -1 before it, 32 after
    return _mm512_set1_epi32(static_cast<int>(std::clamp<int64_t>(key - k0, -1, 32)));
  };
  const __m512i last = lane_of(position), first = lane_of(window > 0 ? position - window + 1 : k0 - 1);
  return {static_cast<__mmask16>(_mm512_cmple_epi32_mask(lanes, last) & _mm512_cmpge_epi32_mask(lanes, first)),
          static_cast<__mmask16>(_mm512_cmple_epi32_mask(upper, last) & _mm512_cmpge_epi32_mask(upper, first))};
}

// A row's 32 scores (float32 sums) times `scale`, the keys it does not see
// -inf: the larger of each lane's two (reduce16 then gives the row's max).
inline __m512 visible_max(const float* row, __m512 scale, VisibleKeys visible) {
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  return _mm512_max_ps(_mm512_mask_mul_ps(minus_inf, visible.lo, _mm512_loadu_ps(row), scale),
                       _mm512_mask_mul_ps(minus_inf, visible.hi, _mm512_loadu_ps(row + 16), scale));
}

// exp(old - top), a lane a row, by `exp`: 0 before a row's first key (old =
// -inf), exactly 1 where the max stayed (both exps give exp(0) = 1).
template <typename Exp>
inline __m512 rescale_factors(__m512 old_max, __m512 top, Exp exp) {
  const __mmask16 seen = _mm512_cmp_ps_mask(old_max, _mm512_set1_ps(-std::numeric_limits<float>::infinity()),
                                            _CMP_NEQ_OQ);
  return _mm512_maskz_mov_ps(seen, exp(_mm512_sub_ps(old_max, top)));
}

// Each of acc's first `rows` rows (`dim` floats, a multiple of 16) times its
// factor, where that is not 1.
inline void rescale_rows(float* acc, int64_t dim, const float* factors, int64_t rows) {
  for (int64_t i = 0; i < rows; ++i) {
    if (factors[i] == 1.f) continue;
    const __m512 f = _mm512_set1_ps(factors[i]);
    float* a = acc + i * dim;
    for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(a + d, _mm512_mul_ps(f, _mm512_loadu_ps(a + d)));
  }
}

}  // namespace aioserve
#endif
