// int8_screened_argmax: greedy decoding's token from a bf16 LM head read at
// int8 width through AMX-INT8 tiles, with the answer packed_linear_argmax
// gives, bit for bit.
//
// Why: a single-stream decode step is bound by reading the weights, and the
// LM head is a quarter of them (Qwen3-0.6B: [151936, 1024] bf16, 311 MB of a
// 1.19 GB step), while a greedy row needs only the head's argmax. An int8
// copy of the head (s_j q_j, one scale per column) is half the bytes; the
// few columns it cannot rule out are computed again from the bf16 head.
//
// The screen. x (a row of bf16 hidden states) is held as two int8 digits a
// value, x~ = sx (q1 + q2 / 254), close to exact; the two digit rows of x's
// row r are rows 2r and 2r + 1 of an A tile, so each TDPBSSD sums both
// against 64 k of 16 columns, exactly (int32: |sum| <= k 127^2 < 2^31 for
// k < 2^17). A_j = sx s_j (I1_j + I2_j / 254) = x~ . w~_j, formed in double.
//
// The bound. E_j, the float32 sum the head's bf16 tiles compute (x and w
// with subnormals read as zero; each product of two bf16 values exact in
// float32 unless it underflows), before it is rounded to bf16:
//   |E_j - x.w_j|  <= gamma'_k ||x|| ||w_j|| + 2 k 2^-126     (any rounding of the k sums: u = 2^-23)
//   |x.w_j - A_j| <= ||x|| ||w_j - w~_j|| + ||x - x~|| ||w~_j||
// so r_j = ||x|| slack_j + ||x - x~|| norms_j + underflow, with slack_j =
// ||w_j - w~_j|| + gamma'_k ||w_j|| and norms_j = ||w~_j|| made at load
// (aioserve/cpu_engine/int8_head_screen.py), rounded up.
//
// The choice. The head's logits are V_j = bf16(E_j) and its token the first
// largest V_j. With L = max_j (A_j - r_j), reached at column m, E_m >= L;
// b is the largest bf16 value <= L and p the bf16 value below b. V_m >= b
// (rounding to nearest is monotone), and a column with A_j + r_j < p has
// E_j < p, so V_j <= p < b <= V_m: it is not the token, not even on a tie.
// The 32-column blocks holding the others (a few per row) are handed, as a
// list, to packed_linear_argmax itself: the same tiles make the same sums,
// so its first largest among them is the head's. Every double above is
// within 2^-40 (|A_j| + r_j) of its exact value (a few roundings of
// 2^-53); L is lowered and p compared with that margin.
//
// Rows: 1 to 16 (two A tiles); a step with more goes to the full head. A row
// that is not finite, or too many blocks to compute again, is left to the
// caller (ok false).

#include "half.h"
#include "kernels.h"
#include "parallel.h"
#include "tile_config.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define AIOSERVE_INT8_TILES 1  // the screen's sums on AMX-INT8 tiles
#endif
#if defined(__AVX512VNNI__)
#define AIOSERVE_INT8_VNNI 1  // ... or on AVX512-VNNI dot products (where the bf16 tiles are off or absent)
#endif
#if defined(AIOSERVE_INT8_TILES) || defined(AIOSERVE_INT8_VNNI)
#define AIOSERVE_INT8_SCREEN 1
#endif
#endif

