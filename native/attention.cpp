// paged_decode_attention: one query token per request against its KV pages,
//   read in place (no gather copy), GQA by grouping query heads under their
//   KV head, optional sliding window; the cache may be half precision under
//   a float32 query, or FP8 (e4m3) under any query.

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

// 16 e4m3 values widened through fp16 bits, each 2^-8 times its value: the
// byte shifted up by 8 puts the sign in place and, shifted up by 7, the
// exponent and mantissa (e4m3's bias is 8 below fp16's; subnormals
// included, as vcvtph2ps widens them exactly). load16 scales by 2^8; the
// vector span folds it into q and its sums instead (RowVectors::kUnit).
// S.1111.111 (e4m3's NaN) would read as +-480: the KV store never writes it
// for a finite value (it saturates at +-448), and a NaN key or value has
// already made the step's activations NaN.
inline __m512 widen_fp8_e4m3_x16(const Float8E4M3* p) {
  const __m256i bytes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half_bits = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(bytes, 8), _mm256_set1_epi16(-0x8000)),
                                            _mm256_and_si256(_mm256_slli_epi16(bytes, 7), _mm256_set1_epi16(0x3F80)));
  return _mm512_cvtph_ps(half_bits);
}

inline __m512 load16(const Float8E4M3* p) { return _mm512_mul_ps(widen_fp8_e4m3_x16(p), _mm512_set1_ps(256.f)); }

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

