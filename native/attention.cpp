// paged_decode_attention: one query token per request against its KV pages,
//   read in place (no gather copy), GQA by grouping query heads under their
//   KV head, optional sliding window; the cache may be half precision under
//   a float32 query.

#include "half.h"
#include "kernels.h"
#include "parallel.h"
#include "vec_math.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace aioserve {
namespace {

using aioserve::from_float;
using aioserve::to_float;

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

#if defined(__AVX512F__)
using aioserve::load16;  // float, bf16, fp16 (vec_math.h)
template <typename T>  // float64 caches: never served, but dispatched
inline __m512 load16(const T* p) {
  alignas(64) float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return _mm512_load_ps(f);
}

// Head dims that are whole vectors: two independent sums (one sum's
// dependent adds bounded the loop by the add latency) and the vector
// reduction at the end.
template <typename T>
inline float dot16(const float* __restrict a, const T* __restrict b, int64_t n) {
  __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(a), load16(b)), s1 = _mm512_setzero_ps();
  int64_t i = 16;
  for (; i + 16 < n; i += 32) {
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), s1);
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load16(b + i + 16), s0);
  }
  if (i < n) s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), s1);
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

template <typename T>
inline void axpy16(float w, const T* __restrict x, float* __restrict y, int64_t n) {
  const __m512 wv = _mm512_set1_ps(w);
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, load16(x + i), _mm512_loadu_ps(y + i)));
}
constexpr bool kVector16 = true;
#else
template <typename T>
inline float dot16(const float* a, const T* b, int64_t n) { return dot(a, b, n); }
template <typename T>
inline void axpy16(float w, const T* x, float* y, int64_t n) { axpy(w, x, y, n); }
constexpr bool kVector16 = false;
#endif

// Position `pos`'s row of a paged cache ([slots, Hk, D], kv_stride = Hk x D
// elements a slot): its page from the request's page table, then its slot.
template <typename KV>
inline const KV* cache_row(const KV* cache, const int32_t* pages, int64_t page_size, int64_t kv_stride, int64_t pos) {
  return cache + (static_cast<int64_t>(pages[pos / page_size]) * page_size + pos % page_size) * kv_stride;
}

// Each head's n scores (head-major) -> exp(score - max) in place, with the
// head's max and the sum of its exponentials: a chunk's unnormalized softmax.
inline void softmax_numerators(float* scores, int64_t n, int64_t num_heads, float* maxes, float* sums) {
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * n;
    float top = -std::numeric_limits<float>::infinity(), total = 0.f;
    for (int64_t j = 0; j < n; ++j) top = std::max(top, s[j]);
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
      s[j] = aioserve::exp_approx(s[j] - top);
      total += s[j];
    }
    maxes[h] = top;
    sums[h] = total;
  }
}

constexpr int64_t kMaxHeads = 256;  // query heads a span takes (the largest served model has 128)

// Each query head's KV head as an offset into a cache row, worked out once
// a span (an integer division per head and position took a fifth of the
// bf16 kernel's samples).
inline void kv_offsets(int64_t num_heads, int64_t group, int64_t dim, int64_t (&offsets)[kMaxHeads]) {
  AIOSERVE_CHECK(num_heads <= kMaxHeads, "decode attention: too many query heads");
  for (int64_t h = 0; h < num_heads; ++h) offsets[h] = (h / group) * dim;
}

// The cache's reads are asked for ahead of their use: a page's rows are
// contiguous, but pages lie anywhere, and the hardware prefetchers stop at
// every 4 KiB (a row of Qwen3-0.6B's keys is 2 KiB), so the kernel read
// the KV at ~12 GB/s of this machine's ~27 (2-core Sapphire Rapids VM,
// batch 64 x 512 positions); with the keys 16 positions ahead and each KV
// head's values of the next page, ~15 GB/s (8 ahead measured the same, 2-4
// less; the values alone gained nothing without the keys).
constexpr int64_t kKeysAhead = 16;

