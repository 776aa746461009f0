// The small ops of a CPU decode step, each fused into one kernel: a small
// model's step is bound by per-op overhead (dispatch, allocation, a pass over
// memory per op), not by arithmetic.
//   rms_norm: RMSNorm, optionally after the residual add (residual updated in
//     place); also serves Qwen3's per-head q/k norm on a [T, H, D] view.
//   rotary_embedding: RoPE ("rotate half") on q and k in place.
//   store_kv: new keys and values into their cache slots, converted to the
//     cache's dtype (FP8 e4m3 too: saturated, as the pool's torch path does).
//   silu_and_mul: SwiGLU over a fused [gate | up] projection.
//   row_max_argmax: greedy sampling's max and first argmax of each row in one
//     pass (torch.argmax is slow on CPU, and the max was a second pass).
// Each matches its torch twin's rounding: torch computes a half-precision
// op in float32 and rounds its result to the tensor's dtype, so these round
// after every op the twin does, not only at the end.

#include "half.h"
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

// torch rounds every product and sum to float32 on its own; a fused
// multiply-add (which -march=native lets the compiler contract a * b + c
// into) skips a rounding, and the kernels would drift from their twins.
// After the includes: this file's code only.
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

#include "vec_math.h"  // after the pragma: its exp_approx is compiled under it here

namespace aioserve {
namespace {

// Below this many elements a thread costs more than it saves.
constexpr int64_t kGrainElements = 16384;

inline int64_t row_grain(int64_t row_size) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_size)); }

using aioserve::from_float;
using aioserve::round_to;
using aioserve::to_float;

// ---- rms_norm ----------------------------------------------------------------

#if defined(__AVX512F__)
// Rows of rms_norm_impl 16 values at a time, the same roundings in the
// same order but for the sum of squares: 16 lanes' partial sums, then one
// fixed reduction (the compiler's `omp simd` reduction summed the lanes one
// by one through memory, a chain of 16 dependent adds; a Qwen3 head's row of
// 128 cost ~110 cycles that way). Every row takes the same steps, so a row's
// result does not depend on the rows beside it.
//
// Rows go Rows at a time, each with its own sums: one row's steps are a
// chain (its adds, the reduction, the square root and division, then the
// scaling), and a 128-wide row (a Qwen3 head's q/k norm) waited on it,
// ~180 cycles a row; side by side the rows' chains overlap.
template <int Rows, typename X, typename W, typename O>
inline void rms_norm_rows16(const X* const (&srcs)[Rows], X* const (&res)[Rows], const W* w, O* const (&dst)[Rows],
                            int64_t dim, float eps) {
  __m512 squares[Rows];
  const X* src[Rows];
  for (int r = 0; r < Rows; ++r) squares[r] = _mm512_setzero_ps();
  for (int r = 0; r < Rows; ++r) src[r] = srcs[r];
  if (res[0] != nullptr) {
    for (int64_t d = 0; d < dim; d += 16) {
      for (int r = 0; r < Rows; ++r) {
        const __m512 s = round16<X>(_mm512_add_ps(load16(src[r] + d), load16(res[r] + d)));
        store16(res[r] + d, s);
        squares[r] = _mm512_add_ps(squares[r], _mm512_mul_ps(s, s));
      }
    }
    for (int r = 0; r < Rows; ++r) src[r] = res[r];
  } else {
    for (int64_t d = 0; d < dim; d += 16) {
      for (int r = 0; r < Rows; ++r) {
        const __m512 v = load16(src[r] + d);
        squares[r] = _mm512_add_ps(squares[r], _mm512_mul_ps(v, v));
      }
    }
  }
  __m512 scale[Rows];
  for (int r = 0; r < Rows; ++r)
    scale[r] = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares[r]) / static_cast<float>(dim) + eps));
  for (int64_t d = 0; d < dim; d += 16) {
    const __m512 weight = load16(w + d);
    for (int r = 0; r < Rows; ++r)
      store16(dst[r] + d, _mm512_mul_ps(weight, round16<X>(_mm512_mul_ps(load16(src[r] + d), scale[r]))));
  }
}