// The cache slots of positions [begin, begin + n), a page at a time: the
// vector span reads each position's row once per KV head, and cache_row's
// division by the page size at each read (two a position and KV head, with
// the prefetches') cost as much as the products (Qwen3-0.6B's heads, one
// thread, the cache in L2: ~110 cycles a position and KV head).
inline void span_slots(const int32_t* pages, int64_t page_size, int64_t begin, int64_t n, std::vector<int64_t>& slots) {
  slots.resize(n);
  for (int64_t j = 0, pos = begin; j < n;) {
    const int64_t page = pos / page_size, offset = pos % page_size;
    const int64_t run = std::min(n - j, page_size - offset);
    const int64_t first = static_cast<int64_t>(pages[page]) * page_size + offset;
    for (int64_t i = 0; i < run; ++i) slots[j + i] = first + i;
    j += run;
    pos += run;
  }
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
// every 4 KiB (a row of Qwen3-0.6B's keys is 2 KiB): the keys 16 positions
// ahead, each KV head's values of the next page. Measured with and without
// in one process (2026-11-28, a 2-core Emerald Rapids VM), they gain 1-2%
// at most (batch 64 x 512 positions, bf16: 8.80 against 8.92 ms): the
// kernel is bound by its instructions here (see attend_span_vec), and the
// ~12 -> ~15 GB/s once credited to them was the box's drift between runs.
// Kept: cheap, and a CPU with weaker prefetchers may need them.
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

#if defined(__AVX512F__)
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

using aioserve::split_pairs;  // bf16 pairs as even and odd float32 vectors (vec_math.h)

// A cache row's elements as float32 vectors in the kernel's dim order, one
// load at a time: bf16 rows a 64-byte load of 32 dims split into its pairs'
// even and odd dims (split_pairs), two vectors; FP8 rows 16 dims a load, in
// order. The query is laid out the same way once a span (query_vectors), so
// dim d of q always meets dim d of k.
template <typename KV>
struct RowVectors;

template <>
struct RowVectors<BFloat16> {
  static constexpr int kPerLoad = 2, kElems = 32;  // vectors a load, elements a load
  static constexpr float kUnit = 1.f;              // a loaded value is the cached one / kUnit
  static void load(const BFloat16* p, __m512 (&out)[kPerLoad]) {
    const SplitPairs x = split_pairs(p);
    out[0] = x.even;
    out[1] = x.odd;
  }
};

template <>
struct RowVectors<Float8E4M3> {
  static constexpr int kPerLoad = 1, kElems = 16;
  static constexpr float kUnit = 256.f;  // q is scaled up by as much and the sums at the end: both exact
  static void load(const Float8E4M3* p, __m512 (&out)[kPerLoad]) { out[0] = widen_fp8_e4m3_x16(p); }
};

// One load's worth of q (T) as RowVectors<KV> orders a cache row's dims.
template <typename T, typename KV>
inline void query_vectors(const T* p, __m512 (&out)[RowVectors<KV>::kPerLoad]) {
  if constexpr (std::is_same_v<KV, BFloat16>) {
    RowVectors<BFloat16>::load(p, out);  // T is bf16 here (kVecSpan)
  } else {
    out[0] = load16(p);  // in order
  }
}

// The scores of KV head g's Group query heads against the keys of 16 / Group
// positions from j (past the span's end: its last position again, the
// results unused): lane p * Group + i is position j + p's score for query
// head g * Group + i. Each key vector is loaded (and widened) once for the
// group and each query vector once for the positions, and the 16 sums stay
// in registers (indexed by constants: a sum picked by a loop bound known
// only at run time went through the stack at every multiply-add).
// q_split: the query heads laid out as RowVectors<KV> reads a row, scaled.
template <typename KV, int Chunks, int Group>
inline __m512 scores_of_group(const float* q_split, const KV* kp, const int64_t* slots, int64_t kv_stride, int64_t j,
                              int64_t n, int64_t g) {
  using Row = RowVectors<KV>;
  constexpr int kPositions = 16 / Group, kLoads = Chunks / Row::kPerLoad, dim = Chunks * 16;
  const KV* keys[kPositions];
  for (int p = 0; p < kPositions; ++p)
    keys[p] = kp + slots[std::min<int64_t>(j + p, n - 1)] * kv_stride + g * dim;
  __m512 sum[16];
  for (int i = 0; i < 16; ++i) sum[i] = _mm512_setzero_ps();
  for (int c = 0; c < kLoads; ++c) {
    for (int p = 0; p < kPositions; ++p) {
      __m512 k[Row::kPerLoad];
      Row::load(keys[p] + Row::kElems * c, k);
      for (int i = 0; i < Group; ++i) {
        const float* qh = q_split + (g * Group + i) * dim + Row::kElems * c;
        for (int u = 0; u < Row::kPerLoad; ++u)
          sum[p * Group + i] = _mm512_fmadd_ps(k[u], _mm512_loadu_ps(qh + 16 * u), sum[p * Group + i]);
      }
    }
  }
  return sum_lanes16(sum);
}

// The scores of positions [0, n) for every query head, position-major
// (score[j * lanes + h]); lanes past num_heads are zero.
template <typename KV, int Chunks, int Group>
void span_scores(const float* q_split, const KV* kp, const int64_t* slots, int64_t n, int64_t num_heads,
                 int64_t num_kv_heads, int64_t lanes, float* score) {
  constexpr int kPositions = 16 / Group;
  const int64_t kv_stride = num_kv_heads * Chunks * 16;
  const int64_t row_bytes = kv_stride * static_cast<int64_t>(sizeof(KV));
  for (int64_t j = 0; j < n; j += kPositions) {
    for (int64_t ahead = j + kKeysAhead; ahead < std::min(n, j + kKeysAhead + kPositions); ++ahead)
      prefetch_bytes(kp + slots[ahead] * kv_stride, row_bytes);
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      alignas(64) float block[16];
      _mm512_store_ps(block, scores_of_group<KV, Chunks, Group>(q_split, kp, slots, kv_stride, j, n, g));
      for (int p = 0; p < kPositions; ++p)
        for (int i = 0; i < Group; ++i) score[(j + p) * lanes + g * Group + i] = block[p * Group + i];
    }
    if (num_heads < lanes)
      for (int p = 0; p < kPositions; ++p)
        std::fill(score + (j + p) * lanes + num_heads, score + (j + p + 1) * lanes, 0.f);
  }
}

