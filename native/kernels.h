// The kernels' tensor-level entry points, for the files that call one
// another's kernels (decoder.cpp runs a whole decode step through them).
// Each is bound to Python by the file that defines it.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

namespace aioserve {

// elementwise.cpp
torch::Tensor rms_norm(torch::Tensor x, std::optional<torch::Tensor> residual, torch::Tensor weight, double eps);
void rotary_embedding(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos_cache,
                      torch::Tensor sin_cache);
void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor key_cache, torch::Tensor value_cache, torch::Tensor slots);
torch::Tensor silu_and_mul(torch::Tensor x);
std::tuple<torch::Tensor, torch::Tensor> row_max_argmax(torch::Tensor logits);

// gemm.cpp
bool gemm_fuses_multiply_add();  // each k's multiply-add is one fused rounding (not the portable fallback)
torch::Tensor packed_linear(torch::Tensor x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias,
                            int64_t n, bool float_out, const c10::optional<torch::Tensor>& out = c10::nullopt);

// x W^T as the float32 sums themselves, for bf16 x and a bf16 W packed in
// k-pairs (AVX512-BF16 only): not rounded to bf16 as packed_linear's are.
torch::Tensor packed_linear_unrounded(const torch::Tensor& x, const torch::Tensor& packed, int64_t n);

// attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor page_table, torch::Tensor seq_lens, int64_t page_size,
                                     double scale, int64_t window);

}  // namespace aioserve
