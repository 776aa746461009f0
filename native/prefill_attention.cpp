// causal_prefill_attention: bf16 prompt attention on AMX tiles, flash style.
//
// A prefill chunk's attention went to torch's CPU flash kernel, which on a
// 2-core Emerald Rapids VM ran Qwen3-0.6B's 4 x 512-token causal attention
// at ~300 GFLOP/s, a fifth of the machine's bf16 matmul peak, and took ~21%
// of the prefill step (docs/performance.md). Here both products run on the
// tiles: per (request, query head) and block of 32 query rows, the scores
// S = Q K^T of each 32-key block come out of four tile sums, an online
// softmax (float32, AVX-512) turns them into bf16 probabilities P and
// rescales the running output, and O += P V is summed into the output rows
// by the tiles themselves (loaded, multiplied into, stored back).
//
// The tiles' B operand holds pairs of k (VNNI): for S, K^T with pairs of
// head dims; for P V, V with pairs of keys. Each (request, KV head)'s K and
// V are laid out that way once per call (their rows rounded up to 32 with
// zeros), shared by the query heads of its group and all its query blocks.
// Queries see the keys up to their own position: query i of a chunk sits at
// i + (kv_len - q_len) (a chunk after a cached prefix); with a sliding
// window, none `window` or more behind it (Gemma 3's local layers: the
// blocks wholly before a query block's window are skipped). Sums are float32;
// the result is rounded to bf16 once, as torch's kernel does.

#include "kernels.h"
#include "parallel.h"
#include "tile_config.h"
#include "causal_blocks.h"
#include "vec_math.h"

#include <limits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#include <immintrin.h>
#define AIOSERVE_PREFILL_TILES 1
#endif

namespace aioserve {

#if defined(AIOSERVE_PREFILL_TILES)
namespace {

constexpr int64_t kRows = 32;  // query rows of a block: two 16-row tiles
constexpr int64_t kKeys = kBlockKeys;  // keys of a block: two 16-column tiles (and one 16-pair k step of P V)

// Every tile 16 rows of 64 bytes: 0-3 sums, 4-5 A (Q or P), 6-7 B (K^T or V).
inline void configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = 16;
  }
  _tile_loadconfig(&config);
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// One (request, KV head)'s keys and values in the tiles' pair layouts, each
// tile's 16 rows of 64 bytes one after the other (a tile load then reads
// 1 KiB in one run, not 16 rows a page apart):
//   kt: K^T in pairs of dims, [keys / 16][dim / 2][16 keys] 32-bit words;
//   vp: V in pairs of keys, [keys / 32][dim / 16][16 key pairs][16 dims].
// Keys are rounded up to kKeys, the rows past kv_len zero.
// 16 x 16 32-bit words transposed: rows[i] lane j -> rows[j] lane i.
inline void transpose16(__m512i* rows) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    rows[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    rows[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    rows[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    rows[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_i32x4(rows[i + j], rows[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_i32x4(rows[i + j], rows[i + j + 4], 0xDD);
    }
  }
  for (int j = 0; j < 8; ++j) {
    rows[j] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0x88);
    rows[j + 8] = _mm512_shuffle_i32x4(t[j], t[j + 8], 0xDD);
  }
}

void pack_kv(const uint16_t* k, int64_t k_tok, const uint16_t* v, int64_t v_tok, int64_t kv_len, int64_t padded,
             int64_t dim, uint32_t* kt, uint32_t* vp) {
  const int64_t pairs = dim / 2, dim_blocks = dim / 16;
  // K^T: each 16 keys x 16 dim pairs, transposed in registers.
  for (int64_t n0 = 0; n0 < padded; n0 += 16) {
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i rows[16];
      for (int i = 0; i < 16; ++i) {
        rows[i] = n0 + i < kv_len ? _mm512_loadu_si512(k + (n0 + i) * k_tok + 2 * p0) : _mm512_setzero_si512();
      }
      transpose16(rows);
      uint32_t* dst = kt + ((n0 / 16) * pairs + p0) * 16;
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(dst + i * 16, rows[i]);
    }
  }
  const __m256i zero = _mm256_setzero_si256();
  for (int64_t kp = 0; kp < padded / 2; ++kp) {
    const int64_t a = 2 * kp, b = 2 * kp + 1;
    uint32_t* dst = vp + (kp / 16) * dim_blocks * 256 + (kp % 16) * 16;
    for (int64_t d0 = 0; d0 < dim; d0 += 16) {
      const __m256i lo = a < kv_len ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + a * v_tok + d0)) : zero;
      const __m256i hi = b < kv_len ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + b * v_tok + d0)) : zero;
      const __m512i words = _mm512_or_si512(_mm512_cvtepu16_epi32(lo), _mm512_slli_epi32(_mm512_cvtepu16_epi32(hi), 16));
      _mm512_storeu_si512(dst + (d0 / 16) * 256, words);
    }
  }
}