template <typename KV>
using SpanScores = void (*)(const float*, const KV*, const int64_t*, int64_t, int64_t, int64_t, int64_t, float*);

// span_scores for this GQA group (query heads per KV head), if it has an
// instance (1-8); nullptr if not: asked before a span does any work.
template <typename KV, int Chunks>
SpanScores<KV> span_scores_for(int64_t group) {
  switch (group) {
    case 1: return span_scores<KV, Chunks, 1>;
    case 2: return span_scores<KV, Chunks, 2>;
    case 3: return span_scores<KV, Chunks, 3>;
    case 4: return span_scores<KV, Chunks, 4>;
    case 5: return span_scores<KV, Chunks, 5>;
    case 6: return span_scores<KV, Chunks, 6>;
    case 7: return span_scores<KV, Chunks, 7>;
    case 8: return span_scores<KV, Chunks, 8>;
    default: return nullptr;
  }
}

// q against a bf16 cache (q bf16) or an FP8 one (q of any float type), head
// dims 64, 128 or 256 (Chunks = dim / 16 float vectors), up to 8 query
// heads a KV head: the measured hot path of
// half-precision decode (Qwen3-0.6B on a 2-core Sapphire Rapids: the
// generic span above read the KV of a batch-64 step at ~10 GB/s, 72% of the
// step once the matmuls ran on AMX). Returns false where it has no instance.
// * Widening, not vdpbf16ps: each 64-byte load of a bf16 cache is split into
//   two float32 vectors (RowVectors) and multiplied by FMAs, against q
//   split the same way once a span; the dims' order is put back at the end.
//   The pair dot does 32 products at half an FMA's rate; this form ran a
//   span at the same speed with the keys' old loop, and its probabilities
//   stay float32 (no bf16 rounding of P). An FP8 cache's 16 bytes widen to
//   one vector in order.
// * Scores by KV head over blocks of positions (scores_of_group), reduced 16
//   at a time (sum_lanes16) and kept position-major, so that the softmax
//   runs across heads in the vector lanes. Dotting each key row with all 16
//   heads re-loaded every query vector at every position and kept its sums
//   on the stack: the keys' pass now takes ~60 of a span's ~110 ns a
//   position where it took ~100 (one thread, cache in L2).
// * Values a page at a time, each KV head's group of heads with its
//   accumulators in registers.
// Measured on a 2-core Emerald Rapids VM, Qwen3-0.6B's heads (16 q, 8 KV,
// 128 dims), against the pair-dot kernel, interleaved: batch 64 x 512
// positions 9.66 -> 8.48 ms (min; medians 10.10 -> 9.43), x 128 positions
// 2.13 -> 2.01 ms, one request of 256 positions on one thread 66 -> 52 us.
template <typename T, typename KV, int Chunks>
bool attend_span_vec(const T* q, float scale, const KV* kp, const KV* vp, const int32_t* pages, int64_t page_size,
                     int64_t begin, int64_t end, int64_t num_heads, int64_t num_kv_heads, float* maxes, float* sums,
                     float* acc, std::vector<float>& scores, std::vector<int64_t>& slots) {
  using Row = RowVectors<KV>;
  constexpr int64_t dim = Chunks * 16;
  constexpr int kLoads = Chunks / Row::kPerLoad;  // a head's loads: 32 bf16 (16 even dims, 16 odd), or 16 FP8
  static_assert(kLoads * Row::kPerLoad == Chunks, "a head's dims are whole loads");
  constexpr int kHeadsAtOnce = Chunks >= 16 ? 1 : 16 / Chunks;  // accumulators kept in 16 registers
  const int64_t group = num_heads / num_kv_heads, kv_stride = num_kv_heads * dim, n = end - begin;
  const SpanScores<KV> span_scores_of_group = span_scores_for<KV, Chunks>(group);
  if (span_scores_of_group == nullptr) return false;
  const int64_t head_bytes = dim * static_cast<int64_t>(sizeof(KV));
  const int64_t lanes = (num_heads + 15) / 16 * 16;  // a position's scores, heads padded to whole vectors
  // scores: q split and scaled [num_heads x dim], then n (+ a block) x lanes scores.
  scores.resize(num_heads * dim + (n + 16) * lanes);
  float* q_split = scores.data();
  float* score = q_split + num_heads * dim;
  const __m512 scale_v = _mm512_set1_ps(scale * Row::kUnit);
  for (int64_t h = 0; h < num_heads; ++h)
    for (int c = 0; c < kLoads; ++c) {
      __m512 x[Row::kPerLoad];
      query_vectors<T, KV>(q + h * dim + Row::kElems * c, x);
      for (int u = 0; u < Row::kPerLoad; ++u)
        _mm512_storeu_ps(q_split + h * dim + Row::kElems * c + 16 * u, _mm512_mul_ps(x[u], scale_v));
    }
  span_slots(pages, page_size, begin, n, slots);
  span_scores_of_group(q_split, kp, slots.data(), n, num_heads, num_kv_heads, lanes, score);
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
      }
    }
    for (int l = 0; l < 16 && h0 + l < num_heads; ++l) {
      maxes[h0 + l] = top[l];
      sums[h0 + l] = total[l];
    }
  }
  std::fill(acc, acc + num_heads * dim, 0.f);
  for (int64_t j0 = 0; j0 < n; ) {
    const int64_t j1 = std::min(n, j0 + page_size - (begin + j0) % page_size);  // the rest of this page
    const int64_t j2 = std::min(n, j1 + page_size);
    for (int64_t g = 0; g < num_kv_heads; ++g) {
      for (int64_t j = j1; j < j2; ++j)  // this KV head's values of the next page
        prefetch_bytes(vp + slots[j] * kv_stride + g * dim, head_bytes);
      for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += kHeadsAtOnce) {
        const int heads = static_cast<int>(std::min<int64_t>(kHeadsAtOnce, (g + 1) * group - h0));
        __m512 a[kHeadsAtOnce][Chunks];  // [i][2c]: pair vector c's even dims, [i][2c + 1]: its odd dims
        for (int i = 0; i < kHeadsAtOnce; ++i)
          if (i < heads)
            for (int c = 0; c < Chunks; ++c) a[i][c] = _mm512_loadu_ps(acc + (h0 + i) * dim + 16 * c);
        for (int64_t j = j0; j < j1; ++j) {
          const KV* row = vp + slots[j] * kv_stride + g * dim;
          __m512 p[kHeadsAtOnce];
          for (int i = 0; i < kHeadsAtOnce; ++i) p[i] = _mm512_set1_ps(i < heads ? score[j * lanes + h0 + i] : 0.f);
          for (int c = 0; c < kLoads; ++c) {
            __m512 v[Row::kPerLoad];
            Row::load(row + Row::kElems * c, v);
            for (int i = 0; i < kHeadsAtOnce; ++i) {
              if (i >= heads) break;
              for (int u = 0; u < Row::kPerLoad; ++u)
                a[i][Row::kPerLoad * c + u] = _mm512_fmadd_ps(p[i], v[u], a[i][Row::kPerLoad * c + u]);
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
  if constexpr (Row::kUnit != 1.f) {
    const __m512 unit = _mm512_set1_ps(Row::kUnit);
    for (int64_t i = 0; i < num_heads * dim; i += 16) _mm512_storeu_ps(acc + i, _mm512_mul_ps(unit, _mm512_loadu_ps(acc + i)));
  }
  if constexpr (Row::kPerLoad == 2) {
    // Dims back in order: each pair vector's even dims, then its odd ones, interleaved.
    const __m512i first16 = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i last16 = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int64_t h = 0; h < num_heads; ++h) {
      for (int c = 0; c < kLoads; ++c) {
        float* pair = acc + h * dim + 32 * c;
        const __m512 even = _mm512_loadu_ps(pair), odd = _mm512_loadu_ps(pair + 16);
        _mm512_storeu_ps(pair, _mm512_permutex2var_ps(even, first16, odd));
        _mm512_storeu_ps(pair + 16, _mm512_permutex2var_ps(even, last16, odd));
      }
    }
  }
  return true;
}

// Whether (q, cache) may take attend_span_vec: a bf16 cache under bf16 q, or
// an FP8 cache under any q.
template <typename T, typename KV>
constexpr bool kVecSpan = (std::is_same_v<T, BFloat16> && std::is_same_v<KV, BFloat16>) ||
                          (std::is_same_v<KV, Float8E4M3> && !std::is_same_v<T, double>);

// attend_span_vec for this head dim and group, if it has an instance (dims 64, 128, 256; groups 1-8); false if not.
template <typename T, typename KV>
bool attend_span_vec_dim(int64_t dim, const T* q, float scale, const KV* kp, const KV* vp, const int32_t* pages,
                         int64_t page_size, int64_t begin, int64_t end, int64_t num_heads, int64_t num_kv_heads,
                         float* maxes, float* sums, float* acc, std::vector<float>& scores,
                         std::vector<int64_t>& slots) {
  switch (dim) {
    case 64: return attend_span_vec<T, KV, 4>(q, scale, kp, vp, pages, page_size, begin, end, num_heads,
                                              num_kv_heads, maxes, sums, acc, scores, slots);
    case 128: return attend_span_vec<T, KV, 8>(q, scale, kp, vp, pages, page_size, begin, end, num_heads,
                                               num_kv_heads, maxes, sums, acc, scores, slots);
    case 256: return attend_span_vec<T, KV, 16>(q, scale, kp, vp, pages, page_size, begin, end, num_heads,
                                                num_kv_heads, maxes, sums, acc, scores, slots);
    default: return false;
  }
}
#endif

// Query head h of one request from its `splits` chunks' partial results
// (`parts`, one `row` apart: acc [heads x dim], then the heads' maxes and
// sums): every chunk rescaled to the overall max, summed, divided by the
// total. `merged`: dim floats of scratch.
template <typename T>
void merge_head(const float* parts, int64_t splits, int64_t row, int64_t num_heads, int64_t dim, int64_t h,
                float* merged, T* dst) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t s = 0; s < splits; ++s) top = std::max(top, parts[s * row + num_heads * dim + h]);
  float total = 0.f;
  std::fill(merged, merged + dim, 0.f);
  for (int64_t s = 0; s < splits; ++s) {
    const float* part = parts + s * row;
    const float chunk_max = part[num_heads * dim + h];
    if (chunk_max == -std::numeric_limits<float>::infinity()) continue;
    const float factor = splits == 1 ? 1.f : std::exp(chunk_max - top);
    total += part[num_heads * dim + num_heads + h] * factor;
    axpy(factor, part + h * dim, merged, dim);
  }
  for (int64_t d = 0; d < dim; ++d) dst[d] = from_float<T>(merged[d] / total);
}

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
    std::vector<float> qf(num_heads * dim), scores, merged(dim);
    std::vector<int64_t> slots;
    for (int64_t task = first_task; task < last_task; ++task) {
      const int64_t b = task / splits, split = task % splits;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t per = (len - first + splits - 1) / splits;
      const int64_t begin = std::min(len, first + split * per), end = std::min(len, begin + per);
      float* part = partials.data() + task * row;
      float *acc = part, *maxes = part + num_heads * dim, *sums = maxes + num_heads;
      bool done = begin >= end;
      if (done) {  // an empty chunk: contributes nothing to the merge
        std::fill(maxes, maxes + num_heads, -std::numeric_limits<float>::infinity());
        std::fill(sums, sums + num_heads, 0.f);
        std::fill(acc, acc + num_heads * dim, 0.f);
      }
#if defined(__AVX512F__)
      if constexpr (kVecSpan<T, KV>) {
        done = done || attend_span_vec_dim<T, KV>(dim, qp + b * num_heads * dim, static_cast<float>(scale), kp, vp,
                                                  pt + b * pages_per_row, page_size, begin, end, num_heads,
                                                  num_kv_heads, maxes, sums, acc, scores, slots);
      }
#endif
      if (!done) {
        for (int64_t i = 0; i < num_heads * dim; ++i) qf[i] = to_float(qp[b * num_heads * dim + i]) * static_cast<float>(scale);
        attend_span(qf.data(), kp, vp, pt + b * pages_per_row, page_size, begin, end, num_heads, num_kv_heads, dim,
                    maxes, sums, acc, scores);
      }
      // A request in one chunk: its output written by the task that computed
      // it (the merge's own arithmetic, so bit for bit), not by a second
      // parallel region over all of them (~3% of a batch-64 step's attention).
      if (splits == 1) {
        for (int64_t h = 0; h < num_heads; ++h)
          merge_head(part, 1, row, num_heads, dim, h, merged.data(), op + (task * num_heads + h) * dim);
      }
    }
  });
  // Merge each request's chunks: rescale every chunk to the overall max
  // (with one chunk a request, each task has written its own already).
  if (splits == 1) return;
  aioserve::parallel_pieces(batch * num_heads, 16, [&](int64_t first, int64_t last) {
    std::vector<float> merged(dim);
    for (int64_t task = first; task < last; ++task) {
      const int64_t b = task / num_heads, h = task % num_heads;
      merge_head(partials.data() + b * splits * row, splits, row, num_heads, dim, h, merged.data(),
                 op + (b * num_heads + h) * dim);
    }
  });
}

}  // namespace