// Rows [begin, end) through rms_norm_rows16, four at a time, then the rest
// one by one: row r from src(r) (with res(r), or nullptr: no residual) into
// dst(r).
template <typename X, typename W, typename O, typename Src, typename Res, typename Dst>
inline void rms_norm_rows(int64_t begin, int64_t end, const Src& src, const Res& res, const W* w, const Dst& dst,
                          int64_t dim, float eps) {
  constexpr int kRows = 4;
  int64_t r = begin;
  for (; r + kRows <= end; r += kRows) {
    const X* srcs[kRows];
    X* residuals[kRows];
    O* dsts[kRows];
    for (int i = 0; i < kRows; ++i) {
      srcs[i] = src(r + i);
      residuals[i] = res(r + i);
      dsts[i] = dst(r + i);
    }
    rms_norm_rows16<kRows>(srcs, residuals, w, dsts, dim, eps);
  }
  for (; r < end; ++r) {
    const X* srcs[1] = {src(r)};
    X* residuals[1] = {res(r)};
    O* dsts[1] = {dst(r)};
    rms_norm_rows16<1>(srcs, residuals, w, dsts, dim, eps);
  }
}
#endif

// O is the weight * normalized product's type: X when the weight is X, else
// float32 (torch's promotion of a float32 weight with a half-precision x).
template <typename X, typename W, typename O>
void rms_norm_impl(const X* x, Rows xr, X* residual, Rows rr, const W* w, O* out, int64_t dim, float eps) {
  aioserve::parallel_pieces(xr.count, row_grain(dim), [&](int64_t begin, int64_t end) {
#if defined(__AVX512F__)
    if (dim % 16 == 0) {
      rms_norm_rows<X, W, O>(
          begin, end, [&](int64_t r) { return x + xr.offset(r); },
          [&](int64_t r) { return residual != nullptr ? residual + rr.offset(r) : nullptr; }, w,
          [&](int64_t r) { return out + r * dim; }, dim, eps);
      return;
    }
#endif
    for (int64_t r = begin; r < end; ++r) {
      const X* src = x + xr.offset(r);
      float squares = 0.f;
      if (residual != nullptr) {
        // x + residual rounded to X, as torch adds two X tensors; it becomes
        // the new residual and the norm's input.
        X* res = residual + rr.offset(r);
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < dim; ++d) {
          const float s = round_to<X>(to_float(src[d]) + to_float(res[d]));
          res[d] = from_float<X>(s);
          squares += s * s;
        }
        src = res;
      } else {
#pragma omp simd reduction(+ : squares)
        for (int64_t d = 0; d < dim; ++d) squares += to_float(src[d]) * to_float(src[d]);
      }
      // rsqrt as torch's CPU kernel computes it: 1 / sqrt, two roundings.
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(dim) + eps);
      O* dst = out + r * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<O>(to_float(w[d]) * round_to<X>(to_float(src[d]) * inv));
    }
  });
}

}  // namespace

void rms_norm(const void* x, Rows xr, void* residual, Rows rr, int x_type, const void* weight, int w_type, void* out,
              int64_t dim, float eps) {
  dispatch_float(x_type, "rms_norm", [&](auto x_tag) {
    using X = decltype(x_tag);
    dispatch_float(w_type, "rms_norm", [&](auto w_tag) {
      using W = decltype(w_tag);
      using O = std::conditional_t<std::is_same_v<X, W>, X, float>;
      rms_norm_impl<X, W, O>(static_cast<const X*>(x), xr, static_cast<X*>(residual), rr, static_cast<const W*>(weight),
                             static_cast<O*>(out), dim, eps);
    });
  });
}

void check_indices(const int64_t* values, int64_t count, int64_t limit, const char* what) {
  for (int64_t t = 0; t < count; ++t)
    AIOSERVE_CHECK(values[t] >= 0 && values[t] < limit, what, values[t], " outside [0, ", limit, ")");
}