// exp(x) for x <= 0, to the precision of a bf16 probability: 2^n * p(r),
// |r| <= ln2 / 2, p of degree 4 (relative error ~4e-5, under bf16's 4e-3),
// 2^n by scalef (which takes x's far negative end to 0). Half the work of
// exp_approx16, and the softmax's exps are most of its instructions.
inline __m512 exp_probability16(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945f), x);
  __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.f / 24), _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// The online softmax of 16 query rows of a block: scores [16][kKeys]
// float32 sums, scaled; row i sees the keys up to last0 + i, and with a
// window (> 0) none `window` or more behind that (the others masked). Each row's max and sum are updated, its probabilities written
// as bf16 to probs [16][kKeys], and the factor its output must be scaled by
// to factors (1 where the max did not move).
inline void softmax_rows16(const float* scores, float scale, int64_t first_key, int64_t last0, int64_t window,
                           float* row_max, float* row_sum, uint16_t* probs, float* factors) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  VisibleKeys visible[16];
  __m512 part[16];
  for (int i = 0; i < 16; ++i) {
    visible[i] = visible_keys(last0 + i, first_key, window);
    part[i] = visible_max(scores + i * kKeys, scale_v, visible[i]);
  }
  const __m512 old_max = _mm512_loadu_ps(row_max);
  const __m512 top = _mm512_max_ps(old_max, reduce16(part, max_op));
  const __m512 factor = rescale_factors(old_max, top, exp_probability16);
  alignas(64) float tops[16];
  _mm512_store_ps(tops, top);
  for (int i = 0; i < 16; ++i) {
    const __m512 t = _mm512_set1_ps(tops[i]);
    const __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(scores + i * kKeys), scale_v);
    const __m512 s1 = _mm512_mul_ps(_mm512_loadu_ps(scores + i * kKeys + 16), scale_v);
    const __m512 p0 = _mm512_maskz_mov_ps(visible[i].lo, exp_probability16(_mm512_sub_ps(s0, t)));
    const __m512 p1 = _mm512_maskz_mov_ps(visible[i].hi, exp_probability16(_mm512_sub_ps(s1, t)));
    _mm512_storeu_si512(probs + i * kKeys, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    part[i] = _mm512_add_ps(p0, p1);
  }
  _mm512_storeu_ps(row_sum, _mm512_fmadd_ps(_mm512_loadu_ps(row_sum), factor, reduce16(part, add_op)));
  _mm512_storeu_ps(row_max, top);
  _mm512_storeu_ps(factors, factor);
}

