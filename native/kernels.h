// The kernels' pointer-level entry points and what they share: element
// types, strided rows, errors. No torch header is included anywhere in
// native/: each file compiles in seconds (with torch/extension.h, ~40 s
// each), and the tensors are checked and unpacked in Python
// (aioserve/cpu/native_*.py), which passes data pointers, sizes and strides
// through the C functions each file exports (`extern "C" aioserve_*`).
//
// decoder.cpp runs a whole decode step through the functions below.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>

namespace aioserve {

// Element types, as aioserve/cpu/native_lib.py numbers torch's dtypes.
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat64 = 3, kFloat8E4M3 = 4 };

inline int64_t element_size(int type) {
  return type == kFloat64 ? 8 : type == kFloat32 ? 4 : type == kFloat8E4M3 ? 1 : 2;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<char, FreeDeleter>;

// An uninitialized buffer of `count` elements of `type`, 64-byte aligned (as torch's CPU allocator).
inline Buffer allocate(int64_t count, int type) {
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(1, count * element_size(type)));
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) throw std::bad_alloc();
  return Buffer(static_cast<char*>(p));
}

// A failed check: thrown inside the library, turned into an error code and
// a message at its C boundary (guarded), raised in Python as RuntimeError,
// as torch's TORCH_CHECK was.
template <typename... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::ostringstream message;
  (message << ... << parts);
  throw std::runtime_error(message.str());
}

#define AIOSERVE_CHECK(cond, ...) \
  do {                            \
    if (!(cond)) ::aioserve::fail(__VA_ARGS__); \
  } while (0)

void set_error(const char* message);  // module.cpp: the calling thread's last error

// Runs f; 0 when it returned, 1 (and the message kept for
// aioserve_last_error) when it threw.
template <typename F>
int guarded(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    set_error(e.what());
  } catch (...) {
    set_error("native kernel: unknown error");
  }
  return 1;
}

// The exported kernels take their arguments as one record of 8-byte fields
// (int64; double for a double parameter), packed by aioserve/cpu/native_lib.py
// with struct: ctypes converts each argument of a call on its own, ~0.2 us
// apiece, and a kernel call's Python overhead is what a small model's step
// is made of. `call_packed(f, record)` unpacks the fields in order and calls f.
template <typename T>
T unpack_field(const char*& p) {
  int64_t bits;
  std::memcpy(&bits, p, sizeof bits);
  p += sizeof bits;
  if constexpr (std::is_same_v<T, double>) {
    double value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
  } else if constexpr (std::is_pointer_v<T>) {
    return reinterpret_cast<T>(static_cast<intptr_t>(bits));
  } else {
    return static_cast<T>(bits);
  }
}

template <typename R, typename... P>
R call_packed(R (*f)(P...), const void* record) {
  const char* p = static_cast<const char*>(record);
  // Braced initialization evaluates its elements left to right.
  std::tuple<P...> values{unpack_field<P>(p)...};
  return std::apply(f, values);
}

// Calls f with a value of the C++ type of a float32, bfloat16 or float16 element type.
template <typename F>
void dispatch_float(int type, const char* name, F&& f);

// The rows of a [N, D] or [T, H, D] tensor whose last dim is contiguous:
// row r starts at (r / inner) * outer_stride + (r % inner) * inner_stride.
// So a [T, H, D] view of heads inside a fused q|k|v projection's rows is
// read and written where it lies, without a copy.
struct Rows {
  int64_t count, inner, outer_stride, inner_stride;
  int64_t offset(int64_t r) const { return (r / inner) * outer_stride + (r % inner) * inner_stride; }
};

// elementwise.cpp. rms_norm's output has x's type when the weight has it,
// else float32 (torch's promotion of a float32 weight with a half x); it is
// written as contiguous rows of `dim`.
void rms_norm(const void* x, Rows xr, void* residual, Rows rr, int x_type, const void* weight, int w_type, void* out,
              int64_t dim, float eps);
void rotary_embedding(const int64_t* positions, void* q, Rows qr, void* k, Rows kr, int type, const float* cos,
                      const float* sin, int64_t limit, int64_t tokens, int64_t dim);
void store_kv(const void* src, Rows sr, int src_type, void* cache, int cache_type, const int64_t* slots,
              int64_t limit, int64_t heads, int64_t dim);