namespace {

using aioserve::BFloat16;

constexpr int64_t kBlock = 32;       // columns per packed block: gemm.cpp's (checked by the caller)
constexpr int64_t kMaxRows = 16;     // rows of x: two digit rows each, in two 16-row A tiles at most
constexpr int64_t kVnniRows = 4;     // rows of x on the VNNI form: 2 x 4 digit rows x 2 vectors of sums in registers
constexpr int64_t kStepK = 64;       // k per tile step: 64 int8 a row of A, 16 quads of k in B
constexpr double kDigit = 254.0;     // the second digit's weight: x~ = sx (q1 + q2 / kDigit)
constexpr double kMargin = 0x1p-40;  // the doubles' error, relative to |A_j| + r_j (see above)

// The bound's per-row factors and x's digits.
struct RowDigits {
  double scale = 1.0;  // sx
  double norm = 0.0;   // ||x||, rounded up
  double diff = 0.0;   // ||x - x~||, rounded up
  bool finite = true;
};

RowDigits digits(const BFloat16* x, int64_t k, int8_t* first, int8_t* second) {
  RowDigits row;
  std::vector<double> values(k);
  double largest = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    double v = aioserve::to_float(x[i]);
    if (std::fabs(v) < 0x1p-126) v = 0.0;  // read as zero by the tiles
    row.finite &= std::isfinite(v);
    values[i] = v;
    largest = std::max(largest, std::fabs(v));
  }
  if (!row.finite) return row;
  row.scale = largest > 0.0 ? largest / 127.0 : 1.0;
  double norm2 = 0.0, diff2 = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    const double t = values[i] / row.scale;
    const double q1 = std::clamp(std::nearbyint(t), -127.0, 127.0);
    const double q2 = std::clamp(std::nearbyint((t - q1) * kDigit), -127.0, 127.0);
    first[i] = static_cast<int8_t>(q1);
    second[i] = static_cast<int8_t>(q2);
    const double held = row.scale * (q1 + q2 / kDigit);
    norm2 += values[i] * values[i];
    diff2 += (values[i] - held) * (values[i] - held);
  }
  // Rounded up past the sums' own rounding (k 2^-53 relative) and held's (2^-52 |held_i|).
  row.norm = std::sqrt(norm2) * (1 + 0x1p-30);
  row.diff = std::sqrt(diff2) * (1 + 0x1p-30) + row.scale * 0x1p-30 * std::sqrt(static_cast<double>(k));
  return row;
}

// The largest bf16 value <= v (finite v), as a double.
double bf16_floor(double v) {
  float f = static_cast<float>(v);
  if (f > v) f = std::nextafter(f, -std::numeric_limits<float>::infinity());
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t truncated = bits & 0xffff0000u;  // toward zero
  float t;
  std::memcpy(&t, &truncated, sizeof t);
  if (t > f) {  // a negative value truncated upward: one bf16 step further from zero
    const uint32_t lower = truncated + 0x10000u;
    std::memcpy(&t, &lower, sizeof t);
  }
  return t;
}

// The bf16 value just below bf16 value b.
double bf16_below(double b) {
  const float f = static_cast<float>(b);
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if (f > 0.f) {
    bits -= 0x10000u;
  } else if (f == 0.f) {
    bits = 0x80010000u;  // -(the smallest bf16 subnormal), below both zeros
  } else {
    bits += 0x10000u;
  }
  float out;
  std::memcpy(&out, &bits, sizeof out);
  return out;
}

// Per block and row: the largest A_j - r_j, A_j + r_j and |A_j| + r_j.
struct BlockBounds {
  double low, high, magnitude;
};

#if defined(AIOSERVE_INT8_TILES)
// Tiles: 0-1 the int32 sums of a block's two halves for x's first 8 rows
// (their 16 digit rows, or fewer), 2-3 those of rows 8-15 (if any), 4-5
// the digit rows of each, 6-7 the halves' weights (16 quads of k by 16
// columns, 64 bytes).
void configure_int8_tiles(int digit_rows) {
  aioserve::TileConfig config;
  const int first = std::min(digit_rows, 16), second = digit_rows - first;
  const int rows[8] = {first, first, second, second, first, second, 16, 16};
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = rows[t] > 0 ? 64 : 0;
    config.rows[t] = static_cast<uint8_t>(rows[t]);
  }
  _tile_loadconfig(&config);
}

