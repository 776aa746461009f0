// The small ops of a CPU decode step, each fused into one kernel: a small
// model's step is bound by per-op overhead (dispatch, allocation, a pass over
// memory per op), not by arithmetic.
//   rms_norm: RMSNorm, optionally after the residual add (residual updated in
//     place); also serves Qwen3's per-head q/k norm on a [T, H, D] view.
//   rotary_embedding: RoPE ("rotate half") on q and k in place.
//   store_kv: new keys and values into their cache slots, converted to the
//     cache's dtype.
//   silu_and_mul: SwiGLU over a fused [gate | up] projection.
//   row_max_argmax: greedy sampling's max and first argmax of each row in one
//     pass (torch.argmax is slow on CPU, and the max was a second pass).
// Each matches its torch twin's rounding: torch computes a half-precision
// op in float32 and rounds its result to the tensor's dtype, so these round
// after every op the twin does, not only at the end.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "half.h"
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
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

// Calls f with a value of the C++ type of a float32, bfloat16 or float16 dtype.
template <typename F>
void dispatch_float(at::ScalarType type, const char* name, F&& f) {
  switch (type) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, name, ": unsupported dtype ", type);
  }
}

// The rows of a [N, D] or [T, H, D] tensor whose last dim is contiguous:
// row r starts at (r / inner) * outer_stride + (r % inner) * inner_stride.
// So a [T, H, D] view of heads inside a fused q|k|v projection's rows is
// read and written where it lies, without a copy.
struct Rows {
  int64_t count, inner, outer_stride, inner_stride;
  int64_t offset(int64_t r) const { return (r / inner) * outer_stride + (r % inner) * inner_stride; }
};

bool has_rows(const torch::Tensor& t) { return (t.dim() == 2 || t.dim() == 3) && t.stride(-1) == 1; }

Rows rows_of(const torch::Tensor& t) {
  if (t.dim() == 2) return {t.size(0), 1, t.stride(0), 0};
  return {t.size(0) * t.size(1), t.size(1), t.stride(0), t.stride(1)};
}

// ---- rms_norm ----------------------------------------------------------------

// O is the weight * normalized product's type: X when the weight is X, else
// float32 (torch's promotion of a float32 weight with a half-precision x).
template <typename X, typename W, typename O>
void rms_norm_impl(const X* x, Rows xr, X* residual, Rows rr, const W* w, O* out, int64_t dim, float eps) {
  aioserve::parallel_pieces(xr.count, row_grain(dim), [&](int64_t begin, int64_t end) {
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

torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps) {
  const int64_t dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == dim && weight.is_contiguous(), "rms_norm: weight must be [D]");
  const auto out_type = at::promote_types(x.scalar_type(), weight.scalar_type());
  TORCH_CHECK(out_type == x.scalar_type() || out_type == at::kFloat, "rms_norm: weight must have x's dtype or float32");
  auto out = torch::empty(x.sizes(), x.options().dtype(out_type));
  if (!has_rows(x)) x = x.contiguous().view({-1, dim});
  torch::Tensor res;
  if (residual.has_value()) {
    res = *residual;
    TORCH_CHECK(res.scalar_type() == x.scalar_type() && res.numel() == x.numel() && res.size(-1) == dim,
                "rms_norm: residual must match x");
    TORCH_CHECK(res.is_contiguous(), "rms_norm: the residual is updated in place, so it must be contiguous");
    res = res.view({-1, dim});
  }
  dispatch_float(x.scalar_type(), "rms_norm", [&](auto x_tag) {
    using X = decltype(x_tag);
    dispatch_float(weight.scalar_type(), "rms_norm", [&](auto w_tag) {
      using W = decltype(w_tag);
      using O = std::conditional_t<std::is_same_v<X, W>, X, float>;
      X* res_ptr = res.defined() ? res.data_ptr<X>() : nullptr;
      const Rows res_rows = res.defined() ? rows_of(res) : Rows{0, 1, 0, 0};
      rms_norm_impl<X, W, O>(x.data_ptr<X>(), rows_of(x), res_ptr, res_rows, weight.data_ptr<W>(), out.data_ptr<O>(),
                             dim, static_cast<float>(eps));
    });
  });
  return out;
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

template <typename T>
void rotary_impl(const int64_t* positions, T* q, Rows qr, T* k, Rows kr, const float* cos, const float* sin,
                 int64_t tokens, int64_t dim) {
  const int64_t q_heads = qr.inner, k_heads = kr.inner, half = dim / 2;
  aioserve::parallel_pieces(tokens, row_grain((q_heads + k_heads) * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + positions[t] * dim;
      const float* s = sin + positions[t] * dim;
      for (int64_t h = 0; h < q_heads; ++h) rotate_row(q + qr.offset(t * q_heads + h), c, s, half);
      for (int64_t h = 0; h < k_heads; ++h) rotate_row(k + kr.offset(t * k_heads + h), c, s, half);
    }
  });
}

}  // namespace