inline void prefetch_bytes(const void* data, int64_t bytes) {
  const char* p = static_cast<const char*>(data);
  for (int64_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// One request's positions [begin, end) against all its query heads. Each
// position's keys (then values) for every head are one contiguous row of the
// cache, read once: walking head by head re-read each row's cache lines from
// memory once per head, and a step's KV (not in cache: the weights pass
// through it between layers) came in at a fifth of the memory bandwidth.
// Leaves, per head, the running max, the sum of exp(score - max) and the
// unnormalized sum of weighted values, so that chunks of one sequence can be
// merged. Scores are kept head-major, so that each head's exponentials run
// as one vectorized pass over its positions (std::exp per score, which does
// not vectorize, took about a third of the kernel).
template <typename KV>
void attend_span(const float* q, const KV* kp, const KV* vp, const int32_t* pages, int64_t page_size, int64_t begin,
                 int64_t end, int64_t num_heads, int64_t num_kv_heads, int64_t dim, float* maxes, float* sums,
                 float* acc, std::vector<float>& scores) {
  const int64_t group = num_heads / num_kv_heads, kv_stride = num_kv_heads * dim, n = end - begin;
  const int64_t row_bytes = kv_stride * static_cast<int64_t>(sizeof(KV));
  const bool whole_vectors = kVector16 && dim % 16 == 0;
  int64_t kv_offset[kMaxHeads];
  kv_offsets(num_heads, group, dim, kv_offset);
  scores.resize(n * num_heads);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = begin + j;
    const KV* keys = cache_row(kp, pages, page_size, kv_stride, pos);
    if (j + kKeysAhead < n) prefetch_bytes(cache_row(kp, pages, page_size, kv_stride, pos + kKeysAhead), row_bytes);
    if (whole_vectors) {
      for (int64_t h = 0; h < num_heads; ++h) scores[h * n + j] = dot16(q + h * dim, keys + kv_offset[h], dim);
    } else {
      for (int64_t h = 0; h < num_heads; ++h) scores[h * n + j] = dot(q + h * dim, keys + kv_offset[h], dim);
    }
  }
  softmax_numerators(scores.data(), n, num_heads, maxes, sums);
  std::fill(acc, acc + num_heads * dim, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pos = begin + j;
    const KV* values = cache_row(vp, pages, page_size, kv_stride, pos);
    if (j + kKeysAhead < n) prefetch_bytes(cache_row(vp, pages, page_size, kv_stride, pos + kKeysAhead), row_bytes);
    if (whole_vectors) {
      for (int64_t h = 0; h < num_heads; ++h) axpy16(scores[h * n + j], values + kv_offset[h], acc + h * dim, dim);
    } else {
      for (int64_t h = 0; h < num_heads; ++h) axpy(scores[h * n + j], values + kv_offset[h], acc + h * dim, dim);
    }
  }
}

#if defined(__AVX512BF16__)
// Lane i of the result: the sum of v[i]'s 16 lanes, for 16 vectors at once
// (a fixed tree: 45 instructions where 16 horizontal sums took ~150, and
// lane i's sum does not depend on the other vectors).
inline __m512 sum_lanes16(const __m512 (&v)[16]) {
  __m512 pairs[8];
  for (int i = 0; i < 8; ++i)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  __m512 quads[4];  // a 128-bit block of quads[j]: v[4j..4j+3]'s sums over that block
  for (int j = 0; j < 4; ++j) {
    const __m512d a = _mm512_castps_pd(pairs[2 * j]), b = _mm512_castps_pd(pairs[2 * j + 1]);
    quads[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  constexpr int kEven = _MM_SHUFFLE(2, 0, 2, 0), kOdd = _MM_SHUFFLE(3, 1, 3, 1);
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], kEven),
                                  _mm512_shuffle_f32x4(quads[0], quads[1], kOdd));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], kEven),
                                  _mm512_shuffle_f32x4(quads[2], quads[3], kOdd));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, kEven), _mm512_shuffle_f32x4(u0, u1, kOdd));
}

