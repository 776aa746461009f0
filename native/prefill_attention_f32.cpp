// causal_prefill_attention_f32: float32 prompt attention with AVX-512 FMAs,
// flash style.
//
// A float32 model's prefill chunk went to torch's CPU flash kernel, which on
// a 2-core Emerald Rapids VM ran tiny-llama's attention (6 heads of 48 dims,
// 4 x 512 tokens) at ~72 GFLOP/s, a quarter of the machine's float32 FMA
// rate: 50 of a 4 x 512 prefill's ~190 ms. Here both products are register
// tiles like the packed matmul's (gemm.cpp): per (request, query head) and
// block of kRows query rows, the scores of each block of kKeys keys are
// kRows x 32 sums held in 24 registers while the head dims stream past, an
// online softmax (float32, exp_approx16) turns them into probabilities and
// rescales the running output, and O += P V runs as the same kind of tile
// over the block's keys, 32 output dims at a time.
//
// K is laid out once per (request, KV head), transposed in blocks of 16 keys
// ([keys / 16][dim][16]: one vector per head dim), shared by the query heads
// of its group and all their query blocks; V is read where it is (a key's
// row of dims is already what a vector load wants). Queries see the keys up
// to their own position: query i of a chunk sits at i + (kv_len - q_len) (a
// chunk after a cached prefix); with a sliding window, none `window` or
// more behind it. Sums are float32 throughout; the probabilities stay
// float32 (no rounding to a narrower type), so the result differs from
// torch's only in the order of the additions.

#include "causal_blocks.h"
#include "kernels.h"
#include "parallel.h"
#include "vec_math.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace aioserve {

#if defined(__AVX512F__)
namespace {

constexpr int64_t kRows = 12;  // query rows of a block: 12 x 32 scores, 24 accumulators
constexpr int64_t kKeys = kBlockKeys;  // keys of a block: two vectors a row
constexpr int64_t kMaxDim = 256;

// One (request, KV head)'s keys as [padded / 16][dim][16], keys past kv_len zero.
void pack_keys(const float* k, int64_t k_tok, int64_t kv_len, int64_t padded, int64_t dim, float* kt) {
  for (int64_t n = 0; n < padded; ++n) {
    float* column = kt + (n / 16) * dim * 16 + n % 16;
    if (n < kv_len) {
      const float* row = k + n * k_tok;
      for (int64_t d = 0; d < dim; ++d) column[d * 16] = row[d];
    } else {
      for (int64_t d = 0; d < dim; ++d) column[d * 16] = 0.f;
    }
  }
}

// scores [kRows][kKeys] = the block's queries (transposed: qt [dim][kRows],
// so each step's kRows broadcasts read one line from one pointer; rows of
// their own took a register each, more than there are, and the loop
// reloaded spilled ones) against keys k0 .. k0 + 31 (two transposed blocks
// of 16).
inline void block_scores(const float* qt, int64_t dim, const float* kt0, const float* kt1, float* scores) {
  __m512 acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; ++d) {
    const __m512 k0 = _mm512_loadu_ps(kt0 + d * 16), k1 = _mm512_loadu_ps(kt1 + d * 16);
    for (int r = 0; r < kRows; ++r) {
      const __m512 q = _mm512_set1_ps(qt[d * kRows + r]);
      acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm512_storeu_ps(scores + r * kKeys, acc[r][0]);
    _mm512_storeu_ps(scores + r * kKeys + 16, acc[r][1]);
  }
}

// acc [kRows][dim] (dims d0 .. d0 + 16 Vecs) += probs [kRows][kKeys] x V's
// rows of the block's `keys` keys (row stride v_tok).
template <int Vecs>
inline void add_values(const float* probs, int64_t keys, const float* v, int64_t v_tok, float* acc, int64_t dim,
                       int64_t d0) {
  __m512 a[kRows][Vecs];
  for (int r = 0; r < kRows; ++r)
    for (int u = 0; u < Vecs; ++u) a[r][u] = _mm512_loadu_ps(acc + r * dim + d0 + 16 * u);
  for (int64_t j = 0; j < keys; ++j) {
    __m512 values[Vecs];
    for (int u = 0; u < Vecs; ++u) values[u] = _mm512_loadu_ps(v + j * v_tok + d0 + 16 * u);
    for (int r = 0; r < kRows; ++r) {
      const __m512 p = _mm512_set1_ps(probs[r * kKeys + j]);
      for (int u = 0; u < Vecs; ++u) a[r][u] = _mm512_fmadd_ps(p, values[u], a[r][u]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int u = 0; u < Vecs; ++u) _mm512_storeu_ps(acc + r * dim + d0 + 16 * u, a[r][u]);
}

// The online softmax of a block's rows, row i in lane i (rows past `rows`
// and lanes past kRows idle): scores [kRows][kKeys], scaled here; row i sits
// at position pos0 + i and sees the keys up to it (with a window > 0, none
// `window` or more behind it), the others masked. Each row's max and sum
// are updated, its probabilities written to probs [kRows][kKeys] (0 where
// masked), and the factor its output must be scaled by to factors (1 where
// the max did not move). All rows at once: a row at a time, each waited on
// its reductions and its exp in turn, and the softmax cost as much as both
// products.
inline void softmax_rows(const float* scores, float scale, int64_t k0, int64_t pos0, int64_t rows, int64_t window,
                         float* row_max, float* row_sum, float* probs, float* factors) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  VisibleKeys visible[kRows];
  __m512 part[16];
  for (int i = 0; i < 16; ++i) part[i] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int i = 0; i < kRows; ++i) {
    visible[i] = i < rows ? visible_keys(pos0 + i, k0, window) : VisibleKeys{0, 0};
    if (i < rows) part[i] = visible_max(scores + i * kKeys, scale_v, visible[i]);
  }
  const __m512 old_max = _mm512_loadu_ps(row_max);
  const __m512 top = _mm512_max_ps(old_max, reduce16(part, max_op));
  const __m512 factor = rescale_factors(old_max, top, exp_approx16);
  alignas(64) float tops[16];
  _mm512_store_ps(tops, top);
  for (int i = 0; i < 16; ++i) part[i] = _mm512_setzero_ps();
  for (int i = 0; i < kRows; ++i) {
    float* p = probs + i * kKeys;
    if ((visible[i].lo | visible[i].hi) == 0) {  // no key of this block (or no row): nothing added
      std::memset(p, 0, sizeof(float) * kKeys);
      continue;
    }
    const __m512 t = _mm512_set1_ps(tops[i]);
    const __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(scores + i * kKeys), scale_v);
    const __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(scores + i * kKeys + 16), scale_v);
    const __m512 p0 = _mm512_maskz_mov_ps(visible[i].lo, exp_approx16(_mm512_sub_ps(s0, t)));
    const __m512 p1 = _mm512_maskz_mov_ps(visible[i].hi, exp_approx16(_mm512_sub_ps(s1, t)));
    _mm512_storeu_ps(p, p0);
    _mm512_storeu_ps(p + 16, p1);
    part[i] = _mm512_add_ps(p0, p1);
  }
  _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), factor, reduce16(part, add_op)));
  _mm512_storeu_ps(row_max, top);
  _mm512_storeu_ps(factors, factor);
}