void silu_and_mul(const void* x, void* out, int type, int64_t rows, int64_t n);
// rms_norm of q and k (weights of the rows' type, or both null: none),
// rotary_embedding and store_kv of k and v, bit for bit, in one pass: q
// normed and rotated into q_out [T, Hq, D] (dense), k normed and rotated
// into the cache and back over k's rows, v into the cache. Where
// qk_norm_rope_store_fuses: bf16 or fp16 rows, a cache of that dtype, the
// norm weights of it too (kNoNorm for both: no norms; a float32 weight
// promotes the normed head, which the separate ops do), head dim a
// multiple of 32 up to 256, AVX-512.
constexpr int kNoNorm = -1;
bool qk_norm_rope_store_fuses(int type, int cache_type, int64_t dim, int q_norm_type, int k_norm_type);
void qk_norm_rope_store(const int64_t* positions, const void* q, Rows qr, void* k, Rows kr, const void* v, Rows vr,
                        int type, const void* q_weight, int q_norm_type, const void* k_weight, int k_norm_type,
                        float eps, const float* cos,
                        const float* sin, int64_t max_positions, void* key_cache, void* value_cache, int cache_type,
                        const int64_t* slots, int64_t cache_slots, int64_t tokens, int64_t dim, void* q_out);
void check_indices(const int64_t* values, int64_t count, int64_t limit, const char* what);

// gemm.cpp: y [m, n] = x [m, k] W^T (+ bias) with W packed by pack_linear_weight;
// y in x's type, or float32 holding x's rounding (float_out).
bool gemm_fuses_multiply_add();
void packed_linear(const void* x, int x_type, int64_t m, int64_t k, const void* packed, int w_type, bool pairs,
                   int64_t n, const float* bias, void* y, bool float_out);
// Each row's max of those float_out outputs and its first column (a NaN's, if any);
// given `block_list`, W is those packed blocks side by side (n their columns).
void packed_linear_argmax(const void* x, int x_type, int64_t m, int64_t k, const void* packed, int w_type, bool pairs,
                          int64_t n, const float* bias, float* max_out, int64_t* arg_out,
                          const int64_t* block_list = nullptr);

// lora.cpp: a projection's LoRA adapter slots (slot 0: the base model).
// A fused projection (q|k|v, gate|up) has `parts` parts, each with its own
// band of band / parts rank rows and its own output columns: slot s's A
// [band, in] is held as it is, row by row, and of B [band, out], which is
// block-diagonal, only each part's block (its rank rows by its columns),
// the blocks one after the other (read whole, a step read 3x the bytes of
// B for q|k|v, 2x for gate|up; read in place, each of a part's rank rows
// was a short run of its own, far from the next).
struct LoraSlots {
  const int64_t* a = nullptr;  // addresses of the slots' A [band, k], row by row
  const int64_t* b = nullptr;  // addresses of the slots' B: each part's block [band / parts, its width], one after the other
  int a_type = 0, b_type = 0;
  int64_t slots = 0, band = 0;
  int64_t parts = 1;
  const int64_t* columns = nullptr;  // [parts + 1]: each part's first output column, then the width
};
// LoraSlots from a call's fields, checked (band split evenly among the
// parts, the parts' columns increasing from 0).
LoraSlots lora_slots(const int64_t* a, int a_type, const int64_t* b, int b_type, int64_t slots, int64_t band,
                     int64_t parts, const int64_t* columns);
// y [batch, n] += each row's update (x A_s^T) B_s through its slot s =
// row_slots[row] (0: none); x [batch, k] and y of one type.
void lora_add_rows(const void* x, int type, int64_t batch, int64_t k, const int64_t* row_slots,
                   const LoraSlots& lora, void* y, int64_t n);

// attention.cpp: q [batch, heads, dim] contiguous; out like q.
bool amx_tiles_on();  // gemm.cpp: built with the tiles, permitted by Linux, not turned off (AIOSERVE_AMX=0)
void causal_prefill_attention(const void* q, int64_t q_tok, int64_t q_head, const void* k, int64_t k_tok,
                              int64_t k_head, const void* v, int64_t v_tok, int64_t v_head, int64_t count,
                              int64_t q_len, int64_t kv_len, int64_t heads, int64_t kv_heads, int64_t dim, double scale,
                              int64_t window, void* out);

void paged_decode_attention(const void* q, int q_type, const void* k_cache, const void* v_cache, int kv_type,
                            const int32_t* page_table, int64_t pages_per_row, const int64_t* seq_lens, int64_t batch,
                            int64_t num_heads, int64_t num_kv_heads, int64_t dim, int64_t page_size, double scale,
                            int64_t window, void* out);

}  // namespace aioserve

#include "half.h"

namespace aioserve {

// gemm.cpp: the bf16 k-pair dot products' float32 sums themselves, unrounded
// (AVX512-BF16 only; greedy_screen.cpp).
void packed_linear_unrounded(const BFloat16* x, int64_t m, int64_t k, const BFloat16* packed, int64_t n, float* y);

template <typename F>
void dispatch_float(int type, const char* name, F&& f) {
  switch (type) {
    case kFloat32: f(float{}); break;
    case kBFloat16: f(BFloat16{}); break;
    case kFloat16: f(Half{}); break;
    default: fail(name, ": unsupported dtype");
  }
}

}  // namespace aioserve