// bf16 q against a bf16 cache, head dims a multiple of 32 (Chunks = dim / 16
// float vectors): the measured hot path of half-precision decode (Qwen3-0.6B
// on a 2-core Sapphire Rapids: the generic span above read the KV of a
// batch-64 step at ~10 GB/s, 72% of the step once the matmuls ran on AMX).
// A step's KV is read once and the kernel is cut to few instructions a byte,
// so that the core keeps more of the (page-scattered) reads in flight:
// * Scores: each key row dotted with 16 query heads in bf16 pairs
//   (vdpbf16ps: exact products, float32 sums), the 16 sums reduced together
//   (sum_lanes16) and kept position-major, 16 heads a vector, so that the
//   softmax runs across heads in the vector lanes.
// * Values: the probabilities rounded to bf16 (as a GPU's flash attention
//   rounds P before its PV product) and multiplied two positions at a time
//   by the pair dot: two value rows interleaved (each 128-bit block's
//   halves), 32 products an instruction where the float32 form widened every
//   value and took 16. The interleave leaves each head's sums in a fixed
//   order of dims, put back once at the end of the span. Per page, each KV
//   head's accumulators stay in registers.
template <int Chunks>
void attend_span_bf16(const BFloat16* q, float scale, const BFloat16* kp, const BFloat16* vp, const int32_t* pages,
                      int64_t page_size, int64_t begin, int64_t end, int64_t num_heads, int64_t num_kv_heads,
                      float* maxes, float* sums, float* acc, std::vector<float>& scores) {
  constexpr int64_t dim = Chunks * 16;
  constexpr int kPairVectors = Chunks / 2;  // 32 bf16 each
  constexpr int kHeadsAtOnce = Chunks >= 16 ? 1 : 16 / Chunks;  // accumulators kept in 16 registers
  const int64_t group = num_heads / num_kv_heads, kv_stride = num_kv_heads * dim, n = end - begin;
  const int64_t head_bytes = dim * static_cast<int64_t>(sizeof(BFloat16)), row_bytes = num_kv_heads * head_bytes;
  const int64_t lanes = (num_heads + 15) / 16 * 16;  // a position's scores, heads padded to whole vectors
  // scores: n x lanes float32 sums, then (from `probs` on) n x lanes bf16 probabilities
  scores.resize(n * lanes + (n * lanes + 1) / 2);
  float* score = scores.data();
  BFloat16* probs = reinterpret_cast<BFloat16*>(scores.data() + n * lanes);
  const __m512 scale_v = _mm512_set1_ps(scale);
  int64_t key_offset[kMaxHeads];
  kv_offsets(num_heads, group, dim, key_offset);
  for (int64_t j = 0; j < n; ++j) {
    const BFloat16* keys = cache_row(kp, pages, page_size, kv_stride, begin + j);
    if (j + kKeysAhead < n)
      prefetch_bytes(cache_row(kp, pages, page_size, kv_stride, begin + j + kKeysAhead), row_bytes);
    for (int64_t h0 = 0; h0 < num_heads; h0 += 16) {
      const int heads = static_cast<int>(std::min<int64_t>(16, num_heads - h0));
      __m512 sum[16];
      for (int i = 0; i < 16; ++i) sum[i] = _mm512_setzero_ps();
      for (int i = 0; i < heads; ++i) {
        const BFloat16 *k = keys + key_offset[h0 + i], *qh = q + (h0 + i) * dim;
        for (int c = 0; c < kPairVectors; ++c)
          sum[i] = _mm512_dpbf16_ps(sum[i], (__m512bh)_mm512_loadu_si512(qh + 32 * c),
                                    (__m512bh)_mm512_loadu_si512(k + 32 * c));
      }
      _mm512_storeu_ps(score + j * lanes + h0, _mm512_mul_ps(sum_lanes16(sum), scale_v));
    }
  }
  // Softmax numerators, 16 heads in the lanes: exp(score - the head's max).
  for (int64_t h0 = 0; h0 < lanes; h0 += 16) {
    alignas(64) float top[16], total[16] = {};
    __m512 top_v = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; ++j) top_v = _mm512_max_ps(top_v, _mm512_loadu_ps(score + j * lanes + h0));
    _mm512_store_ps(top, top_v);
    for (int64_t j = 0; j < n; ++j) {
      float* s = score + j * lanes + h0;
#pragma omp simd
      for (int l = 0; l < 16; ++l) {
        s[l] = aioserve::exp_approx(s[l] - top[l]);
        total[l] += s[l];
        probs[j * lanes + h0 + l] = from_float<BFloat16>(s[l]);
      }
    }
    for (int l = 0; l < 16 && h0 + l < num_heads; ++l) {
      maxes[h0 + l] = top[l];
      sums[h0 + l] = total[l];
    }
  }
  std::fill(acc, acc + num_heads * dim, 0.f);
  // The two probabilities of positions j and j + 1 (0 past the span) for head h, as one bf16 pair.
  auto prob_pair = [&](int64_t j, int64_t h, bool second) {
    const uint32_t low = probs[j * lanes + h].x, high = second ? probs[(j + 1) * lanes + h].x : 0;
    return (__m512bh)_mm512_set1_epi32(static_cast<int>(low | high << 16));
  };
  for (int64_t j0 = 0; j0 < n; ) {
    const int64_t j1 = std::min(n, j0 + page_size - (begin + j0) % page_size);  // the rest of this page
    const int64_t j2 = std::min(n, j1 + page_size);
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      for (int64_t j = j1; j < j2; ++j)  // this KV head's values of the next page
        prefetch_bytes(cache_row(vp, pages, page_size, kv_stride, begin + j) + g * dim, head_bytes);
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += kHeadsAtOnce) {
        const int heads = static_cast<int>(std::min<int64_t>(kHeadsAtOnce, (g + 1) * group - h0));
        __m512 a[kHeadsAtOnce][Chunks];  // [i][2c]: a pair vector's low halves, [i][2c + 1]: its high halves
        for (int i = 0; i < kHeadsAtOnce; ++i)
          if (i < heads)
            for (int c = 0; c < Chunks; ++c) a[i][c] = _mm512_loadu_ps(acc + (h0 + i) * dim + 16 * c);
        for (int64_t j = j0; j < j1; j += 2) {
          const bool second = j + 1 < j1;
          const BFloat16* first_row = cache_row(vp, pages, page_size, kv_stride, begin + j) + g * dim;
          const BFloat16* second_row = second ? cache_row(vp, pages, page_size, kv_stride, begin + j + 1) + g * dim
                                              : nullptr;
          __m512bh w[kHeadsAtOnce];
          for (int i = 0; i < kHeadsAtOnce; ++i)
            w[i] = i < heads ? prob_pair(j, h0 + i, second) : (__m512bh)_mm512_setzero_si512();
          for (int c = 0; c < kPairVectors; ++c) {
            const __m512i x0 = _mm512_loadu_si512(first_row + 32 * c);
            const __m512i x1 = second ? _mm512_loadu_si512(second_row + 32 * c) : _mm512_setzero_si512();
            const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(x0, x1);
            const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(x0, x1);
            for (int i = 0; i < kHeadsAtOnce; ++i) {
              if (i >= heads) break;
              a[i][2 * c] = _mm512_dpbf16_ps(a[i][2 * c], low, w[i]);
              a[i][2 * c + 1] = _mm512_dpbf16_ps(a[i][2 * c + 1], high, w[i]);
            }
          }
        }
        for (int i = 0; i < kHeadsAtOnce; ++i)
          if (i < heads)
            for (int c = 0; c < Chunks; ++c) _mm512_storeu_ps(acc + (h0 + i) * dim + 16 * c, a[i][c]);
      }
    }
    j0 = j1;
  }
  // Dims back in order: of a pair vector's 32 dims, the low halves hold
  // each 128-bit block's first 4 (8b + 0..3, b = 0..3), the high its last 4.
  const __m512i first16 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i last16 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int64_t h = 0; h < num_heads; ++h) {
    for (int c = 0; c < kPairVectors; ++c) {
      float* pair = acc + h * dim + 32 * c;
      const __m512 low = _mm512_loadu_ps(pair), high = _mm512_loadu_ps(pair + 16);
      _mm512_storeu_ps(pair, _mm512_permutex2var_ps(low, first16, high));
      _mm512_storeu_ps(pair + 16, _mm512_permutex2var_ps(low, last16, high));
    }
  }
}

