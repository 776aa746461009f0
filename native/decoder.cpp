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
// packed by pack_linear_weight; the KV caches are views into the pool. This
// file sees only their data pointers: aioserve/cpu/native_decoder.py checks
// the tensors and keeps them alive. Each op's output is a fresh 64-byte
// aligned buffer in the dtype torch's promotion gives, as the tensors that
// the Python forward allocates. forward releases the GIL (see module.cpp):
// the event loop plans the next step while this one runs.
//
// LoRA adapters (aioserve/layers/lora.py): a projection may carry its
// adapters' slots, each slot's A [band, in] and B^T [out, band] packed on
// their own. Given each row's slot, the step adds each row's update after
// the projection's matmul: for every slot the step uses (and only those:
// a decode step is bound by the weights it reads), x A_s^T for all rows,
// the other rows zeroed, times B_s, added to the rows of that slot in the
// projection's output type.

#include "half.h"
#include "kernels.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

namespace aioserve {
namespace {

// A packed weight (pack_linear_weight's output).
struct Packed {
  const void* data;
  int type;
  bool pairs;
};

enum Projection { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };

struct Layer {
  const void* input_norm;
  int input_norm_type;
  Packed qkv, o, gate_up, down;
  const float* qkv_bias;                  // float32 [q + 2 kv], or null (Qwen2's bias)
  const void *q_norm, *k_norm;            // Qwen3's per-head norms, or null
  int q_norm_type, k_norm_type;
  const void* post_norm;
  int post_norm_type;
  void *key_cache, *value_cache;          // contiguous [limit, Hk, D] views of the pool
  int cache_type;
  int64_t cache_limit;
  int64_t intermediate;
  int64_t window;  // sliding window, 0 for none
  LoraSlots lora[4] = {};  // by Projection; a null: no adapters
};

// rms_norm's output type: x's when the weight has it, else float32 (torch's promotion).
int norm_type(int x, int w) { return x == w ? x : kFloat32; }

Rows contiguous_rows(int64_t count, int64_t dim) { return {count, 1, dim, 0}; }

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden, double eps, double scale,
               const float* cos, const float* sin, int64_t max_positions, int64_t page_size, const void* final_norm,
               int final_norm_type)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), hidden_(hidden), eps_(eps),
        scale_(scale), cos_(cos), sin_(sin), max_positions_(max_positions), page_size_(page_size),
        final_norm_(final_norm), final_norm_type_(final_norm_type) {
    AIOSERVE_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0,
                   "DecoderStack: bad head counts");
  }

  void set_lora(int64_t layer, int64_t projection, const LoraSlots& lora) {
    AIOSERVE_CHECK(layer >= 0 && layer < static_cast<int64_t>(layers_.size()) && projection >= 0 && projection < 4,
                   "DecoderStack: no such layer or projection");
    layers_[layer].lora[projection] = lora;
  }

  void add_layer(const Layer& layer) {
    AIOSERVE_CHECK((layer.q_norm == nullptr) == (layer.k_norm == nullptr), "DecoderStack: q and k norms come together");
    layers_.push_back(layer);
  }

  // hidden [B, H] contiguous, of hidden_type: the embedded tokens (updated in
  // place as the residual stream). positions, slots [B] int64; page_table
  // [B, P] int32 and seq_lens [B] int64 (each includes its new token).
  // Writes the final norm of the last layer's output into out [B, H].
  // row_slots [B] int64: each row's LoRA slot (null: no adapters this step).
  // aux [B, aux_count * H] of hidden_type (null: none): the residual stream
  // entering each layer aux_layers[j] (0: the embeddings) in its j-th block
  // of H, what an EAGLE-3 head reads (models/decoder_lm.py's capture).
  void forward(void* hidden, int hidden_type, int64_t batch, const int64_t* positions, const int64_t* slots,
               const int32_t* page_table, int64_t pages_per_row, const int64_t* seq_lens, void* out,
               int out_type, const int64_t* row_slots, void* aux, int64_t aux_count, const int64_t* aux_layers) const {
    const int64_t size = hidden_, q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    const int64_t qkv_size = q_size + 2 * kv_size, dim = head_dim_;
    const float eps = static_cast<float>(eps_);
    AIOSERVE_CHECK(out_type == norm_type(hidden_type, final_norm_type_), "DecoderStack: out has the wrong dtype");
    if (batch == 0) return;
    void* residual = hidden;
    const int residual_type = hidden_type;
    Buffer x;
    int x_type = hidden_type;
    // The residual add is fused into the next norm: norm(x + residual), with
    // x + residual written into `residual` (whose dtype must be x's).
    auto norm = [&](const void* w, int w_type, void* dst) {
      AIOSERVE_CHECK(residual_type == x_type, "rms_norm: residual must match x");
      rms_norm(x.get(), contiguous_rows(batch, size), residual, contiguous_rows(batch, size), x_type, w, w_type, dst,
               size, eps);
    };
    // y [B, n] of type `type` += each row's update through its slot of `lora`
    // (x [B, k] of the same type: the projection's input; lora.cpp).
    auto add_lora = [&](const LoraSlots& lora, const void* x, int64_t k, void* y, int type, int64_t n) {
      if (row_slots != nullptr && lora.a != nullptr) lora_add_rows(x, type, batch, k, row_slots, lora, y, n);
    };
    AIOSERVE_CHECK(aux == nullptr || (aux_count > 0 && aux_layers != nullptr), "DecoderStack: aux layers missing");
    for (int64_t j = 0; aux != nullptr && j < aux_count; ++j)
      AIOSERVE_CHECK(aux_layers[j] >= 0 && aux_layers[j] < static_cast<int64_t>(layers_.size()),
                     "DecoderStack: an aux layer the stack does not have");
    // The residual stream as it enters layer i, into each aux block that names it.
    auto capture = [&](size_t i) {
      const int64_t bytes = element_size(hidden_type) * size;
      for (int64_t j = 0; aux != nullptr && j < aux_count; ++j) {
        if (aux_layers[j] != static_cast<int64_t>(i)) continue;
        for (int64_t b = 0; b < batch; ++b)
          std::memcpy(static_cast<char*>(aux) + (b * aux_count + j) * bytes,
                      static_cast<const char*>(residual) + b * bytes, bytes);
      }
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& l = layers_[i];
      const int a_type = norm_type(x_type, l.input_norm_type);
      Buffer a = allocate(batch * size, a_type);
      if (i == 0) {
        capture(i);  // the embeddings
        rms_norm(hidden, contiguous_rows(batch, size), nullptr, Rows{0, 1, 0, 0}, hidden_type, l.input_norm,
                 l.input_norm_type, a.get(), size, eps);
      } else {
        norm(l.input_norm, l.input_norm_type, a.get());  // writes x + residual into residual
        capture(i);
      }
      Buffer qkv = allocate(batch * qkv_size, a_type);
      packed_linear(a.get(), a_type, batch, size, l.qkv.data, l.qkv.type, l.qkv.pairs, qkv_size, l.qkv_bias,
                    qkv.get(), false);
      add_lora(l.lora[kQkv], a.get(), size, qkv.get(), a_type, qkv_size);
      const int64_t a_bytes = element_size(a_type);
      // q, k, v: [B, heads, D] views of qkv's rows.
      void* q = qkv.get();
      void* k = qkv.get() + q_size * a_bytes;
      const void* v = qkv.get() + (q_size + kv_size) * a_bytes;
      Rows q_rows{batch * num_heads_, num_heads_, qkv_size, dim}, k_rows{batch * num_kv_heads_, num_kv_heads_, qkv_size, dim};
      const Rows v_rows{batch * num_kv_heads_, num_kv_heads_, qkv_size, dim};
      int q_type = a_type;
      // Attention reads q contiguous (torch's q.contiguous() copied the view).
      Buffer q_dense_buffer, q_normed, k_normed;  // held until attention has read q
      const void* q_dense = q;
      const int q_norm_type = l.q_norm != nullptr ? l.q_norm_type : kNoNorm;
      const int k_norm_type = l.k_norm != nullptr ? l.k_norm_type : kNoNorm;
      if (qk_norm_rope_store_fuses(a_type, l.cache_type, dim, q_norm_type, k_norm_type)) {
        // The norms, RoPE and the KV write in one pass, bit for bit the ops below.
        q_dense_buffer = allocate(batch * q_size, a_type);
        qk_norm_rope_store(positions, q, q_rows, k, k_rows, v, v_rows, a_type, l.q_norm, q_norm_type, l.k_norm,
                           k_norm_type, eps, cos_, sin_, max_positions_, l.key_cache, l.value_cache, l.cache_type,
                           slots, l.cache_limit, batch, dim, q_dense_buffer.get());
        q_dense = q_dense_buffer.get();
      } else {
        int k_type = a_type;
        if (l.q_norm != nullptr) {
          q_type = norm_type(a_type, l.q_norm_type);
          k_type = norm_type(a_type, l.k_norm_type);
          q_normed = allocate(batch * q_size, q_type);
          k_normed = allocate(batch * kv_size, k_type);
          rms_norm(q, q_rows, nullptr, Rows{0, 1, 0, 0}, a_type, l.q_norm, l.q_norm_type, q_normed.get(), dim, eps);
          rms_norm(k, k_rows, nullptr, Rows{0, 1, 0, 0}, a_type, l.k_norm, l.k_norm_type, k_normed.get(), dim, eps);
          q = q_normed.get();
          k = k_normed.get();
          q_rows = {batch * num_heads_, num_heads_, q_size, dim};
          k_rows = {batch * num_kv_heads_, num_kv_heads_, kv_size, dim};
        }
        AIOSERVE_CHECK(q_type == k_type, "rotary_embedding: q and k must share a dtype");
        rotary_embedding(positions, q, q_rows, k, k_rows, q_type, cos_, sin_, max_positions_, batch, dim);
        AIOSERVE_CHECK(k_type == a_type, "store_kv: k, v [T, Hk, D]");
        store_kv(k, k_rows, k_type, l.key_cache, l.cache_type, slots, l.cache_limit, num_kv_heads_, dim);
        store_kv(v, v_rows, a_type, l.value_cache, l.cache_type, slots, l.cache_limit, num_kv_heads_, dim);
        q_dense = q;
        if (l.q_norm == nullptr) {
          q_dense_buffer = allocate(batch * q_size, q_type);
          const int64_t bytes = element_size(q_type);
          for (int64_t r = 0; r < q_rows.count; ++r)
            std::memcpy(q_dense_buffer.get() + r * dim * bytes, static_cast<const char*>(q) + q_rows.offset(r) * bytes,
                        dim * bytes);
          q_dense = q_dense_buffer.get();
        }
      }
      Buffer attended = allocate(batch * q_size, q_type);
      paged_decode_attention(q_dense, q_type, l.key_cache, l.value_cache, l.cache_type, page_table, pages_per_row,
                             seq_lens, batch, num_heads_, num_kv_heads_, dim, page_size_, scale_, l.window,
                             attended.get());
      x = allocate(batch * size, q_type);
      x_type = q_type;
      packed_linear(attended.get(), q_type, batch, q_size, l.o.data, l.o.type, l.o.pairs, size, nullptr, x.get(), false);
      add_lora(l.lora[kO], attended.get(), q_size, x.get(), q_type, size);
      const int p_type = norm_type(x_type, l.post_norm_type);
      Buffer p = allocate(batch * size, p_type);
      norm(l.post_norm, l.post_norm_type, p.get());
      Buffer gate_up = allocate(batch * 2 * l.intermediate, p_type);
      packed_linear(p.get(), p_type, batch, size, l.gate_up.data, l.gate_up.type, l.gate_up.pairs, 2 * l.intermediate,
                    nullptr, gate_up.get(), false);
      add_lora(l.lora[kGateUp], p.get(), size, gate_up.get(), p_type, 2 * l.intermediate);
      Buffer act = allocate(batch * l.intermediate, p_type);
      silu_and_mul(gate_up.get(), act.get(), p_type, batch, l.intermediate);
      x = allocate(batch * size, p_type);
      x_type = p_type;
      packed_linear(act.get(), p_type, batch, l.intermediate, l.down.data, l.down.type, l.down.pairs, size, nullptr,
                    x.get(), false);
      add_lora(l.lora[kDown], act.get(), l.intermediate, x.get(), p_type, size);
    }
    AIOSERVE_CHECK(!layers_.empty(), "DecoderStack: no layers");
    norm(final_norm_, final_norm_type_, out);
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_;
  double eps_, scale_;
  const float *cos_, *sin_;
  int64_t max_positions_, page_size_;
  const void* final_norm_;
  int final_norm_type_;
  std::vector<Layer> layers_;
};

}  // namespace
}  // namespace aioserve