// The block's sums, int32 [2m][kBlock], from its quad-packed int8 weights
// [k / 4][kBlock][4]; `next` (if given), the block after it, asked into L2
// a step at a time (the hardware prefetchers stop at each 4 KiB).
// TwoTiles: x has more than 8 rows (a second A tile).
template <bool TwoTiles>
inline void block_sums(const int8_t* a, int64_t k, const int8_t* block, const int8_t* next, int32_t* sums) {
  constexpr int64_t kQuadRowBytes = kBlock * 4;
  constexpr int64_t kStepBytes = kStepK / 4 * kQuadRowBytes;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TwoTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < k; k0 += kStepK) {
    const int8_t* quads = block + k0 * kBlock;
    if (next != nullptr) {
      const char* ahead = reinterpret_cast<const char*>(next + k0 * kBlock);
      for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    }
    _tile_loadd(6, quads, kQuadRowBytes);
    _tile_loadd(7, quads + 64, kQuadRowBytes);
    _tile_loadd(4, a + k0, k);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    if constexpr (TwoTiles) {
      _tile_loadd(5, a + 16 * k + k0, k);
      _tile_dpbssd(2, 5, 6);
      _tile_dpbssd(3, 5, 7);
    }
  }
  _tile_stored(0, sums, kBlock * 4);
  _tile_stored(1, sums + 16, kBlock * 4);
  if constexpr (TwoTiles) {
    _tile_stored(2, sums + 16 * kBlock, kBlock * 4);
    _tile_stored(3, sums + 16 * kBlock + 16, kBlock * 4);
  }
}

#endif

#if defined(AIOSERVE_INT8_VNNI)
// The VNNI form of block_sums, for CPUs without the tiles (AMD Zen 4,
// Ice Lake) and for rows 1-4: each 32-bit lane of vpdpbusd sums four
// products of unsigned bytes by signed ones, so the digits go in shifted by
// 128 (u = q + 128) and 128 times each column's sum of q is taken off again
// (`column_sums`, made with the copy): the same exact int32 sums.
template <int DigitRows>
inline void block_sums_vnni(const uint8_t* a, int64_t k, const int8_t* block, const int8_t* next,
                            const int32_t* column_sums, int32_t* sums) {
  __m512i acc[DigitRows][2];
  for (int r = 0; r < DigitRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  constexpr int64_t kQuadRowBytes = kBlock * 4;
  for (int64_t i = 0; i < k / 4; ++i) {
    if (next != nullptr && i % 16 == 0) {
      const char* ahead = reinterpret_cast<const char*>(next + i * kQuadRowBytes);
      for (int64_t line = 0; line < 16 * kQuadRowBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    }
    const __m512i w0 = _mm512_loadu_si512(block + i * kQuadRowBytes);
    const __m512i w1 = _mm512_loadu_si512(block + i * kQuadRowBytes + 64);
    for (int r = 0; r < DigitRows; ++r) {
      int32_t quad;
      std::memcpy(&quad, a + r * k + 4 * i, sizeof quad);
      const __m512i u = _mm512_set1_epi32(quad);
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], u, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], u, w1);
    }
  }
  const __m512i shift0 = _mm512_slli_epi32(_mm512_loadu_si512(column_sums), 7);
  const __m512i shift1 = _mm512_slli_epi32(_mm512_loadu_si512(column_sums + 16), 7);
  for (int r = 0; r < DigitRows; ++r) {
    _mm512_storeu_si512(sums + r * kBlock, _mm512_sub_epi32(acc[r][0], shift0));
    _mm512_storeu_si512(sums + r * kBlock + 16, _mm512_sub_epi32(acc[r][1], shift1));
  }
}
#endif

#if defined(AIOSERVE_INT8_SCREEN)
// One row's BlockBounds over a block's `cols` columns from its digit sums.
inline BlockBounds row_bounds(const int32_t* first, const int32_t* second, int64_t cols, const RowDigits& row,
                              double underflow, const float* scales, const float* slack, const float* norms) {
  const __m512d inverse = _mm512_set1_pd(1.0 / kDigit), x_scale = _mm512_set1_pd(row.scale);
  const __m512d norm = _mm512_set1_pd(row.norm), diff = _mm512_set1_pd(row.diff), under = _mm512_set1_pd(underflow);
  const double lowest = -std::numeric_limits<double>::infinity();
  __m512d low = _mm512_set1_pd(lowest), high = low, magnitude = low;
  for (int64_t c = 0; c < cols; c += 8) {
    const __mmask8 valid = cols - c >= 8 ? 0xff : static_cast<__mmask8>((1u << (cols - c)) - 1);
    const __m512d i1 = _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + c)));
    const __m512d i2 = _mm512_cvtepi32_pd(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + c)));
    const __m512d s = _mm512_cvtps_pd(_mm256_maskz_loadu_ps(valid, scales + c));
    const __m512d a = _mm512_mul_pd(_mm512_fmadd_pd(i2, inverse, i1), _mm512_mul_pd(x_scale, s));
    const __m512d r = _mm512_fmadd_pd(norm, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(valid, slack + c)),
                                      _mm512_fmadd_pd(diff, _mm512_cvtps_pd(_mm256_maskz_loadu_ps(valid, norms + c)),
                                                      under));
    low = _mm512_mask_max_pd(low, valid, low, _mm512_sub_pd(a, r));
    high = _mm512_mask_max_pd(high, valid, high, _mm512_add_pd(a, r));
    magnitude = _mm512_mask_max_pd(magnitude, valid, magnitude, _mm512_add_pd(_mm512_abs_pd(a), r));
  }
  return {_mm512_reduce_max_pd(low), _mm512_reduce_max_pd(high), _mm512_reduce_max_pd(magnitude)};
}
#endif