// One (request, query head, block of kRows query rows): out's rows written.
void attend_block(const CausalShapes& s, const uint16_t* q, const uint32_t* kt, const uint32_t* vp, int64_t r,
                  int64_t h, int64_t q0, uint16_t* out) {
  const int64_t dim = s.dim, rows = std::min(kRows, s.q_len - q0), offset = s.kv_len - s.q_len;
  alignas(64) uint16_t qb[kRows * 256];  // the block's queries, rows past `rows` zero
  alignas(64) float scores[kRows * kKeys];
  alignas(64) uint16_t probs[kRows * kKeys];
  alignas(64) float acc[kRows * 256];
  alignas(64) float row_max[kRows], row_sum[kRows];
  for (int64_t i = 0; i < kRows; ++i) {
    uint16_t* dst = qb + i * dim;
    if (i < rows) {
      std::memcpy(dst, q + (r * s.q_len + q0 + i) * s.q_tok + h * s.q_head, dim * 2);
    } else {
      std::memset(dst, 0, dim * 2);
    }
    row_max[i] = -std::numeric_limits<float>::infinity();
    row_sum[i] = 0.f;
  }
  std::memset(acc, 0, sizeof(float) * kRows * dim);
  const int64_t q_row_bytes = dim * 2, acc_row_bytes = dim * 4;
  const int64_t keys_end = std::min(s.kv_len, offset + q0 + rows);  // the last row's keys
  for (int64_t k0 = first_key_block(offset + q0, s.window); k0 < keys_end; k0 += kKeys) {
    // S = Q K^T: tiles 0, 1 rows 0-15 (keys 0-15, 16-31), 2, 3 rows 16-31.
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      _tile_loadd(4, qb + d0, q_row_bytes);
      _tile_loadd(5, qb + 16 * dim + d0, q_row_bytes);
      _tile_loadd(6, kt + ((k0 / 16) * (dim / 2) + d0 / 2) * 16, 64);
      _tile_loadd(7, kt + ((k0 / 16 + 1) * (dim / 2) + d0 / 2) * 16, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, scores, kKeys * 4);
    _tile_stored(1, scores + 16, kKeys * 4);
    _tile_stored(2, scores + 16 * kKeys, kKeys * 4);
    _tile_stored(3, scores + 16 * kKeys + 16, kKeys * 4);
    alignas(64) float factors[kRows];
    softmax_rows16(scores, s.scale, k0, offset + q0, s.window, row_max, row_sum, probs, factors);
    softmax_rows16(scores + 16 * kKeys, s.scale, k0, offset + q0 + 16, s.window, row_max + 16, row_sum + 16,
                   probs + 16 * kKeys, factors + 16);
    rescale_rows(acc, dim, factors, kRows);
    // O += P V, summed into the output rows by the tiles.
    _tile_loadd(4, probs, kKeys * 2);
    _tile_loadd(5, probs + 16 * kKeys, kKeys * 2);
    for (int64_t d0 = 0; d0 < dim; d0 += 32) {
      _tile_loadd(0, acc + d0, acc_row_bytes);
      _tile_loadd(1, acc + d0 + 16, acc_row_bytes);
      _tile_loadd(2, acc + 16 * dim + d0, acc_row_bytes);
      _tile_loadd(3, acc + 16 * dim + d0 + 16, acc_row_bytes);
      _tile_loadd(6, vp + ((k0 / 32) * (dim / 16) + d0 / 16) * 256, 64);
      _tile_loadd(7, vp + ((k0 / 32) * (dim / 16) + d0 / 16 + 1) * 256, 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
      _tile_stored(0, acc + d0, acc_row_bytes);
      _tile_stored(1, acc + d0 + 16, acc_row_bytes);
      _tile_stored(2, acc + 16 * dim + d0, acc_row_bytes);
      _tile_stored(3, acc + 16 * dim + d0 + 16, acc_row_bytes);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const __m512 inverse = _mm512_set1_ps(1.f / row_sum[i]);
    uint16_t* dst = out + ((r * s.q_len + q0 + i) * s.heads + h) * dim;
    const float* a = acc + i * dim;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512 lo = _mm512_mul_ps(inverse, _mm512_loadu_ps(a + d));
      const __m512 hi = _mm512_mul_ps(inverse, _mm512_loadu_ps(a + d + 16));
      _mm512_storeu_si512(dst + d, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  }
}

}  // namespace
#endif

bool prefill_attention_tiles_built() {
#if defined(AIOSERVE_PREFILL_TILES)
  return true;
#else
  return false;
#endif
}

void causal_prefill_attention(const void* q, int64_t q_tok, int64_t q_head, const void* k, int64_t k_tok,
                              int64_t k_head, const void* v, int64_t v_tok, int64_t v_head, int64_t count,
                              int64_t q_len, int64_t kv_len, int64_t heads, int64_t kv_heads, int64_t dim, double scale,
                              int64_t window, void* out) {
#if defined(AIOSERVE_PREFILL_TILES)
  AIOSERVE_CHECK(amx_tiles_on(), "causal_prefill_attention: AMX tiles are not in use");
  AIOSERVE_CHECK(dim % 32 == 0 && dim <= 256, "causal_prefill_attention: head dim ", dim, " (a multiple of 32, <= 256)");
  AIOSERVE_CHECK(heads % kv_heads == 0, "causal_prefill_attention: query heads a multiple of KV heads");
  AIOSERVE_CHECK(kv_len >= q_len && q_len > 0, "causal_prefill_attention: kv_len >= q_len > 0");
  const CausalShapes s{count, q_len, kv_len, heads, kv_heads, dim, q_tok, q_head, k_tok, k_head, v_tok, v_head,
                       window, static_cast<float>(scale)};
  // kt and vp of a (request, KV head) pair: `half` 32-bit words each (padded keys x dim bf16).
  const int64_t padded = round_up(kv_len, kKeys), half = padded * dim / 2;
  const auto words = static_cast<size_t>(count * kv_heads * 2 * half);
  thread_local std::vector<uint32_t> packed;  // grow-only: a fresh 8 MB a layer would fault its pages in each time
  if (packed.size() < words) packed.resize(words);
  uint32_t* base = packed.data();
  const auto* qp = static_cast<const uint16_t*>(q);
  const auto* kp = static_cast<const uint16_t*>(k);
  const auto* vp = static_cast<const uint16_t*>(v);
  parallel_pieces(count * kv_heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t task = first; task < last; ++task) {
      const int64_t r = task / kv_heads, g = task % kv_heads;
      pack_kv(kp + r * kv_len * k_tok + g * k_head, k_tok, vp + r * kv_len * v_tok + g * v_head, v_tok, kv_len, padded,
              dim, base + task * 2 * half, base + task * 2 * half + half);
    }
  });
  const int64_t blocks = (q_len + kRows - 1) / kRows, group = heads / kv_heads;
  auto* op = static_cast<uint16_t*>(out);
  // Latest query blocks first: they have the most keys, and the pieces taken last should be the short ones.
  parallel_pieces(count * heads * blocks, 1, [&](int64_t first, int64_t last) {
    configure();
    for (int64_t task = first; task < last; ++task) {
      const int64_t block = blocks - 1 - task % blocks, rh = task / blocks, r = rh / heads, h = rh % heads;
      const int64_t pair = r * kv_heads + h / group;
      attend_block(s, qp, base + pair * 2 * half, base + pair * 2 * half + half, r, h, block * kRows, op);
    }
    _tile_release();
  }, 2);
#else
  (void)q, (void)q_tok, (void)q_head, (void)k, (void)k_tok, (void)k_head, (void)v, (void)v_tok, (void)v_head;
  (void)count, (void)q_len, (void)kv_len, (void)heads, (void)kv_heads, (void)dim, (void)scale, (void)window, (void)out;
  fail("causal_prefill_attention: built without AMX tiles");
#endif
}

}  // namespace aioserve

static int causal_prefill_attention_direct(const void* q, int64_t q_tok, int64_t q_head, const void* k, int64_t k_tok,
                                           int64_t k_head, const void* v, int64_t v_tok, int64_t v_head, int64_t count,
                                           int64_t q_len, int64_t kv_len, int64_t heads, int64_t kv_heads, int64_t dim,
                                           double scale, int64_t window, void* out) {
  return aioserve::guarded([&] {
    aioserve::causal_prefill_attention(q, q_tok, q_head, k, k_tok, k_head, v, v_tok, v_head, count, q_len, kv_len,
                                       heads, kv_heads, dim, scale, window, out);
  });
}

extern "C" {

int aioserve_causal_prefill_attention(const void* record) {
  return aioserve::call_packed(causal_prefill_attention_direct, record);
}

// Whether this build has the tiled kernel (a CPU with AMX, a compiler that targets it).
int aioserve_prefill_attention_tiles_built() { return aioserve::prefill_attention_tiles_built() ? 1 : 0; }

}  // extern "C"