namespace {

// ---- rotary_embedding --------------------------------------------------------

// One head's row rotated in place: x * cos + rotate_half(x) * sin, where
// rotate_half(x) = [-x2, x1], with cos and sin rounded to T as the twin
// converts them, and every product and the sum rounded to T.
template <typename T>
inline void rotate_row(T* x, const float* cos, const float* sin, int64_t half) {
#pragma omp simd
  for (int64_t d = 0; d < half; ++d) {
    const float x1 = to_float(x[d]), x2 = to_float(x[d + half]);
    const float c1 = round_to<T>(cos[d]), s1 = round_to<T>(sin[d]);
    const float c2 = round_to<T>(cos[d + half]), s2 = round_to<T>(sin[d + half]);
    x[d] = from_float<T>(round_to<T>(x1 * c1) + round_to<T>(-x2 * s1));
    x[d + half] = from_float<T>(round_to<T>(x2 * c2) + round_to<T>(x1 * s2));
  }
}

#if defined(__AVX512F__)
constexpr int64_t kMaxVectorHalf = 128;  // head dims up to 256 take rotate_row16

// rotate_row 16 dims at a time (half a multiple of 16), bit for bit, with the
// token's cos and sin already rounded to T, once for all its heads (cs:
// [c1 | s1 | c2 | s2], half floats each). Half-precision rows only: there
// each product is rounded before the sum, so no fused multiply-add can
// differ between the two forms. The scalar loop, which rounded cos and sin
// again for every head and stored through from_float, took 1.8 ms for a
// 2048-token chunk of Qwen3-0.6B's 24 heads on 2 cores.
template <typename T>
inline void rotate_row16(T* x, const float* cs, int64_t half) {
  const __m512i sign = _mm512_set1_epi32(INT32_MIN);
  for (int64_t d = 0; d < half; d += 16) {
    const __m512 x1 = load16(x + d), x2 = load16(x + d + half);
    const __m512 minus_x2 = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), sign));
    const __m512 c1 = _mm512_loadu_ps(cs + d), s1 = _mm512_loadu_ps(cs + half + d);
    const __m512 c2 = _mm512_loadu_ps(cs + 2 * half + d), s2 = _mm512_loadu_ps(cs + 3 * half + d);
    store16(x + d, _mm512_add_ps(round16<T>(_mm512_mul_ps(x1, c1)), round16<T>(_mm512_mul_ps(minus_x2, s1))));
    store16(x + d + half, _mm512_add_ps(round16<T>(_mm512_mul_ps(x2, c2)), round16<T>(_mm512_mul_ps(x1, s2))));
  }
}

// A token's cos and sin rounded to T for rotate_row16: cs = [c1 | s1 | c2 | s2].
template <typename T>
inline void token_cos_sin(const float* c, const float* s, int64_t half, float* cs) {
  for (int64_t d = 0; d < half; d += 16) {
    _mm512_store_ps(cs + d, round16<T>(_mm512_loadu_ps(c + d)));
    _mm512_store_ps(cs + half + d, round16<T>(_mm512_loadu_ps(s + d)));
    _mm512_store_ps(cs + 2 * half + d, round16<T>(_mm512_loadu_ps(c + half + d)));
    _mm512_store_ps(cs + 3 * half + d, round16<T>(_mm512_loadu_ps(s + half + d)));
  }
}
#endif

template <typename T>
void rotary_impl(const int64_t* positions, T* q, Rows qr, T* k, Rows kr, const float* cos, const float* sin,
                 int64_t tokens, int64_t dim) {
  const int64_t q_heads = qr.inner, k_heads = kr.inner, half = dim / 2;
#if defined(__AVX512F__)
  constexpr bool kHalfRows = std::is_same_v<T, BFloat16> || std::is_same_v<T, Half>;
  const bool by16 = kHalfRows && half % 16 == 0 && half <= kMaxVectorHalf;
#endif
  aioserve::parallel_pieces(tokens, row_grain((q_heads + k_heads) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * dim;
      const float* s = sin + positions[t] * dim;
#if defined(__AVX512F__)
      if (by16) {
        alignas(64) float cs[4 * kMaxVectorHalf];
        token_cos_sin<T>(c, s, half, cs);
        for (int64_t h = 0; h < q_heads; ++h) rotate_row16(q + t * qr.outer_stride + h * qr.inner_stride, cs, half);
        for (int64_t h = 0; h < k_heads; ++h) rotate_row16(k + t * kr.outer_stride + h * kr.inner_stride, cs, half);
        continue;
      }
#endif
      for (int64_t h = 0; h < q_heads; ++h) rotate_row(q + t * qr.outer_stride + h * qr.inner_stride, c, s, half);
      for (int64_t h = 0; h < k_heads; ++h) rotate_row(k + t * kr.outer_stride + h * kr.inner_stride, c, s, half);
    }
  });
}

}  // namespace

