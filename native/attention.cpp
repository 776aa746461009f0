// paged_decode_attention: one query token per request against its KV pages,
//   read in place (no gather copy), GQA by grouping query heads under their
//   KV head, optional sliding window; the cache may be half precision under
//   a float32 query.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }

template <typename T>
inline float dot(const float* __restrict a, const T* __restrict b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * to_float(b[i]);
  return sum;
}

template <typename T>
inline void axpy(float w, const T* __restrict x, float* __restrict y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * to_float(x[i]);
}

template <typename T, typename KV>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& page_table, const torch::Tensor& seq_lens, int64_t page_size,
                           double scale, int64_t window, torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t pages_per_row = page_table.size(1);
  const T* qp = q.data_ptr<T>();
  const KV* kp = k_cache.data_ptr<KV>();
  const KV* vp = v_cache.data_ptr<KV>();
  const int32_t* pt = page_table.data_ptr<int32_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const int64_t kv_stride = num_kv_heads * dim;  // between consecutive slots

  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * dim), acc(group * dim), scores, maxes(group), sums(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / num_kv_heads, h = task % num_kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim; ++d)
          qf[g * dim + d] = to_float(qp[(b * num_heads + h * group + g) * dim + d]) * static_cast<float>(scale);
      scores.assign(n * group, 0.f);
      std::fill(maxes.begin(), maxes.end(), -std::numeric_limits<float>::infinity());
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = first + j;
        const int64_t slot = static_cast<int64_t>(pt[b * pages_per_row + pos / page_size]) * page_size + pos % page_size;
        const KV* key = kp + slot * kv_stride + h * dim;
        for (int64_t g = 0; g < group; ++g) {
          const float s = dot(&qf[g * dim], key, dim);
          scores[j * group + g] = s;
          maxes[g] = std::max(maxes[g], s);
        }
      }
      std::fill(sums.begin(), sums.end(), 0.f);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t g = 0; g < group; ++g) {
          const float w = std::exp(scores[j * group + g] - maxes[g]);
          scores[j * group + g] = w;
          sums[g] += w;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = first + j;
        const int64_t slot = static_cast<int64_t>(pt[b * pages_per_row + pos / page_size]) * page_size + pos % page_size;
        const KV* value = vp + slot * kv_stride + h * dim;
        for (int64_t g = 0; g < group; ++g) axpy(scores[j * group + g], value, &acc[g * dim], dim);
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.f / sums[g];
        T* dst = op + (b * num_heads + h * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor page_table, torch::Tensor seq_lens, int64_t page_size,
                                     double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q [B,H,D], caches [slots,Hk,D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "the K and V caches must share a dtype");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() || q.scalar_type() == torch::kFloat32,
              "q must have the caches' dtype, or be float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(page_table.scalar_type() == torch::kInt32 && seq_lens.scalar_type() == torch::kInt64,
              "page_table int32, seq_lens int64");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0, "query heads must be a multiple of KV heads");
  q = q.contiguous();
  page_table = page_table.contiguous();
  seq_lens = seq_lens.contiguous();
  auto out = torch::empty_like(q);
  // The cache may be narrower than q (half-precision KV under float32 math).
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_attention", [&] {
    using KV = scalar_t;
    if (q.scalar_type() == torch::kFloat32) {
      decode_attention_impl<float, KV>(q, k_cache, v_cache, page_table, seq_lens, page_size, scale, window, out);
    } else {
      decode_attention_impl<KV, KV>(q, k_cache, v_cache, page_table, seq_lens, page_size, scale, window, out);
    }
  });
  return out;
}

void bind_attention(pybind11::module_& m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged KV (CPU)");
}