void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos_cache,
                      torch::Tensor sin_cache) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(-1) == 1 && k.stride(-1) == 1,
              "rotary_embedding: q [T, Hq, D] and k [T, Hk, D] with contiguous rows (rotated in place)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_embedding: q and k must share a dtype");
  const int64_t tokens = q.size(0), dim = q.size(2);
  TORCH_CHECK(k.size(0) == tokens && k.size(2) == dim && dim % 2 == 0, "rotary_embedding: q and k shapes differ");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.numel() == tokens, "rotary_embedding: positions [T] int64");
  TORCH_CHECK(cos_cache.scalar_type() == torch::kFloat32 && sin_cache.scalar_type() == torch::kFloat32 &&
                  cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.size(1) == dim &&
                  sin_cache.sizes() == cos_cache.sizes(),
              "rotary_embedding: cos/sin caches [max_positions, D] float32");
  positions = positions.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t limit = cos_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < limit, "rotary_embedding: position ", pos[t], " outside [0, ", limit, ")");
  dispatch_float(q.scalar_type(), "rotary_embedding", [&](auto tag) {
    using T = decltype(tag);
    rotary_impl<T>(pos, q.data_ptr<T>(), rows_of(q), k.data_ptr<T>(), rows_of(k), cos_cache.data_ptr<float>(),
                   sin_cache.data_ptr<float>(), tokens, dim);
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

void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(), "store_kv: k, v [T, Hk, D]");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.sizes() == value_cache.sizes() &&
                  key_cache.scalar_type() == value_cache.scalar_type() && key_cache.is_contiguous() &&
                  value_cache.is_contiguous(),
              "store_kv: contiguous caches [slots, Hk, D] of one dtype");
  const int64_t tokens = k.size(0), heads = k.size(1), dim = k.size(2), limit = key_cache.size(0);
  TORCH_CHECK(key_cache.size(1) == heads && key_cache.size(2) == dim, "store_kv: k and the cache's rows differ");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.numel() == tokens, "store_kv: slots [T] int64");
  if (k.stride(-1) != 1) k = k.contiguous();
  if (v.stride(-1) != 1) v = v.contiguous();
  slots = slots.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < limit, "store_kv: slot ", slot[t], " outside [0, ", limit, ")");
  dispatch_float(k.scalar_type(), "store_kv", [&](auto s_tag) {
    using S = decltype(s_tag);
    dispatch_float(key_cache.scalar_type(), "store_kv", [&](auto c_tag) {
      using C = decltype(c_tag);
      store_impl<S, C>(k.data_ptr<S>(), rows_of(k), key_cache.data_ptr<C>(), slot, heads, dim);
      store_impl<S, C>(v.data_ptr<S>(), rows_of(v), value_cache.data_ptr<C>(), slot, heads, dim);
    });
  });
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
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float g = to_float(gate[j]);
        // silu rounded to T first, as F.silu(gate) is a T tensor before `* up`.
        dst[j] = from_float<T>(round_to<T>(g / (1.f + exp_approx(-g))) * to_float(up[j]));
      }
    }
  });
}

}  // namespace

torch::Tensor silu_and_mul(torch::Tensor x) {
  const int64_t width = x.size(-1);
  TORCH_CHECK(width % 2 == 0, "silu_and_mul: the last dim must be [gate | up]");
  auto sizes = x.sizes().vec();
  sizes.back() = width / 2;
  auto out = torch::empty(sizes, x.options());
  x = x.contiguous();
  dispatch_float(x.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_impl<T>(x.data_ptr<T>(), out.data_ptr<T>(), x.numel() / std::max<int64_t>(1, width), width / 2);
  });
  return out;
}

namespace {

// ---- row_max_argmax ----------------------------------------------------------

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

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> row_max_argmax(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.size(1) > 0,
              "row_max_argmax: logits [S, V > 0] float32");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  // Fewer rows than threads: split each row into chunks for the others, then
  // merge (a 32k-152k row is worth it; a thread's start costs a few us).
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = rows < threads ? std::clamp<int64_t>(vocab / 8192, 1, threads / std::max<int64_t>(rows, 1)) : 1;
  const int64_t chunk_len = (vocab + chunks - 1) / chunks;
  std::vector<std::pair<float, int64_t>> found(rows * chunks);
  const float* p = logits.data_ptr<float>();
  aioserve::parallel_pieces(rows * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t row = task / chunks, start = (task % chunks) * chunk_len;
      const int64_t len = std::min(chunk_len, vocab - start);
      auto [value, index] = max_argmax(p + row * vocab + start, len);
      found[task] = {value, index + start};
    }
  });
  auto maxes = torch::empty({rows}, logits.options());
  auto argmaxes = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  float* max_out = maxes.data_ptr<float>();
  int64_t* arg_out = argmaxes.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    // Chunks in order, replaced only by a strictly greater one (or a first
    // NaN): the first index on ties, as in one pass.
    auto best = found[row * chunks];
    for (int64_t c = 1; c < chunks && !std::isnan(best.first); ++c) {
      const auto& next = found[row * chunks + c];
      if (std::isnan(next.first) || next.first > best.first) best = next;
    }
    max_out[row] = best.first;
    arg_out[row] = best.second;
  }
  return {maxes, argmaxes};
}

}  // namespace aioserve

void bind_elementwise(pybind11::module_& m) {
  using namespace aioserve;
  m.def("rms_norm", &rms_norm, "RMSNorm of x [..., D] (of x + residual, written to residual, when one is given)",
        pybind11::arg("x"), pybind11::arg("residual"), pybind11::arg("weight"), pybind11::arg("eps"));
  m.def("rotary_embedding", &rotary_embedding, "RoPE (rotate half) on q [T, Hq, D] and k [T, Hk, D] in place",
        pybind11::arg("positions"), pybind11::arg("q"), pybind11::arg("k"), pybind11::arg("cos_cache"),
        pybind11::arg("sin_cache"));
  m.def("store_kv", &store_kv, "k, v [T, Hk, D] into the caches' slots, converted to their dtype", pybind11::arg("k"),
        pybind11::arg("v"), pybind11::arg("key_cache"), pybind11::arg("value_cache"), pybind11::arg("slots"));
  m.def("silu_and_mul", &silu_and_mul, "silu(x[..., :N]) * x[..., N:]", pybind11::arg("x"));
  m.def("row_max_argmax", &row_max_argmax, "(max, first argmax) of each row of float32 logits [S, V]",
        pybind11::arg("logits"));
}