// Whether (q, cache) may take attend_span_bf16.
template <typename T, typename KV>
constexpr bool kBf16Span = std::is_same_v<T, BFloat16> && std::is_same_v<KV, BFloat16>;

// attend_span_bf16 for this head dim, if it has an instance (64, 128, 256); false if not.
inline bool attend_span_bf16_dim(int64_t dim, const BFloat16* q, float scale, const BFloat16* kp, const BFloat16* vp,
                                 const int32_t* pages, int64_t page_size, int64_t begin, int64_t end, int64_t num_heads,
                                 int64_t num_kv_heads, float* maxes, float* sums, float* acc,
                                 std::vector<float>& scores) {
  switch (dim) {
    case 64: attend_span_bf16<4>(q, scale, kp, vp, pages, page_size, begin, end, num_heads, num_kv_heads, maxes, sums,
                                 acc, scores);
      return true;
    case 128: attend_span_bf16<8>(q, scale, kp, vp, pages, page_size, begin, end, num_heads, num_kv_heads, maxes, sums,
                                  acc, scores);
      return true;
    case 256: attend_span_bf16<16>(q, scale, kp, vp, pages, page_size, begin, end, num_heads, num_kv_heads, maxes,
                                   sums, acc, scores);
      return true;
    default: return false;
  }
}
#endif