// Which forms of the screen the library has: 1 the tiles, 2 VNNI.
constexpr int int8_forms_built() {
  int forms = 0;
#if defined(AIOSERVE_INT8_TILES)
  forms |= 1;
#endif
#if defined(AIOSERVE_INT8_VNNI)
  forms |= 2;
#endif
  return forms;
}

}  // namespace

// x [m, k] bf16 contiguous (1 <= m <= 16, k a multiple of 64); screen: the
// head's int8 copy packed [blocks][k / 4][32][4]; scales, slack, norms [n]
// float32 (see above); exact: the head packed by pack_linear_weight (bf16
// k-pairs); column_sums [blocks * 32] int32 (each column's sum of q, 0
// past n: the VNNI form's). Where the bf16 tiles are in use the screen's
// sums are tile products, else VNNI's (1-4 rows). Writes tokens [m] int64
// and ok [m] bool.
void int8_screened_argmax(const BFloat16* x, int64_t m, int64_t k, const int8_t* screen, const float* scales,
                          const float* slack, const float* norms, const int32_t* column_sums, const BFloat16* exact,
                          int64_t n, int64_t max_blocks, int64_t* tokens, bool* ok) {
  AIOSERVE_CHECK(m >= 1 && m <= kMaxRows, "int8_screened_argmax: 1 to ", kMaxRows, " rows, not ", m);
  AIOSERVE_CHECK(k > 0 && k % kStepK == 0 && k < (1 << 17), "int8_screened_argmax: K must be a multiple of 64");
  std::fill(ok, ok + m, false);
#if defined(AIOSERVE_INT8_SCREEN)
  // The tiles where the bf16 head's products run on them (permitted by Linux, not turned off), else VNNI.
  const bool tiles = (int8_forms_built() & 1) != 0 && aioserve::amx_tiles_on();
  AIOSERVE_CHECK(tiles || ((int8_forms_built() & 2) != 0 && m <= kVnniRows),
                 "int8_screened_argmax: without the AMX tiles in use, 1 to ", kVnniRows, " rows on VNNI, not ", m);
  std::vector<int8_t> a(2 * m * k);
  std::vector<RowDigits> rows(m);
  for (int64_t r = 0; r < m; ++r) {
    rows[r] = digits(x + r * k, k, a.data() + 2 * r * k, a.data() + (2 * r + 1) * k);
    if (!rows[r].finite) return;
  }
  const double underflow = 2.0 * static_cast<double>(k) * 0x1p-126;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::vector<BlockBounds> bounds(blocks * m);
  std::vector<uint8_t> shifted(tiles ? 0 : a.size());  // VNNI's unsigned digits: q + 128
  for (size_t i = 0; i < shifted.size(); ++i) shifted[i] = static_cast<uint8_t>(a[i] ^ 0x80);
  aioserve::parallel_pieces(blocks, 1, [&](int64_t first, int64_t last) {
    alignas(64) int32_t sums[2 * kMaxRows * kBlock];
#if defined(AIOSERVE_INT8_TILES)
    if (tiles) configure_int8_tiles(static_cast<int>(2 * m));
#endif
    for (int64_t b = first; b < last; ++b) {
      const int8_t* block = screen + b * k * kBlock;
      const int8_t* next = b + 1 < last ? block + k * kBlock : nullptr;
      if (tiles) {
#if defined(AIOSERVE_INT8_TILES)
        if (m > 8) {
          block_sums<true>(a.data(), k, block, next, sums);
        } else {
          block_sums<false>(a.data(), k, block, next, sums);
        }
#endif
      } else {
#if defined(AIOSERVE_INT8_VNNI)
        const int32_t* block_sums_of_q = column_sums + b * kBlock;
        switch (m) {
          case 1: block_sums_vnni<2>(shifted.data(), k, block, next, block_sums_of_q, sums); break;
          case 2: block_sums_vnni<4>(shifted.data(), k, block, next, block_sums_of_q, sums); break;
          case 3: block_sums_vnni<6>(shifted.data(), k, block, next, block_sums_of_q, sums); break;
          default: block_sums_vnni<8>(shifted.data(), k, block, next, block_sums_of_q, sums); break;
        }
#endif
      }
      const int64_t col0 = b * kBlock, cols = std::min(kBlock, n - col0);
      for (int64_t r = 0; r < m; ++r) {
        bounds[b * m + r] = row_bounds(sums + 2 * r * kBlock, sums + (2 * r + 1) * kBlock, cols, rows[r], underflow,
                                       scales + col0, slack + col0, norms + col0);
      }
    }
#if defined(AIOSERVE_INT8_TILES)
    if (tiles) _tile_release();
#endif
  });
  // Each row's threshold p (lowered by the margin), then the blocks any row keeps.
  std::vector<double> thresholds(m);
  for (int64_t r = 0; r < m; ++r) {
    double floor = -std::numeric_limits<double>::infinity(), biggest = 0.0;
    for (int64_t b = 0; b < blocks; ++b) {
      floor = std::max(floor, bounds[b * m + r].low);
      biggest = std::max(biggest, bounds[b * m + r].magnitude);
    }
    if (!(biggest < 1e37)) return;  // beyond what the bound's doubles and bf16's range keep exact
    const double margin = biggest * kMargin;
    thresholds[r] = bf16_below(bf16_floor(floor - margin)) - margin;
  }
  std::vector<int64_t> kept;
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t r = 0; r < m; ++r) {
      if (bounds[b * m + r].high >= thresholds[r]) {
        kept.push_back(b);
        break;
      }
    }
  }
  if (kept.empty() || static_cast<int64_t>(kept.size()) > max_blocks) return;
  // The kept blocks as one weight, their columns in order (a partial last block last), read where they lie.
  const int64_t padding = kept.back() == blocks - 1 ? blocks * kBlock - n : 0;
  const int64_t width = static_cast<int64_t>(kept.size()) * kBlock - padding;
  std::vector<float> maxes(m);
  std::vector<int64_t> columns(m);
  aioserve::packed_linear_argmax(x, aioserve::kBFloat16, m, k, exact, aioserve::kBFloat16, true, width, nullptr,
                                 maxes.data(), columns.data(), kept.data());
  for (int64_t r = 0; r < m; ++r) {
    if (!std::isfinite(maxes[r])) continue;
    tokens[r] = kept[columns[r] / kBlock] * kBlock + columns[r] % kBlock;
    ok[r] = true;
  }