// One (request, query head, block of kRows query rows): out's rows written.
void attend_block(const CausalShapes& s, const float* q, const float* kt, const float* v, int64_t r, int64_t h,
                  int64_t q0, float* out) {
  const int64_t dim = s.dim, rows = std::min(kRows, s.q_len - q0), offset = s.kv_len - s.q_len;
  const int64_t group = s.heads / s.kv_heads;
  alignas(64) float qt[kMaxDim * kRows];  // the block's queries transposed, rows past `rows` zero
  alignas(64) float scores[kRows * kKeys];
  alignas(64) float probs[kRows * kKeys];
  alignas(64) float acc[kRows * kMaxDim];
  alignas(64) float row_max[16], row_sum[16], factors[16];  // a lane per row (softmax_rows)
  for (int64_t i = kRows; i < 16; ++i) {
    row_max[i] = -std::numeric_limits<float>::infinity();
    row_sum[i] = 0.f;
  }
  for (int64_t i = 0; i < kRows; ++i) {
    if (i < rows) {
      const float* row = q + (r * s.q_len + q0 + i) * s.q_tok + h * s.q_head;
      for (int64_t d = 0; d < dim; ++d) qt[d * kRows + i] = row[d];
    } else {
      for (int64_t d = 0; d < dim; ++d) qt[d * kRows + i] = 0.f;
    }
    row_max[i] = -std::numeric_limits<float>::infinity();
    row_sum[i] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * kRows * dim);
  const float* values = v + r * s.kv_len * s.v_tok + (h / group) * s.v_head;
  const int64_t keys_end = std::min(s.kv_len, offset + q0 + rows);  // the last row's keys
  for (int64_t k0 = first_key_block(offset + q0, s.window); k0 < keys_end; k0 += kKeys) {
    block_scores(qt, dim, kt + (k0 / 16) * dim * 16, kt + (k0 / 16 + 1) * dim * 16, scores);
    softmax_rows(scores, s.scale, k0, offset + q0, rows, s.window, row_max, row_sum, probs, factors);
    rescale_rows(acc, dim, factors, rows);
    const int64_t keys = std::min(kKeys, s.kv_len - k0);  // V has no rows past kv_len
    const float* block_values = values + k0 * s.v_tok;
    int64_t d0 = 0;
    for (; d0 + 32 <= dim; d0 += 32) add_values<2>(probs, keys, block_values, s.v_tok, acc, dim, d0);
    if (d0 < dim) add_values<1>(probs, keys, block_values, s.v_tok, acc, dim, d0);
  }
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 inverse = _mm512_set1_ps(1.f / row_sum[i]);
    float* dst = out + ((r * s.q_len + q0 + i) * s.heads + h) * dim;
    const float* a = acc + i * dim;
    for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(inverse, _mm512_loadu_ps(a + d)));
  }
}

}  // namespace
#endif