template <typename T, typename KV>
void decode_attention_impl(const T* qp, const KV* kp, const KV* vp, const int32_t* pt, int64_t pages_per_row,
                           const int64_t* lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                           int64_t page_size, double scale, int64_t window, T* op) {

  // Few requests would leave threads idle: split each sequence into chunks
  // (at least kMinChunk positions each) and merge their partial softmaxes.
  constexpr int64_t kMinChunk = 64;
  const int64_t threads = num_threads();
  int64_t longest = 0;
  for (int64_t b = 0; b < batch; ++b) longest = std::max(longest, lens[b]);
  const int64_t wanted = batch >= 2 * threads ? 1 : (2 * threads + batch - 1) / batch;
  const int64_t splits = std::max<int64_t>(1, std::min(wanted, longest / kMinChunk));
  const int64_t row = num_heads * (dim + 2);  // one chunk's partial result: acc, max, sum per head
  std::vector<float> partials(batch * splits * row);

  aioserve::parallel_pieces(batch * splits, 1, [&](int64_t first_task, int64_t last_task) {
    std::vector<float> qf(num_heads * dim), scores;
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t b = task / splits, split = task % splits;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t per = (len - first + splits - 1) / splits;
      const int64_t begin = std::min(len, first + split * per), end = std::min(len, begin + per);
      float* part = partials.data() + task * row;
      float *acc = part, *maxes = part + num_heads * dim, *sums = maxes + num_heads;
      if (begin >= end) {  // an empty chunk: contributes nothing to the merge
        std::fill(maxes, maxes + num_heads, -std::numeric_limits<float>::infinity());
        std::fill(sums, sums + num_heads, 0.f);
        std::fill(acc, acc + num_heads * dim, 0.f);
        continue;
      }
#if defined(__AVX512BF16__)
      if constexpr (kBf16Span<T, KV>) {
        if (attend_span_bf16_dim(dim, qp + b * num_heads * dim, static_cast<float>(scale), kp, vp,
                                 pt + b * pages_per_row, page_size, begin, end, num_heads, num_kv_heads, maxes, sums,
                                 acc, scores)) {
          continue;
        }
      }
#endif
      for (int64_t i = 0; i < num_heads * dim; ++i) qf[i] = to_float(qp[b * num_heads * dim + i]) * static_cast<float>(scale);
      attend_span(qf.data(), kp, vp, pt + b * pages_per_row, page_size, begin, end, num_heads, num_kv_heads, dim, maxes,
                  sums, acc, scores);
    }
  });
  // Merge each request's chunks: rescale every chunk to the overall max.
  aioserve::parallel_pieces(batch * num_heads, 16, [&](int64_t first, int64_t last) {
    std::vector<float> merged(dim);
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / num_heads, h = task % num_heads;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = 0; s < splits; ++s) top = std::max(top, partials[(b * splits + s) * row + num_heads * dim + h]);
      float total = 0.f;
      std::fill(merged.begin(), merged.end(), 0.f);
      for (int64_t s = 0; s < splits; ++s) {
        const float* part = partials.data() + (b * splits + s) * row;
        const float chunk_max = part[num_heads * dim + h];
        if (chunk_max == -std::numeric_limits<float>::infinity()) continue;
        const float factor = splits == 1 ? 1.f : std::exp(chunk_max - top);
        total += part[num_heads * dim + num_heads + h] * factor;
        axpy(factor, part + h * dim, merged.data(), dim);
      }
      T* dst = op + (b * num_heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<T>(merged[d] / total);
    }
  });
}

}  // namespace