// The cache may be narrower than q (half-precision KV under float32 math);
// an FP8 cache is read under q of any float type, the model's own.
template <typename KV>
void attention_for(const void* q, int q_type, const void* k_cache, const void* v_cache, const int32_t* page_table,
                   int64_t pages_per_row, const int64_t* seq_lens, int64_t batch, int64_t num_heads,
                   int64_t num_kv_heads, int64_t dim, int64_t page_size, double scale, int64_t window, void* out) {
  const KV* kp = static_cast<const KV*>(k_cache);
  const KV* vp = static_cast<const KV*>(v_cache);
  if constexpr (std::is_same_v<KV, Float8E4M3>) {
    dispatch_float(q_type, "paged_decode_attention", [&](auto q_tag) {
      using T = decltype(q_tag);
      decode_attention_impl<T, KV>(static_cast<const T*>(q), kp, vp, page_table, pages_per_row, seq_lens, batch,
                                   num_heads, num_kv_heads, dim, page_size, scale, window, static_cast<T*>(out));
    });
  } else if (q_type == kFloat32) {
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
  AIOSERVE_CHECK(q_type == kv_type || q_type == kFloat32 || kv_type == kFloat8E4M3,
                 "q must have the caches' dtype, or be float32 (any q over an FP8 cache)");
  switch (kv_type) {
    case kFloat32: return attention_for<float>(q, q_type, k_cache, v_cache, page_table, pages_per_row, seq_lens, batch,
                                               num_heads, num_kv_heads, dim, page_size, scale, window, out);
    case kBFloat16: return attention_for<BFloat16>(q, q_type, k_cache, v_cache, page_table, pages_per_row, seq_lens,
                                                   batch, num_heads, num_kv_heads, dim, page_size, scale, window, out);
    case kFloat16: return attention_for<Half>(q, q_type, k_cache, v_cache, page_table, pages_per_row, seq_lens, batch,
                                              num_heads, num_kv_heads, dim, page_size, scale, window, out);
    case kFloat64: return attention_for<double>(q, q_type, k_cache, v_cache, page_table, pages_per_row, seq_lens,
                                                batch, num_heads, num_kv_heads, dim, page_size, scale, window, out);
    case kFloat8E4M3: return attention_for<Float8E4M3>(q, q_type, k_cache, v_cache, page_table, pages_per_row,
                                                       seq_lens, batch, num_heads, num_kv_heads, dim, page_size, scale,
                                                       window, out);
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