void rotary_embedding(const int64_t* positions, void* q, Rows qr, void* k, Rows kr, int type, const float* cos,
                      const float* sin, int64_t limit, int64_t tokens, int64_t dim) {
  check_indices(positions, tokens, limit, "rotary_embedding: position ");
  dispatch_float(type, "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    rotary_impl<T>(positions, static_cast<T*>(q), qr, static_cast<T*>(k), kr, cos, sin, tokens, dim);
  });
}

namespace {

// ---- store_kv ----------------------------------------------------------------

template <typename S, typename C>
void store_impl(const S* src, Rows sr, C* cache, const int64_t* slots, int64_t heads, int64_t dim) {
  aioserve::parallel_pieces(sr.count, row_grain(dim), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* from = src + sr.offset(r);
      C* to = cache + (slots[r / heads] * heads + r % heads) * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) to[d] = from_float<C>(to_float(from[d]));
    }
  });
}

}  // namespace

void store_kv(const void* src, Rows sr, int src_type, void* cache, int cache_type, const int64_t* slots,
              int64_t limit, int64_t heads, int64_t dim) {
  check_indices(slots, heads > 0 ? sr.count / heads : 0, limit, "store_kv: slot ");
  dispatch_float(src_type, "store_kv", [&](auto s_tag) {
    using S = decltype(s_tag);
    if (cache_type == kFloat8E4M3) {  // an FP8 cache: saturated, rounded to nearest even (half.h)
      store_impl<S, Float8E4M3>(static_cast<const S*>(src), sr, static_cast<Float8E4M3*>(cache), slots, heads, dim);
      return;
    }
    dispatch_float(cache_type, "store_kv", [&](auto c_tag) {
      using C = decltype(c_tag);
      store_impl<S, C>(static_cast<const S*>(src), sr, static_cast<C*>(cache), slots, heads, dim);
    });
  });
}

namespace {

// ---- qk_norm_rope_store --------------------------------------------------------

#if defined(__AVX512F__)
// `count` heads of one token, `stride` elements apart from `src`, into the
// rows `dst(i)`: RMSNormed by `weight` (rms_norm's rows, four at a time, each
// row's bits its own), or copied where there is no norm.
template <typename T, typename Dst>
inline void norm_heads(const T* src, int64_t stride, int64_t count, const T* weight, float eps, int64_t dim,
                       const Dst& dst) {
  if (weight == nullptr) {
    for (int64_t h = 0; h < count; ++h) std::memcpy(dst(h), src + h * stride, dim * sizeof(T));
    return;
  }
  rms_norm_rows<T, T, T>(
      0, count, [&](int64_t h) { return src + h * stride; }, [](int64_t) -> T* { return nullptr; }, weight, dst, dim,
      eps);
}

// rms_norm (q and k, if weights), rotary_embedding and store_kv one after the
// other, bit for bit, a token at a time in one parallel region: each head is
// normed into its destination (q's dense output, k's cache row), rotated
// there and, for k, copied back over its place in q|k|v (where a prompt's
// attention reads this step's keys); v is copied into its cache row. The
// separate ops took five parallel regions and read each head three times
// (a 64-row decode step of Qwen3-0.6B: 140 regions of its 28 layers).
template <typename T>
void qk_norm_rope_store_impl(const int64_t* positions, const T* q, Rows qr, T* k, Rows kr, const T* v, Rows vr,
                             const T* q_weight, const T* k_weight, float eps, const float* cos, const float* sin,
                             T* key_cache, T* value_cache, const int64_t* slots, int64_t tokens, int64_t dim,
                             T* q_out) {
  const int64_t q_heads = qr.inner, kv_heads = kr.inner, half = dim / 2;
  aioserve::parallel_pieces(tokens, row_grain((q_heads + 2 * kv_heads) * dim), [&](int64_t begin, int64_t end) {
    alignas(64) float cs[4 * kMaxVectorHalf];
    for (int64_t t = begin; t < end; ++t) {
      token_cos_sin<T>(cos + positions[t] * dim, sin + positions[t] * dim, half, cs);
      T* q_rows = q_out + t * q_heads * dim;
      norm_heads(q + t * qr.outer_stride, qr.inner_stride, q_heads, q_weight, eps, dim,
                 [&](int64_t h) { return q_rows + h * dim; });
      for (int64_t h = 0; h < q_heads; ++h) rotate_row16(q_rows + h * dim, cs, half);
      T* k_rows = key_cache + slots[t] * kv_heads * dim;
      T* k_here = k + t * kr.outer_stride;
      norm_heads(k_here, kr.inner_stride, kv_heads, k_weight, eps, dim, [&](int64_t h) { return k_rows + h * dim; });
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate_row16(k_rows + h * dim, cs, half);
        std::memcpy(k_here + h * kr.inner_stride, k_rows + h * dim, dim * sizeof(T));
      }
      T* v_rows = value_cache + slots[t] * kv_heads * dim;
      for (int64_t h = 0; h < kv_heads; ++h)
        std::memcpy(v_rows + h * dim, v + t * vr.outer_stride + h * vr.inner_stride, dim * sizeof(T));
    }
  });
}
#endif

