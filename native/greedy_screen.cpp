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

#include <torch/extension.h>

#include "kernels.h"
#include "parallel.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

namespace {

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

RowChoice choose(const float* x, int64_t k, const float* approx, const float* slack, int64_t n, const float* exact,
                 int64_t block, std::vector<int64_t>& candidates) {
  double norm2 = 0.0;
  for (int64_t i = 0; i < k; ++i) norm2 += static_cast<double>(x[i]) * x[i];
  const float norm = std::nextafter(static_cast<float>(std::sqrt(norm2)), std::numeric_limits<float>::infinity());
  if (!std::isfinite(norm)) return {};
  // Pass 1, in float32 and vectorized: L (`floor`), the largest |A_j| + r_j,
  // and whether every screened logit is finite (no bound holds otherwise).
  float floor = -std::numeric_limits<float>::infinity(), biggest = 0.f;
  int not_finite = 0;
#pragma omp simd reduction(max : floor, biggest) reduction(| : not_finite)
  for (int64_t j = 0; j < n; ++j) {
    const float a = approx[j], r = norm * slack[j] + kUnderflow;
    not_finite |= !(std::fabs(a) <= std::numeric_limits<float>::max());
    floor = std::max(floor, a - r);
    biggest = std::max(biggest, std::fabs(a) + r);
  }
  if (not_finite || !std::isfinite(biggest)) return {};
  // Each A_j -/+ r_j above is off by at most 2^-22 (|A_j| + r_j) from its
  // exact value (three float roundings); lowering L by more than that keeps
  // every true candidate (it only adds, harmlessly, near-candidates).
  const float lowered = floor - std::ldexp(biggest, -18);
  candidates.clear();
  for (int64_t start = 0; start < n; start += kScanBlock) {
    const int64_t end = std::min(n, start + kScanBlock);
    int hit = 0;
#pragma omp simd reduction(| : hit)
    for (int64_t j = start; j < end; ++j) hit |= approx[j] + (norm * slack[j] + kUnderflow) >= lowered;
    if (!hit) continue;
    for (int64_t j = start; j < end; ++j) {
      if (approx[j] + (norm * slack[j] + kUnderflow) >= lowered) {
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

}  // namespace

// x [M, K] float32; `screen` W packed at half width, `exact` W packed in
// float32 (both by pack_linear_weight, [blocks, K, block]); slack [N] float32
// (rounded up).
// Returns (tokens [M] int64, ok [M] bool); a row with ok false has token 0.
std::tuple<torch::Tensor, torch::Tensor> screened_argmax(torch::Tensor x, const torch::Tensor& screen,
                                                        torch::Tensor slack, const torch::Tensor& exact, int64_t n) {
  TORCH_CHECK(aioserve::gemm_fuses_multiply_add(), "screened_argmax: packed_linear's sums are not fused here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "screened_argmax: x must be float32 [M, K]");
  TORCH_CHECK(exact.dim() == 3 && exact.scalar_type() == torch::kFloat32 && exact.is_contiguous(),
              "screened_argmax: the exact weight must be float32, packed by pack_linear_weight");
  TORCH_CHECK(screen.dim() == 3 && screen.sizes() == exact.sizes(), "screened_argmax: the screen must be packed like W");
  TORCH_CHECK(slack.dim() == 1 && slack.numel() == n && slack.scalar_type() == torch::kFloat32,
              "screened_argmax: slack must be float32 [N]");
  x = x.contiguous();
  slack = slack.contiguous();
  const int64_t m = x.size(0), k = x.size(1), block = exact.size(2);
  TORCH_CHECK(exact.size(1) == k, "screened_argmax: x has ", k, " features, the weight ", exact.size(1));
  const torch::Tensor approx = aioserve::packed_linear(x, screen, c10::nullopt, n, true);
  auto tokens = torch::zeros({m}, x.options().dtype(torch::kInt64));
  auto ok = torch::zeros({m}, x.options().dtype(torch::kBool));
  const float *xs = x.data_ptr<float>(), *as = approx.data_ptr<float>(), *ws = exact.data_ptr<float>();
  const float* ss = slack.data_ptr<float>();
  int64_t* ts = tokens.data_ptr<int64_t>();
  bool* oks = ok.data_ptr<bool>();
  aioserve::parallel_pieces(m, 1, [&](int64_t first, int64_t last) {
    std::vector<int64_t> candidates;
    candidates.reserve(kMaxCandidates);
    for (int64_t r = first; r < last; ++r) {
      const RowChoice row = choose(xs + r * k, k, as + r * n, ss, n, ws, block, candidates);
      ts[r] = row.token;
      oks[r] = row.ok;
    }
  });
  return {tokens, ok};
}

void bind_greedy_screen(pybind11::module_& m) {
  m.def("screened_argmax", &screened_argmax,
        "greedy argmax of x W^T from a half-width copy of W, exactly (see native/greedy_screen.cpp)");
}