bool prefill_attention_f32_built() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

void causal_prefill_attention_f32(const float* q, int64_t q_tok, int64_t q_head, const float* k, int64_t k_tok,
                                  int64_t k_head, const float* v, int64_t v_tok, int64_t v_head, int64_t count,
                                  int64_t q_len, int64_t kv_len, int64_t heads, int64_t kv_heads, int64_t dim,
                                  double scale, int64_t window, float* out) {
#if defined(__AVX512F__)
  AIOSERVE_CHECK(dim % 16 == 0 && dim > 0 && dim <= kMaxDim,
                 "causal_prefill_attention_f32: head dim ", dim, " (a multiple of 16, <= 256)");
  AIOSERVE_CHECK(kv_heads > 0 && heads % kv_heads == 0,
                 "causal_prefill_attention_f32: query heads a multiple of KV heads");
  AIOSERVE_CHECK(kv_len >= q_len && q_len > 0, "causal_prefill_attention_f32: kv_len >= q_len > 0");
  const CausalShapes s{count, q_len, kv_len, heads, kv_heads, dim, q_tok, q_head, k_tok, k_head, v_tok, v_head,
                       window, static_cast<float>(scale)};
  // K^T of a (request, KV head) pair: padded keys x dim floats. Padded to a
  // whole score block, so the last block's second half reads zeros.
  const int64_t padded = (kv_len + kKeys - 1) / kKeys * kKeys, per_pair = padded * dim;
  const auto floats = static_cast<size_t>(count * kv_heads * per_pair);
  thread_local std::vector<float> packed;  // grow-only: a fresh buffer a layer would fault its pages in each time
  if (packed.size() < floats) packed.resize(floats);
  float* base = packed.data();
  parallel_pieces(count * kv_heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      pack_keys(k + r * kv_len * k_tok + g * k_head, k_tok, kv_len, padded, dim, base + task * per_pair);
    }
  });
  const int64_t blocks = (q_len + kRows - 1) / kRows, group = heads / kv_heads;
  // Latest query blocks first: they have the most keys, and the pieces taken last should be the short ones.
  parallel_pieces(count * heads * blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t block = blocks - 1 - task % blocks, rh = task / blocks, r = rh / heads, h = rh % heads;
      attend_block(s, q, base + (r * kv_heads + h / group) * per_pair, v, r, h, block * kRows, out);
    }
  }, 2);
#else
  (void)q, (void)q_tok, (void)q_head, (void)k, (void)k_tok, (void)k_head, (void)v, (void)v_tok, (void)v_head;
  (void)count, (void)q_len, (void)kv_len, (void)heads, (void)kv_heads, (void)dim, (void)scale, (void)window, (void)out;
  fail("causal_prefill_attention_f32: built without AVX-512");
#endif
}

}  // namespace aioserve

static int causal_prefill_attention_f32_direct(const void* q, int64_t q_tok, int64_t q_head, const void* k,
                                               int64_t k_tok, int64_t k_head, const void* v, int64_t v_tok,
                                               int64_t v_head, int64_t count, int64_t q_len, int64_t kv_len,
                                               int64_t heads, int64_t kv_heads, int64_t dim, double scale,
                                               int64_t window, void* out) {
  return aioserve::guarded([&] {
    aioserve::causal_prefill_attention_f32(static_cast<const float*>(q), q_tok, q_head, static_cast<const float*>(k),
                                           k_tok, k_head, static_cast<const float*>(v), v_tok, v_head, count, q_len,
                                           kv_len, heads, kv_heads, dim, scale, window, static_cast<float*>(out));
  });
}

extern "C" {

int aioserve_causal_prefill_attention_f32(const void* record) {
  return aioserve::call_packed(causal_prefill_attention_f32_direct, record);
}

// Whether this build has the float32 kernel (a compiler targeting AVX-512).
int aioserve_prefill_attention_f32_built() { return aioserve::prefill_attention_f32_built() ? 1 : 0; }

}  // extern "C"