// Whether qk_norm_rope_store may serve (aioserve_qk_norm_rope_store_use; AIOSERVE_QK_ROPE_STORE=0 in native_lib.py).
std::atomic<bool> qk_norm_rope_store_wanted{true};

}  // namespace

bool qk_norm_rope_store_fuses(int type, int cache_type, int64_t dim, int q_norm_type, int k_norm_type) {
#if defined(__AVX512F__)
  const bool norms = (q_norm_type == kNoNorm && k_norm_type == kNoNorm) || (q_norm_type == type && k_norm_type == type);
  return qk_norm_rope_store_wanted.load(std::memory_order_relaxed) && (type == kBFloat16 || type == kFloat16) &&
         cache_type == type && norms && dim % 32 == 0 && dim / 2 <= kMaxVectorHalf;
#else
  (void)type, (void)cache_type, (void)dim, (void)q_norm_type, (void)k_norm_type;
  return false;
#endif
}

void qk_norm_rope_store(const int64_t* positions, const void* q, Rows qr, void* k, Rows kr, const void* v, Rows vr,
                        int type, const void* q_weight, int q_norm_type, const void* k_weight, int k_norm_type,
                        float eps, const float* cos, const float* sin, int64_t max_positions, void* key_cache,
                        void* value_cache, int cache_type, const int64_t* slots, int64_t cache_slots, int64_t tokens,
                        int64_t dim, void* q_out) {
  AIOSERVE_CHECK((q_weight == nullptr) == (q_norm_type == kNoNorm) && (k_weight == nullptr) == (k_norm_type == kNoNorm),
                 "qk_norm_rope_store: a norm weight's type given without it, or none for it");
  AIOSERVE_CHECK((q_weight == nullptr) == (k_weight == nullptr), "qk_norm_rope_store: both norms or neither");
  AIOSERVE_CHECK(qk_norm_rope_store_fuses(type, cache_type, dim, q_norm_type, k_norm_type),
                 "qk_norm_rope_store: half-precision rows, cache and norm weights of one dtype, head dim a multiple "
                 "of 32 up to 256");
  AIOSERVE_CHECK(qr.count == tokens * qr.inner && kr.count == tokens * kr.inner && vr.inner == kr.inner,
                 "qk_norm_rope_store: q [T, Hq, D], k and v [T, Hk, D]");
  check_indices(positions, tokens, max_positions, "qk_norm_rope_store: position ");
  check_indices(slots, tokens, cache_slots, "qk_norm_rope_store: slot ");
#if defined(__AVX512F__)
  auto run = [&](auto tag) {
    using T = decltype(tag);
    qk_norm_rope_store_impl<T>(positions, static_cast<const T*>(q), qr, static_cast<T*>(k), kr,
                               static_cast<const T*>(v), vr, static_cast<const T*>(q_weight),
                               static_cast<const T*>(k_weight), eps, cos, sin, static_cast<T*>(key_cache),
                               static_cast<T*>(value_cache), slots, tokens, dim, static_cast<T*>(q_out));
  };
  if (type == kBFloat16) {
    run(BFloat16{});
  } else {
    run(Half{});
  }
#endif
}