#else
  (void)x, (void)screen, (void)scales, (void)slack, (void)norms, (void)column_sums, (void)exact, (void)n,
      (void)max_blocks, (void)tokens;
  aioserve::fail("int8_screened_argmax: built without AMX-INT8 tiles or AVX512-VNNI");
#endif
}

// The int8 copy of a bf16 head packed in k-pairs ([blocks][k / 2][32][2]):
// screen [blocks][k / 4][32][4] (zero past column n), and per column [n]
// its scale s_j (float32: q_j = round(w_j / s_j), |q| <= 127), slack_j and
// norms_j (see above), rounded up, and [blocks * 32] each column's sum of q
// (0 past n). Weights below bf16's normal range count as zero, as the
// tiles read them. False: a weight is not finite.
bool int8_quantize_head(const BFloat16* exact, int64_t n, int64_t k, int8_t* screen, float* scales, float* slack,
                        float* norms, int32_t* column_sums) {
  AIOSERVE_CHECK(k > 0 && k % kStepK == 0 && k < (1 << 17), "int8_quantize_head: K must be a multiple of 64");
  const double gamma = k * 0x1p-23 / (1 - k * 0x1p-23);
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::atomic<bool> finite{true};
  const auto rounded_up = [](double v) {
    return std::nextafter(static_cast<float>(v * (1 + 0x1p-20)), std::numeric_limits<float>::infinity());
  };
  aioserve::parallel_pieces(blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<double> w(k);
    for (int64_t b = first; b < last; ++b) {
      const BFloat16* pairs = exact + b * k * kBlock;
      int8_t* quads = screen + b * k * kBlock;
      for (int64_t c = 0; c < kBlock; ++c) {
        const int64_t j = b * kBlock + c;
        double largest = 0.0;
        for (int64_t i = 0; i < k; ++i) {
          double v = aioserve::to_float(pairs[(i / 2) * 2 * kBlock + 2 * c + i % 2]);
          if (std::fabs(v) < 0x1p-126) v = 0.0;
          w[i] = v;
          largest = std::max(largest, std::fabs(v));  // a NaN is caught below
        }
        const float scale = largest > 0.0 ? static_cast<float>(largest / 127.0) : 1.f;
        double error2 = 0.0, norm2 = 0.0, held2 = 0.0;
        int32_t sum_of_q = 0;  // |sum| <= 127 k < 2^24
        bool column_finite = std::isfinite(largest);
        for (int64_t i = 0; i < k; ++i) {
          const double q = j < n ? std::clamp(std::nearbyint(w[i] / scale), -127.0, 127.0) : 0.0;
          column_finite &= std::isfinite(w[i]);
          quads[(i / 4) * 4 * kBlock + 4 * c + i % 4] = static_cast<int8_t>(q);
          sum_of_q += static_cast<int32_t>(q);
          const double held = q * scale;  // exact: 8 bits times 24
          error2 += (w[i] - held) * (w[i] - held);
          norm2 += w[i] * w[i];
          held2 += held * held;
        }
        column_sums[j] = sum_of_q;  // 0 past n (all q 0 there)
        if (j >= n) continue;
        if (!column_finite) finite.store(false, std::memory_order_relaxed);
        scales[j] = scale;
        slack[j] = rounded_up(std::sqrt(error2) + gamma * std::sqrt(norm2));
        norms[j] = rounded_up(std::sqrt(held2));
      }
    }
  });
  return finite.load();
}

