// screened_argmax: greedy decoding's argmax of x W^T for a float32 W, read
// at half width, with the answer packed_linear + argmax would give.
//
// Why: a single-stream decode step of a float32 checkpoint spends as long in
// the LM head as in all of its layers (tiny-llama: 37 MB of [32000, 288]
// weights a token), and greedy decoding only needs the argmax of the logits.
// So the logits are first computed from a float16 copy of W (half the bytes;
// the step went 1.7 -> 1.2 ms on a 2-core EPYC), and only the columns that
// could still be the exact argmax are computed again from W itself.
//
// Why that is exact. For row x and column j, let A_j be the screened logit
// (float32 sum of x_i * fp16(w_ij)) and E_j the one packed_linear computes
// (float32 sum of x_i * w_ij, one fused multiply-add per k in increasing
// order: see gemm.cpp). With e_j = w_j - fp16(w_j), Cauchy-Schwarz and the
// error bound of a k-term float32 dot product (gamma_k, k * 2^-24 / (1 - k *
// 2^-24), times the sum of |x_i w_ij|):
//   |E_j - A_j| <= ||x|| * (||e_j|| + gamma_k (||w_j|| + ||fp16(w_j)||)) + underflow
// The caller precomputes the bracket per column (`slack`, rounded up), so
// r_j = ||x|| slack_j bounds the difference (float32 arithmetic here, with
// its own rounding accounted for: see choose()). Let L = max_j (A_j - r_j),
// reached at column m: E_m >= L. Any column with A_j + r_j < L has E_j < L
// <= E_m, so it cannot be the argmax (not even on a tie). The others, the
// candidates (usually one or two), get E_j computed exactly as packed_linear
// does, and the first of the largest wins, as in row_max_argmax. A row that
// is not finite, or has too many candidates, is left to the caller (`ok`
// false): it computes the full logits instead.
//
// The bfloat16 screen (CPUs with AVX512-BF16). Where the head's batch is
// big enough for its float32 multiply-adds to bound the step (tiny-llama at
// 16 rows: 2.0-2.5 ms a step, float16 or not), the screen can instead be a
// bf16 copy w~ dotted with x~ = bf16(x) by the dot-product instruction, two
// products per multiply-add. Both copies have their subnormals flushed to
// zero here, so the instruction's own flushing of inputs changes nothing;
// its products of two bf16 values are exact in float32 unless they fall
// below its normal range (flushed), and each of its K additions rounds.
// With A_j now that sum:
//   |E_j - A_j| <= |E_j - x.w_j| + |x.(w_j - w~_j)| + |(x - x~).w~_j| + |x~.w~_j - A_j|
//              <= ||x|| (||w_j - w~_j|| + gamma_k ||w_j||)                  [slack_j]
//               + (||x - x~|| + gamma'_k ||x~||) ||w~_j||                  [x_slack, screen_norms_j]
//               + underflow (2 k 2^-126: every flushed product and sum)
// with gamma' taking a unit roundoff of 2^-23, not 2^-24: the bound holds
// for any rounding of those additions, not only to nearest.

#include "half.h"
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <limits>
#include <memory>
#include <vector>

namespace {

using aioserve::BFloat16;

// Past this many candidates the bound is too loose to save anything.
constexpr size_t kMaxCandidates = 64;

// Column j of a float32 weight packed [blocks][k][block], multiplied by x as
// gemm.cpp's tile does for it: acc = fma(x_i, w_ij, acc), i = 0 .. k-1.
inline float exact_logit(const float* x, int64_t k, const float* packed, int64_t block, int64_t j) {
  const float* column = packed + (j / block) * k * block + j % block;
  float acc = 0.f;
  for (int64_t i = 0; i < k; ++i) acc = std::fma(x[i], column[i * block], acc);
  return acc;
}

struct RowChoice {
  int64_t token = 0;
  bool ok = false;
};

// Scan blocks: a vectorized "any candidate here?" per block, then the rare
// block with one is scanned element by element.
constexpr int64_t kScanBlock = 64;

// At least the bound's absolute part, 2 k 2^-149 (products and sums below
// float's normal range lose up to half a subnormal step each, in either
// sum), for any k below 2^20.
constexpr float kUnderflow = 1e-37f;

// The bound r_j = norm slack_j + x_slack screen_norms_j + underflow, as
// float32 arithmetic (the second term only for the bf16 screen).
struct Bound {
  float norm;                          // ||x||, rounded up
  const float* slack;                  // [N]
  float x_slack = 0.f;                 // ||x - x~|| + gamma' ||x~||, rounded up (bf16 screen)
  const float* screen_norms = nullptr;  // [N] ||w~_j||, rounded up (bf16 screen)
  float underflow = kUnderflow;