namespace {

// ---- silu_and_mul ------------------------------------------------------------

// silu uses exp_approx (vec_math.h): exp by a polynomial that vectorizes.

template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t n) {
  aioserve::parallel_pieces(rows, row_grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * n;
      const T* up = gate + n;
      T* dst = out + r * n;
      int64_t j = 0;
#if defined(__AVX512F__)
      // 16 at a time, the loop below's operations in its order: as the
      // compiler vectorized that loop (each division, clamp and rounding
      // under masks, several times over) it took ~70 cycles per 16 values
      // (Qwen3-0.6B's 2048 x 3072 at 5.2 ms on 2 cores, torch's two ops 4.4).
      for (; j + 16 <= n; j += 16) {
        const __m512 g = load16(gate + j);
        const __m512 minus_g = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32(INT32_MIN)));
        const __m512 silu = round16<T>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_approx16(minus_g))));
        store16(dst + j, _mm512_mul_ps(silu, load16(up + j)));
      }
#endif
#pragma omp simd
      for (int64_t i = j; i < n; ++i) {
        const float g = to_float(gate[i]);
        // silu rounded to T first, as F.silu(gate) is a T tensor before `* up`.
        dst[i] = from_float<T>(round_to<T>(g / (1.f + exp_approx(-g))) * to_float(up[i]));
      }
    }
  });
}

}  // namespace

void silu_and_mul(const void* x, void* out, int type, int64_t rows, int64_t n) {
  dispatch_float(type, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_impl<T>(static_cast<const T*>(x), static_cast<T*>(out), rows, n);
  });
}

// ---- row_max_argmax ----------------------------------------------------------

// logits [rows, vocab > 0] float32, contiguous (each row's scan: max_argmax, vec_math.h).
void row_max_argmax(const float* p, int64_t rows, int64_t vocab, float* max_out, int64_t* arg_out) {
  // Fewer rows than threads: split each row into chunks for the others, then
  // merge (a 32k-152k row is worth it; a thread's start costs a few us).
  const int64_t threads = num_threads();
  const int64_t chunks = rows < threads ? std::clamp<int64_t>(vocab / 8192, 1, threads / std::max<int64_t>(rows, 1)) : 1;
  const int64_t chunk_len = (vocab + chunks - 1) / chunks;
  std::vector<std::pair<float, int64_t>> found(rows * chunks);
  aioserve::parallel_pieces(rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks, start = (task % chunks) * chunk_len;
      const int64_t len = std::min(chunk_len, vocab - start);
      auto [value, index] = aioserve::max_argmax(p + row * vocab + start, len);
      found[task] = {value, index + start};
    }
  });
  for (int64_t row = 0; row < rows; ++row) {
    // Chunks in order (later_max_wins, vec_math.h): the answer of one pass.
    auto best = found[row * chunks];
    for (int64_t c = 1; c < chunks; ++c) {
      const auto& next = found[row * chunks + c];
      if (aioserve::later_max_wins(best.first, next.first)) best = next;
    }
    max_out[row] = best.first;
    arg_out[row] = best.second;
  }
}

}  // namespace aioserve

