// DecoderStack: a Llama-family decode step (Llama, Mistral, Qwen2, Qwen3),
// from the embedded tokens to the final norm, as one call.
//
// Why: a small model's CPU decode step is bound by the Python around its
// kernels, not by the kernels. tiny-llama (6 layers) at batch 1 spent 2.1 ms
// of a 3.4 ms step in its matmuls and most of the rest dispatching about 70
// small calls through nn.Modules, views and pybind. This runs the same
// kernels, in the same order, on the same tensors, so its output is bit for
// bit the Python forward's (tests/test_native_decoder.py checks that); it is
// the CPU's counterpart of a CUDA graph, and like one it only serves
// decode-only steps. The LM head and sampling stay in Python.
//
// The weights are the model's own tensors (shared storage, never copied),
// packed by pack_linear_weight; the KV caches are views into the pool.
// forward releases the GIL (see module.cpp): the event loop plans the next
// step while this one runs.

#include <torch/extension.h>

#include "kernels.h"

#include <optional>
#include <vector>

namespace aioserve {
namespace {

struct Layer {
  torch::Tensor input_norm, qkv, o, post_norm, gate_up, down;
  std::optional<torch::Tensor> qkv_bias, q_norm, k_norm;  // Qwen2's bias; Qwen3's per-head norms
  torch::Tensor key_cache, value_cache;                   // [slots, Hk, D] views of the pool
  int64_t intermediate;
  int64_t window;  // sliding window, 0 for none
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale,
               torch::Tensor cos_cache, torch::Tensor sin_cache, int64_t page_size, torch::Tensor final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale),
        cos_(std::move(cos_cache)), sin_(std::move(sin_cache)), page_size_(page_size),
        final_norm_(std::move(final_norm)) {
    TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                "DecoderStack: bad head counts");
  }

  void add_layer(torch::Tensor input_norm, torch::Tensor qkv, std::optional<torch::Tensor> qkv_bias,
                 std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm, torch::Tensor o,
                 torch::Tensor post_norm, torch::Tensor gate_up, int64_t intermediate, torch::Tensor down,
                 torch::Tensor key_cache, torch::Tensor value_cache, int64_t window) {
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "DecoderStack: q and k norms come together");
    layers_.push_back(Layer{std::move(input_norm), std::move(qkv), std::move(o), std::move(post_norm),
                            std::move(gate_up), std::move(down), std::move(qkv_bias), std::move(q_norm),
                            std::move(k_norm), std::move(key_cache), std::move(value_cache), intermediate, window});
  }

  // hidden [B, H]: the embedded tokens (updated in place as the residual
  // stream). positions, slots [B] int64; page_table [B, P] int32 and
  // seq_lens [B] int64 (each includes its new token). Returns the final
  // norm of the last layer's output, [B, H].
  torch::Tensor forward(torch::Tensor hidden, torch::Tensor positions, torch::Tensor slots, torch::Tensor page_table,
                        torch::Tensor seq_lens) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == final_norm_.size(0) && hidden.is_contiguous(),
                "DecoderStack: hidden must be contiguous [B, hidden]");
    const int64_t batch = hidden.size(0), size = hidden.size(1);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const c10::optional<torch::Tensor> none;
    torch::Tensor residual = hidden, x;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      // The residual add is fused into the next norm: norm(x + residual), with
      // x + residual written into `residual`.
      x = i == 0 ? rms_norm(hidden, std::nullopt, l.input_norm, eps_) : rms_norm(x, residual, l.input_norm, eps_);
      const torch::Tensor qkv = packed_linear(x, l.qkv, l.qkv_bias, q_size + 2 * kv_size, false);
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({batch, num_heads_, head_dim_});
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({batch, num_kv_heads_, head_dim_});
      const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({batch, num_kv_heads_, head_dim_});
      if (l.q_norm.has_value()) {
        q = rms_norm(q, std::nullopt, *l.q_norm, eps_);
        k = rms_norm(k, std::nullopt, *l.k_norm, eps_);
      }
      rotary_embedding(positions, q, k, cos_, sin_);
      store_kv(k, v, l.key_cache, l.value_cache, slots);
      const torch::Tensor attended = paged_decode_attention(q, l.key_cache, l.value_cache, page_table, seq_lens,
                                                            page_size_, scale_, l.window);
      x = packed_linear(attended.view({batch, q_size}), l.o, none, size, false);
      x = rms_norm(x, residual, l.post_norm, eps_);
      x = packed_linear(silu_and_mul(packed_linear(x, l.gate_up, none, 2 * l.intermediate, false)), l.down, none,
                        size, false);
    }
    return rms_norm(x, residual, final_norm_, eps_);
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_, scale_;
  torch::Tensor cos_, sin_;
  int64_t page_size_;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace
}  // namespace aioserve

void bind_decoder(pybind11::module_& m) {
  using aioserve::DecoderStack;
  pybind11::class_<DecoderStack>(m, "DecoderStack", "a Llama-family decode step, embedded tokens to final norm")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, double, torch::Tensor, torch::Tensor, int64_t,
                          torch::Tensor>(),
           pybind11::arg("num_heads"), pybind11::arg("num_kv_heads"), pybind11::arg("head_dim"), pybind11::arg("eps"),
           pybind11::arg("scale"), pybind11::arg("cos_cache"), pybind11::arg("sin_cache"), pybind11::arg("page_size"),
           pybind11::arg("final_norm"))
      .def("add_layer", &DecoderStack::add_layer, pybind11::arg("input_norm"), pybind11::arg("qkv"),
           pybind11::arg("qkv_bias"), pybind11::arg("q_norm"), pybind11::arg("k_norm"), pybind11::arg("o"),
           pybind11::arg("post_norm"), pybind11::arg("gate_up"), pybind11::arg("intermediate"), pybind11::arg("down"),
           pybind11::arg("key_cache"), pybind11::arg("value_cache"), pybind11::arg("window"))
      .def("forward", &DecoderStack::forward, pybind11::arg("hidden"), pybind11::arg("positions"),
           pybind11::arg("slots"), pybind11::arg("page_table"), pybind11::arg("seq_lens"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