// The cache may be narrower than q (half-precision KV under float32 math).
template <typename KV>
void attention_for(const void* q, int q_type, const void* k_cache, const void* v_cache, const int32_t* page_table,
                   int64_t pages_per_row, const int64_t* seq_lens, int64_t batch, int64_t num_heads,
                   int64_t num_kv_heads, int64_t dim, int64_t page_size, double scale, int64_t window, void* out) {
  const KV* kp = static_cast<const KV*>(k_cache);
  const KV* vp = static_cast<const KV*>(v_cache);
  if (q_type == kFloat32) {
    decode_attention_impl<float, KV>(static_cast<const float*>(q), kp, vp, page_table, pages_per_row, seq_lens, batch,
                                     num_heads, num_kv_heads, dim, page_size, scale, window, static_cast<float*>(out));
  } else {
    decode_attention_impl<KV, KV>(static_cast<const KV*>(q), kp, vp, page_table, pages_per_row, seq_lens, batch,
                                  num_heads, num_kv_heads, dim, page_size, scale, window, static_cast<KV*>(out));
  }
}

void paged_decode_attention(const void* q, int q_type, const void* k_cache, const void* v_cache, int kv_type,
                            const int32_t* page_table, int64_t pages_per_row, const int64_t* seq_lens, int64_t batch,
                            int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t page_size, double scale,
                            int64_t window, void* out) {
  AIOSERVE_CHECK(q_type == kv_type || q_type == kFloat32, "q must have the caches' dtype, or be float32");
  switch (kv_type) {
    case kFloat32: return attention_for<float>(q, q_type, k_cache, v_cache, page_table, pages_per_row, seq_lens, batch,
                                               num_heads, num_kv_heads, dim, page_size, scale, window, out);
    case kBFloat16: return attention_for<BFloat16>(q, q_type, k_cache, v_cache, page_table, pages_per_row, seq_lens,
                                                   batch, num_heads, num_kv_heads, dim, page_size, scale, window, out);
    case kFloat16: return attention_for<Half>(q, q_type, k_cache, v_cache, page_table, pages_per_row, seq_lens, batch,
                                              num_heads, num_kv_heads, dim, page_size, scale, window, out);
    case kFloat64: return attention_for<double>(q, q_type, k_cache, v_cache, page_table, pages_per_row, seq_lens,
                                                batch, num_heads, num_kv_heads, dim, page_size, scale, window, out);
    default: fail("paged_decode_attention: unsupported dtype");
  }
}

}  // namespace aioserve

static int paged_decode_attention_direct(const void* q, int q_type, const void* k_cache, const void* v_cache,
                                               int kv_type, const int32_t* page_table, int64_t pages_per_row,
                                               const int64_t* seq_lens, int64_t batch, int64_t num_heads,
                                               int64_t num_kv_heads, int64_t dim, int64_t page_size, double scale,
                                               int64_t window, void* out) {
  return aioserve::guarded([&] {
    aioserve::paged_decode_attention(q, q_type, k_cache, v_cache, kv_type, page_table, pages_per_row, seq_lens, batch,
                                     num_heads, num_kv_heads, dim, page_size, scale, window, out);
  });
}

extern "C" {

int aioserve_paged_decode_attention(const void* record) { return aioserve::call_packed(paged_decode_attention_direct, record); }

}  // extern "C"