  // kScreenNorms: whether screen_norms is there, decided once outside the
  // scans rather than tested at every column.
  template <bool kScreenNorms>
  inline float at(int64_t j) const {
    const float r = norm * slack[j] + underflow;
    if constexpr (kScreenNorms) {
      return r + x_slack * screen_norms[j];
    } else {
      return r;
    }
  }

#if defined(__AVX512F__)
  // r_j .. r_j+15: at()'s operations, fused as the compiler fuses at()'s.
  template <bool kScreenNorms>
  inline __m512 at16(int64_t j) const {
    const __m512 r = _mm512_fmadd_ps(_mm512_set1_ps(norm), _mm512_loadu_ps(slack + j), _mm512_set1_ps(underflow));
    if constexpr (kScreenNorms) {
      return _mm512_fmadd_ps(_mm512_set1_ps(x_slack), _mm512_loadu_ps(screen_norms + j), r);
    } else {
      return r;
    }
  }
#endif
};

// Pass 1 over [0, n): L (the largest A_j - r_j), the largest |A_j| + r_j,
// and whether some A_j is not finite. GCC leaves this loop scalar even
// under `omp simd` (its float max reductions), which made the scans a
// fifth of a 16-row screen; with AVX-512 it runs 16 columns at a time.
// Each r_j is the same float either way: at()'s operations, fused alike.
struct Extremes {
  float floor = -std::numeric_limits<float>::infinity(), biggest = 0.f;
  bool not_finite = false;
};

template <bool kScreenNorms>
Extremes extremes(const float* approx, const Bound& bound, int64_t n) {
  Extremes out;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 largest = _mm512_set1_ps(std::numeric_limits<float>::max());
  __m512 floor = _mm512_set1_ps(out.floor), biggest = _mm512_setzero_ps();
  __mmask16 bad = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 a = _mm512_loadu_ps(approx + j), r = bound.at16<kScreenNorms>(j);
    const __m512 magnitude = _mm512_abs_ps(a);
    bad |= _mm512_cmp_ps_mask(magnitude, largest, _CMP_NLE_UQ);  // > max, or NaN
    floor = _mm512_max_ps(floor, _mm512_sub_ps(a, r));
    biggest = _mm512_max_ps(biggest, _mm512_add_ps(magnitude, r));
  }
  out.floor = _mm512_reduce_max_ps(floor);
  out.biggest = _mm512_reduce_max_ps(biggest);
  out.not_finite = bad != 0;
#endif
  for (; j < n; ++j) {
    const float a = approx[j], r = bound.at<kScreenNorms>(j);
    out.not_finite |= !(std::fabs(a) <= std::numeric_limits<float>::max());
    out.floor = std::max(out.floor, a - r);
    out.biggest = std::max(out.biggest, std::fabs(a) + r);
  }
  return out;
}

// Whether some column of [start, end) has A_j + r_j >= lowered.
template <bool kScreenNorms>
bool any_candidate(const float* approx, const Bound& bound, int64_t start, int64_t end, float lowered) {
  int64_t j = start;
#if defined(__AVX512F__)
  const __m512 low = _mm512_set1_ps(lowered);
  __mmask16 hit = 0;
  for (; j + 16 <= end; j += 16)
    hit |= _mm512_cmp_ps_mask(_mm512_add_ps(_mm512_loadu_ps(approx + j), bound.at16<kScreenNorms>(j)), low, _CMP_GE_OQ);
  if (hit) return true;
#endif
  for (; j < end; ++j)
    if (approx[j] + bound.at<kScreenNorms>(j) >= lowered) return true;
  return false;
}

// x's norm as a float no smaller than it.
inline float norm_up(const float* x, int64_t k) {
  double norm2 = 0.0;
  for (int64_t i = 0; i < k; ++i) norm2 += static_cast<double>(x[i]) * x[i];
  return std::nextafter(static_cast<float>(std::sqrt(norm2)), std::numeric_limits<float>::infinity());
}

template <bool kScreenNorms>
RowChoice choose(const float* x, int64_t k, const float* approx, const Bound& bound, int64_t n, const float* exact,
                 int64_t block, std::vector<int64_t>& candidates) {
  if (!std::isfinite(bound.norm) || !std::isfinite(bound.x_slack)) return {};
  // Pass 1: L (`floor`), the largest |A_j| + r_j, and whether every
  // screened logit is finite (no bound holds otherwise).
  const Extremes pass = extremes<kScreenNorms>(approx, bound, n);
  const float floor = pass.floor, biggest = pass.biggest;
  if (pass.not_finite || !std::isfinite(biggest)) return {};
  // Each A_j -/+ r_j above is off by at most 2^-21 (|A_j| + r_j) from its
  // exact value (at most five float roundings); lowering L by more than that
  // keeps every true candidate (it only adds, harmlessly, near-candidates).
  const float lowered = floor - std::ldexp(biggest, -18);
  candidates.clear();
  for (int64_t start = 0; start < n; start += kScanBlock) {
    const int64_t end = std::min(n, start + kScanBlock);
    if (!any_candidate<kScreenNorms>(approx, bound, start, end, lowered)) continue;
    for (int64_t j = start; j < end; ++j) {
      if (approx[j] + bound.at<kScreenNorms>(j) >= lowered) {
        if (candidates.size() == kMaxCandidates) return {};
        candidates.push_back(j);
      }
    }
  }
  RowChoice best;
  float best_value = 0.f;
  for (const int64_t j : candidates) {  // in increasing j: the first of equal maxima wins
    const float value = exact_logit(x, k, exact, block, j);
    if (!std::isfinite(value)) return {};
    if (!best.ok || value > best_value) {
      best = {j, true};
      best_value = value;
    }
  }
  return best;
}