extern "C" {

void* aioserve_decoder_new(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden, double eps,
                           double scale, const float* cos, const float* sin, int64_t max_positions, int64_t page_size,
                           const void* final_norm, int final_norm_type) {
  aioserve::DecoderStack* stack = nullptr;
  aioserve::guarded([&] {
    stack = new aioserve::DecoderStack(num_heads, num_kv_heads, head_dim, hidden, eps, scale, cos, sin, max_positions,
                                       page_size, final_norm, final_norm_type);
  });
  return stack;  // null: see aioserve_last_error
}

void aioserve_decoder_free(void* stack) { delete static_cast<aioserve::DecoderStack*>(stack); }

static int decoder_add_layer_direct(void* stack, const void* input_norm, int input_norm_type, const void* qkv, int qkv_type,
                               int qkv_pairs, const float* qkv_bias, const void* q_norm, int q_norm_type,
                               const void* k_norm, int k_norm_type, const void* o, int o_type, int o_pairs,
                               const void* post_norm, int post_norm_type, const void* gate_up, int gate_up_type,
                               int gate_up_pairs, int64_t intermediate, const void* down, int down_type,
                               int down_pairs, void* key_cache, void* value_cache, int cache_type, int64_t cache_limit,
                               int64_t window) {
  return aioserve::guarded([&] {
    static_cast<aioserve::DecoderStack*>(stack)->add_layer(aioserve::Layer{
        input_norm, input_norm_type, {qkv, qkv_type, qkv_pairs != 0}, {o, o_type, o_pairs != 0},
        {gate_up, gate_up_type, gate_up_pairs != 0}, {down, down_type, down_pairs != 0}, qkv_bias, q_norm, k_norm,
        q_norm_type, k_norm_type, post_norm, post_norm_type, key_cache, value_cache, cache_type, cache_limit,
        intermediate, window});
  });
}

static int decoder_forward_direct(const void* stack, void* hidden, int hidden_type, int64_t batch, const int64_t* positions,
                             const int64_t* slots, const int32_t* page_table, int64_t pages_per_row,
                             const int64_t* seq_lens, void* out, int out_type, const int64_t* row_slots, void* aux,
                             int64_t aux_count, const int64_t* aux_layers) {
  return aioserve::guarded([&] {
    static_cast<const aioserve::DecoderStack*>(stack)->forward(hidden, hidden_type, batch, positions, slots,
                                                               page_table, pages_per_row, seq_lens, out, out_type,
                                                               row_slots, aux, aux_count, aux_layers);
  });
}

static int decoder_set_lora_direct(void* stack, int64_t layer, int64_t projection, const int64_t* a, int a_type,
                                   const int64_t* b, int b_type, int64_t slots, int64_t band,
                                   int64_t parts, const int64_t* columns) {
  return aioserve::guarded([&] {
    static_cast<aioserve::DecoderStack*>(stack)->set_lora(
        layer, projection, aioserve::lora_slots(a, a_type, b, b_type, slots, band, parts, columns));
  });
}

}  // extern "C"

extern "C" {

int aioserve_decoder_add_layer(const void* record) { return aioserve::call_packed(decoder_add_layer_direct, record); }
int aioserve_decoder_forward(const void* record) { return aioserve::call_packed(decoder_forward_direct, record); }
int aioserve_decoder_set_lora(const void* record) { return aioserve::call_packed(decoder_set_lora_direct, record); }

}  // extern "C"