static int int8_quantize_head_direct(const void* exact, int64_t n, int64_t k, void* screen, float* scales,
                                     float* slack, float* norms, int32_t* column_sums, bool* finite) {
  return aioserve::guarded([&] {
    *finite = int8_quantize_head(static_cast<const BFloat16*>(exact), n, k, static_cast<int8_t*>(screen), scales,
                                 slack, norms, column_sums);
  });
}

static int int8_screened_argmax_direct(const void* x, int64_t m, int64_t k, const void* screen, const float* scales,
                                       const float* slack, const float* norms, const int32_t* column_sums,
                                       const void* exact, int64_t n, int64_t max_blocks, int64_t* tokens, bool* ok) {
  return aioserve::guarded([&] {
    int8_screened_argmax(static_cast<const BFloat16*>(x), m, k, static_cast<const int8_t*>(screen), scales, slack,
                         norms, column_sums, static_cast<const BFloat16*>(exact), n, max_blocks, tokens, ok);
  });
}

extern "C" {

// The forms of the int8 screen the library has: 1 AMX-INT8 tiles (Linux), 2 AVX512-VNNI.
int aioserve_int8_head_screen_built() { return int8_forms_built(); }

int aioserve_int8_quantize_head(const void* record) { return aioserve::call_packed(int8_quantize_head_direct, record); }

int aioserve_int8_screened_argmax(const void* record) {
  return aioserve::call_packed(int8_screened_argmax_direct, record);
}

}  // extern "C"