// The bf16 screen's unit roundoff (see above).
constexpr double kScreenRoundoff = 0x1p-23;
constexpr float kBf16Underflow = 1e-31f;  // >= 2 k 2^-126 for any k below 2^20

// x~ = bf16(x), subnormals flushed to zero, and ||x - x~|| + gamma'_k ||x~||
// rounded up (+inf when x is not finite).
float to_screen_bf16(const float* x, int64_t k, BFloat16* out) {
  double diff2 = 0.0, norm2 = 0.0;
  for (int64_t i = 0; i < k; ++i) {
    float v = aioserve::round_to<BFloat16>(x[i]);
    if (std::fabs(v) < 0x1p-126f) v = 0.f;  // flushed here, as the instruction would
    out[i] = aioserve::from_float<BFloat16>(v);
    diff2 += (static_cast<double>(x[i]) - v) * (static_cast<double>(x[i]) - v);
    norm2 += static_cast<double>(v) * v;
  }
  const double gamma = k * kScreenRoundoff / (1 - k * kScreenRoundoff);
  const double slack = (std::sqrt(diff2) + gamma * std::sqrt(norm2)) * (1 + 0x1p-20);
  return std::isfinite(slack) ? std::nextafter(static_cast<float>(slack), std::numeric_limits<float>::infinity())
                              : std::numeric_limits<float>::infinity();
}

}  // namespace

// x [M, K] float32, contiguous; `exact` W packed in float32 [blocks, K,
// block] (by pack_linear_weight); slack [N] float32 (rounded up). The
// screen: W in float16 packed like `exact` (screen_type its dtype), or in
// bf16 packed in k-pairs ([blocks, K / 2, block, 2], AVX512-BF16) with
// screen_norms [N] (||w~_j||, rounded up). Writes tokens [M] int64 and ok
// [M] bool (both zeroed by the caller); a row with ok false keeps token 0.
// The tensors' shapes are checked by the caller (aioserve/cpu/native_gemm.py).
void screened_argmax(const float* xs, int64_t m, int64_t k, const void* screen, int screen_type, bool bf16,
                     const float* ss, const float* ws, int64_t n, int64_t block, const float* ns, int64_t* ts,
                     bool* oks) {
  AIOSERVE_CHECK(aioserve::gemm_fuses_multiply_add(), "screened_argmax: packed_linear's sums are not fused here");
  std::vector<float> x_slacks(m, 0.f);
  // Every element is written by the matmul: left uninitialized, as torch::empty was.
  const std::unique_ptr<float[]> approx(new float[std::max<int64_t>(1, m * n)]);
  if (bf16) {
    const std::unique_ptr<BFloat16[]> rounded(new BFloat16[std::max<int64_t>(1, m * k)]);
    for (int64_t r = 0; r < m; ++r) x_slacks[r] = to_screen_bf16(xs + r * k, k, rounded.get() + r * k);
    aioserve::packed_linear_unrounded(rounded.get(), m, k, static_cast<const BFloat16*>(screen), n, approx.get());
  } else {
    aioserve::packed_linear(xs, aioserve::kFloat32, m, k, screen, screen_type, false, n, nullptr, approx.get(), true);
  }
  const float* as = approx.get();
  aioserve::parallel_pieces(m, 1, [&](int64_t first, int64_t last) {
    std::vector<int64_t> candidates;
    candidates.reserve(kMaxCandidates);
    for (int64_t r = first; r < last; ++r) {
      Bound bound{norm_up(xs + r * k, k), ss};
      if (bf16) {
        bound.x_slack = x_slacks[r];
        bound.screen_norms = ns;
        bound.underflow = kBf16Underflow;
      }
      const RowChoice row = bf16 ? choose<true>(xs + r * k, k, as + r * n, bound, n, ws, block, candidates)
                                 : choose<false>(xs + r * k, k, as + r * n, bound, n, ws, block, candidates);
      ts[r] = row.token;
      oks[r] = row.ok;
    }
  });
}

static int screened_argmax_direct(const float* x, int64_t m, int64_t k, const void* screen, int screen_type,
                                        int bf16, const float* slack, const float* exact, int64_t n, int64_t block,
                                        const float* screen_norms, int64_t* tokens, bool* ok) {
  return aioserve::guarded([&] {
    screened_argmax(x, m, k, screen, screen_type, bf16 != 0, slack, exact, n, block, screen_norms, tokens, ok);
  });
}

extern "C" {

int aioserve_screened_argmax(const void* record) { return aioserve::call_packed(screened_argmax_direct, record); }

}  // extern "C"