extern "C" {

static int rms_norm_direct(const void* x, int64_t x_rows, int64_t x_inner, int64_t x_outer_stride, int64_t x_inner_stride,
                      void* residual, int64_t r_rows, int64_t r_inner, int64_t r_outer_stride, int64_t r_inner_stride,
                      int x_type, const void* weight, int w_type, void* out, int64_t dim, double eps) {
  return aioserve::guarded([&] {
    aioserve::rms_norm(x, {x_rows, x_inner, x_outer_stride, x_inner_stride}, residual,
                       {r_rows, r_inner, r_outer_stride, r_inner_stride}, x_type, weight, w_type, out, dim,
                       static_cast<float>(eps));
  });
}

static int rotary_embedding_direct(const int64_t* positions, void* q, int64_t q_heads, int64_t q_token_stride,
                              int64_t q_head_stride, void* k, int64_t k_heads, int64_t k_token_stride,
                              int64_t k_head_stride, int type, const float* cos, const float* sin, int64_t limit,
                              int64_t tokens, int64_t dim) {
  return aioserve::guarded([&] {
    aioserve::rotary_embedding(positions, q, {tokens * q_heads, q_heads, q_token_stride, q_head_stride}, k,
                               {tokens * k_heads, k_heads, k_token_stride, k_head_stride}, type, cos, sin, limit,
                               tokens, dim);
  });
}

// k and v: [tokens, heads, dim] rows (token and head strides), into
// contiguous caches [limit, heads, dim].
static int store_kv_direct(const void* k, int64_t k_token_stride, int64_t k_head_stride, const void* v,
                      int64_t v_token_stride, int64_t v_head_stride, int src_type, void* key_cache, void* value_cache,
                      int cache_type, const int64_t* slots, int64_t limit, int64_t tokens, int64_t heads,
                      int64_t dim) {
  return aioserve::guarded([&] {
    aioserve::store_kv(k, {tokens * heads, heads, k_token_stride, k_head_stride}, src_type, key_cache, cache_type,
                       slots, limit, heads, dim);
    aioserve::store_kv(v, {tokens * heads, heads, v_token_stride, v_head_stride}, src_type, value_cache, cache_type,
                       slots, limit, heads, dim);
  });
}

static int qk_norm_rope_store_fuses_direct(int type, int cache_type, int64_t dim, int q_norm_type, int k_norm_type) {
  return aioserve::qk_norm_rope_store_fuses(type, cache_type, dim, q_norm_type, k_norm_type) ? 1 : 0;
}

static int qk_norm_rope_store_direct(const int64_t* positions, const void* q, int64_t q_token_stride,
                                     int64_t q_head_stride, void* k, int64_t k_token_stride, int64_t k_head_stride,
                                     const void* v, int64_t v_token_stride, int64_t v_head_stride, int type,
                                     const void* q_weight, int q_norm_type, const void* k_weight, int k_norm_type,
                                     double eps, const float* cos,
                                     const float* sin, int64_t max_positions, void* key_cache, void* value_cache,
                                     int cache_type, const int64_t* slots, int64_t cache_slots, int64_t tokens,
                                     int64_t q_heads, int64_t kv_heads, int64_t dim, void* q_out) {
  return aioserve::guarded([&] {
    aioserve::qk_norm_rope_store(positions, q, {tokens * q_heads, q_heads, q_token_stride, q_head_stride}, k,
                                 {tokens * kv_heads, kv_heads, k_token_stride, k_head_stride}, v,
                                 {tokens * kv_heads, kv_heads, v_token_stride, v_head_stride}, type, q_weight,
                                 q_norm_type, k_weight, k_norm_type, static_cast<float>(eps), cos, sin, max_positions, key_cache, value_cache, cache_type,
                                 slots, cache_slots, tokens, dim, q_out);
  });
}

static int silu_and_mul_direct(const void* x, void* out, int type, int64_t rows, int64_t n) {
  return aioserve::guarded([&] { aioserve::silu_and_mul(x, out, type, rows, n); });
}

static int row_max_argmax_direct(const float* logits, int64_t rows, int64_t vocab, float* maxes, int64_t* argmaxes) {
  return aioserve::guarded([&] { aioserve::row_max_argmax(logits, rows, vocab, maxes, argmaxes); });
}

}  // extern "C"

extern "C" {

int aioserve_rms_norm(const void* record) { return aioserve::call_packed(rms_norm_direct, record); }
int aioserve_rotary_embedding(const void* record) { return aioserve::call_packed(rotary_embedding_direct, record); }
int aioserve_store_kv(const void* record) { return aioserve::call_packed(store_kv_direct, record); }
// Let qk_norm_rope_store serve where it applies (want != 0), or keep the separate ops. Process-wide.
void aioserve_qk_norm_rope_store_use(int want) {
  aioserve::qk_norm_rope_store_wanted.store(want != 0, std::memory_order_relaxed);
}
int aioserve_qk_norm_rope_store_fuses(const void* record) {
  return aioserve::call_packed(qk_norm_rope_store_fuses_direct, record);
}
int aioserve_qk_norm_rope_store(const void* record) { return aioserve::call_packed(qk_norm_rope_store_direct, record); }
int aioserve_silu_and_mul(const void* record) { return aioserve::call_packed(silu_and_mul_direct, record); }
int aioserve_row_max_argmax(const void* record) { return aioserve::call_packed(row_max_argmax_direct, record); }

}  // extern "C"
