// lora_add_rows: the LoRA updates of a step whose rows use different
// adapters (aioserve/layers/lora.py's grouped and one-adapter forms, and
// the DecoderStack).
//
// For every slot the step uses (and only those: a decode step is bound by
// the weights it reads), that slot's rows are multiplied by its A^T, then
// by each part's block of B, and added to those rows of y in y's type.
// The work is cut into pieces of at most kRowsPerPiece rows of one slot,
// the pieces split among the threads, and each piece's products and its
// add run inline on one thread: one fork and join a projection. Before,
// each slot's products each opened the team: 16 rows over 16 adapters were 32 tiny
// products a projection, each with its own fork and join (a Qwen3-0.6B
// decode step of 16 rows over 16 adapters: ~+210-320 ms over the base's
// ~200 ms that way, ~+40 ms with the slots split; 2-core EPYC); and one
// adapter over a 256-token prefill chunk ran its gather and add on one
// thread. Pieces' rows are disjoint, so each output row has one writer,
// and the products give a row the same sums whatever rows share its piece:
// a row's update does not depend on the step.
//
// A and B are not packed for the packed matmul. x A^T is taken as dot
// products over A as it is (down_project): the packed blocks are 32
// columns wide and a band is 16 (one part of rank 16) or 48 (q|k|v), so a
// packed A was half or a quarter zero padding, read at every step. B is
// held as its parts' blocks, each [rank, its columns] and contiguous
// (up_project_add): the zeros of a fused projection's block-diagonal B are
// neither stored nor read, a block is one run of memory (read in place
// from the whole B, each of its rank rows was a short run of its own far
// from the next: a tiny-llama decode step of 16 rows over 16 adapters
// spent 0.55x its base matmuls' time in B's products that way, 0.35x
// now, as much as A's), and a rank-16 product pays no packed matmul's
// block setup or separate add. Both products then read their slots at
// about the memory's pace (~18 GB/s each on a 2-core Emerald Rapids VM).

#include "half.h"
#include "kernels.h"
#include "parallel.h"
#include "vec_math.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace aioserve {

LoraSlots lora_slots(const int64_t* a, int a_type, const int64_t* b, int b_type, int64_t slots, int64_t band,
                     int64_t parts, const int64_t* columns) {
  AIOSERVE_CHECK(band > 0 && slots > 0 && parts > 0 && band % parts == 0, "LoRA slots: bad band, slots or parts");
  for (int64_t p = 0; p < parts; ++p)
    AIOSERVE_CHECK(columns[p] < columns[p + 1] && (p > 0 || columns[0] == 0), "LoRA slots: bad part columns");
  return LoraSlots{a, b, a_type, b_type, slots, band, parts, columns};
}

namespace {

// A prefill chunk of 256 rows under one adapter: 16 pieces. A piece's
// products run on one thread, and a chunk's rows (64 a piece, before A's
// dot products) left a thread idle: one piece of 64 rows, Qwen3-0.6B's bf16
// q|k|v update took 317 us on the one thread, 210 us as four pieces.
constexpr int64_t kRowsPerPiece = 16;

// down_project: h [m, band] = x [m, k] A^T for A [band, k] row by row, each
// sum a float32 dot product over k taken in 16 (float) or 32 (bf16 pairs)
// lanes and then reduced in one fixed order, rounded to X. A tile of
// XRows rows of x by ARows rows of A shares each load; the sums of one
// (row, A row) pair never depend on the tile, so a row's h does not depend
// on the rows beside it.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
inline __m512 load16_masked(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16_masked(const BFloat16* p, __mmask16 mask) {
  const __m256i bits = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16_masked(const Half* p, __mmask16 mask) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p)); }

template <int XRows, int ARows, typename X, typename A>
void dot_tile(const X* x, int64_t k, const A* a, float (&sums)[4][4]) {
  __m512 acc[XRows][ARows];
  for (int r = 0; r < XRows; ++r)
    for (int c = 0; c < ARows; ++c) acc[r][c] = _mm512_setzero_ps();
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<X, BFloat16> && std::is_same_v<A, BFloat16>) {  // k in pairs: 32 products an instruction
    for (int64_t i = 0; i < k; i += 32) {
      const __mmask32 mask = k - i >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (k - i)) - 1);
      __m512bh xs[XRows];
      for (int r = 0; r < XRows; ++r) xs[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + r * k + i);
      for (int c = 0; c < ARows; ++c) {
        const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(mask, a + c * k + i);
        for (int r = 0; r < XRows; ++r) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xs[r], w);
      }
    }
  } else
#endif
  {
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 mask = k - i >= 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (k - i)) - 1);
      __m512 xs[XRows];
      for (int r = 0; r < XRows; ++r) xs[r] = load16_masked(x + r * k + i, mask);
      for (int c = 0; c < ARows; ++c) {
        const __m512 w = load16_masked(a + c * k + i, mask);
        for (int r = 0; r < XRows; ++r) acc[r][c] = _mm512_fmadd_ps(xs[r], w, acc[r][c]);
      }
    }
  }
  for (int r = 0; r < XRows; ++r)
    for (int c = 0; c < ARows; ++c) sums[r][c] = _mm512_reduce_add_ps(acc[r][c]);
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
template <typename T>
inline __m256 load8_tail(const T* p, int64_t count) {  // fewer than 8 values, zeros after them
  T values[8] = {};
  std::memcpy(values, p, count * sizeof(T));
  return load8(values);
}

template <int XRows, int ARows, typename X, typename A>
void dot_tile(const X* x, int64_t k, const A* a, float (&sums)[4][4]) {
  __m256 acc[XRows][ARows];
  for (int r = 0; r < XRows; ++r)
    for (int c = 0; c < ARows; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const int64_t count = std::min<int64_t>(8, k - i);
    __m256 xs[XRows];
    for (int r = 0; r < XRows; ++r) xs[r] = count == 8 ? load8(x + r * k + i) : load8_tail(x + r * k + i, count);
    for (int c = 0; c < ARows; ++c) {
      const __m256 w = count == 8 ? load8(a + c * k + i) : load8_tail(a + c * k + i, count);
      for (int r = 0; r < XRows; ++r) acc[r][c] = _mm256_fmadd_ps(xs[r], w, acc[r][c]);
    }
  }
  for (int r = 0; r < XRows; ++r)
    for (int c = 0; c < ARows; ++c) {
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, acc[r][c]);
      float sum = 0.f;
      for (float lane : lanes) sum += lane;
      sums[r][c] = sum;
    }
}
#else
// Neither AVX-512 nor AVX2: 16 lanes of plain float arithmetic, which the compiler vectorizes.
template <int XRows, int ARows, typename X, typename A>
void dot_tile(const X* x, int64_t k, const A* a, float (&sums)[4][4]) {
  constexpr int kLanes = 16;
  float acc[XRows][ARows][kLanes] = {};
  for (int64_t i0 = 0; i0 < k; i0 += kLanes) {
    const int64_t width = std::min<int64_t>(kLanes, k - i0);
    for (int r = 0; r < XRows; ++r)
      for (int c = 0; c < ARows; ++c)
        for (int64_t l = 0; l < width; ++l)
          acc[r][c][l] += to_float(x[r * k + i0 + l]) * to_float(a[c * k + i0 + l]);
  }
  for (int r = 0; r < XRows; ++r)
    for (int c = 0; c < ARows; ++c) {
      float sum = 0.f;
      for (int l = 0; l < kLanes; ++l) sum += acc[r][c][l];
      sums[r][c] = sum;
    }
}
#endif

template <int XRows, typename X, typename A>
void dot_rows(int a_rows, const X* x, int64_t k, const A* a, float (&sums)[4][4]) {
  switch (a_rows) {
    case 1: return dot_tile<XRows, 1>(x, k, a, sums);
    case 2: return dot_tile<XRows, 2>(x, k, a, sums);
    case 3: return dot_tile<XRows, 3>(x, k, a, sums);
    default: return dot_tile<XRows, 4>(x, k, a, sums);
  }
}

// Rows of x a tile takes: 4 x 4 sums in 16 of AVX-512's 32 registers; 2 x 4
// in 8 of AVX2's 16 (4 x 4 there spilled).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
constexpr int kDotXRows = 4;
#else
constexpr int kDotXRows = 2;
#endif

template <typename X, typename A>
void down_project(const X* x, int64_t m, int64_t k, const A* a, int64_t band, X* h) {
  float sums[4][4];
  for (int64_t r0 = 0; r0 < m; r0 += kDotXRows) {
    const int x_rows = static_cast<int>(std::min<int64_t>(kDotXRows, m - r0));
    for (int64_t c0 = 0; c0 < band; c0 += 4) {
      const int a_rows = static_cast<int>(std::min<int64_t>(4, band - c0));
      const X* xs = x + r0 * k;
      const A* as = a + c0 * k;
      switch (x_rows) {
        case 1: dot_rows<1>(a_rows, xs, k, as, sums); break;
        case 2: dot_rows<2>(a_rows, xs, k, as, sums); break;
        case 3: dot_rows<std::min(3, kDotXRows)>(a_rows, xs, k, as, sums); break;
        default: dot_rows<kDotXRows>(a_rows, xs, k, as, sums); break;
      }
      for (int r = 0; r < x_rows; ++r)
        for (int c = 0; c < a_rows; ++c) h[(r0 + r) * band + c0 + c] = from_float<X>(sums[r][c]);
    }
  }
}

// Rows of one slot that one thread takes.
struct Piece {
  int64_t slot;
  const int64_t* rows;  // into the slot's row list
  int64_t count;
};

// up_project_add: y's columns [first, first + width) of each row i +=
// h_i B_part, B_part the part's block [rank, width], contiguous (each
// part's block of a fused projection's B held apart, rank rows of its own
// columns: no zeros stored or skipped over), each sum a chain of
// multiply-adds over the rank in order, rounded to T, then added (rounded
// to T as torch's add is). The sums go straight into y: the packed matmul
// spent more on a 16-long k (a block's setup, its tile stored and
// converted, then an add pass) than on the products.
constexpr int64_t kColumnsAtOnce = 128;  // eight 16-float vectors of sums

template <typename T>
inline void add_sums(const float* sums, int64_t cols, T* out) {
#pragma omp simd
  for (int64_t j = 0; j < cols; ++j) out[j] = from_float<T>(to_float(out[j]) + round_to<T>(sums[j]));
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// Vecs vectors of sums held in registers over the rank (an array with a
// run-time bound would live on the stack), the last one `tail` masked.
template <int Vecs, typename B>
inline void rank_sums(const float* weights, int64_t rank, const B* b, int64_t width, __mmask16 tail, float* sums) {
  __m512 acc[Vecs];
  for (int v = 0; v < Vecs; ++v) acc[v] = _mm512_setzero_ps();
  for (int64_t r = 0; r < rank; ++r) {
    const __m512 w = _mm512_set1_ps(weights[r]);
    const B* row = b + r * width;
    for (int v = 0; v < Vecs; ++v)
      acc[v] = _mm512_fmadd_ps(w, load16_masked(row + v * 16, v + 1 == Vecs ? tail : __mmask16(0xffff)), acc[v]);
  }
  for (int v = 0; v < Vecs; ++v) _mm512_storeu_ps(sums + v * 16, acc[v]);
}

template <typename B>
inline void column_sums(const float* weights, int64_t rank, const B* b, int64_t width, int64_t cols, float* sums) {
  const int vecs = static_cast<int>((cols + 15) / 16);
  const __mmask16 tail = cols % 16 ? static_cast<__mmask16>((1u << (cols % 16)) - 1) : __mmask16(0xffff);
  switch (vecs) {
    case 1: return rank_sums<1>(weights, rank, b, width, tail, sums);
    case 2: return rank_sums<2>(weights, rank, b, width, tail, sums);
    case 3: return rank_sums<3>(weights, rank, b, width, tail, sums);
    case 4: return rank_sums<4>(weights, rank, b, width, tail, sums);
    case 5: return rank_sums<5>(weights, rank, b, width, tail, sums);
    case 6: return rank_sums<6>(weights, rank, b, width, tail, sums);
    case 7: return rank_sums<7>(weights, rank, b, width, tail, sums);
    default: return rank_sums<8>(weights, rank, b, width, tail, sums);
  }
}
#else
template <typename B>
inline void column_sums(const float* weights, int64_t rank, const B* b, int64_t width, int64_t cols, float* sums) {
  for (int64_t j = 0; j < cols; ++j) sums[j] = 0.f;
  for (int64_t r = 0; r < rank; ++r) {
    const B* row = b + r * width;
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) sums[j] += weights[r] * to_float(row[j]);
  }
}
#endif

template <typename T, typename B>
void up_project_add(const T* h, int64_t h_stride, int64_t m, int64_t rank, const B* b, int64_t width,
                    const int64_t* rows, int64_t first, int64_t n, T* y) {
  thread_local std::vector<float> rank_weights;  // row i's h, widened once, not once a column group
  rank_weights.resize(rank);
  float* weights = rank_weights.data();
  alignas(64) float sums[kColumnsAtOnce];
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < rank; ++r) weights[r] = to_float(h[i * h_stride + r]);
    T* out = y + rows[i] * n + first;
    for (int64_t c0 = 0; c0 < width; c0 += kColumnsAtOnce) {
      const int64_t cols = std::min(kColumnsAtOnce, width - c0);
      column_sums(weights, rank, b + c0, width, cols, sums);
      add_sums(sums, cols, out + c0);
    }
  }
}

// y's rows of `piece` += (x's rows A^T) B, part by part.
void add_piece(const void* x, int type, int64_t k, const Piece& piece, const LoraSlots& lora, void* y, int64_t n) {
  const int64_t m = piece.count, bytes = element_size(type), rank = lora.band / lora.parts;
  const int64_t* rows = piece.rows;
  const char* input = static_cast<const char*>(x) + rows[0] * k * bytes;
  Buffer gathered;
  if (rows[m - 1] - rows[0] != m - 1) {  // not one run of rows (a prefill chunk's request is): gathered
    gathered = allocate(m * k, type);
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(gathered.get() + i * k * bytes, static_cast<const char*>(x) + rows[i] * k * bytes, k * bytes);
    input = gathered.get();
  }
  dispatch_float(type, "lora_add_rows_x", [&](auto x_tag) {
    using X = decltype(x_tag);
    thread_local std::vector<X> rank_rows;  // the piece's x A^T: a thread's buffer, grown once, not one a piece
    rank_rows.resize(m * lora.band);
    X* h = rank_rows.data();
    dispatch_float(lora.a_type, "lora_add_rows_a", [&](auto a_tag) {
      using A = decltype(a_tag);
      down_project(reinterpret_cast<const X*>(input), m, k, reinterpret_cast<const A*>(lora.a[piece.slot]), lora.band,
                   h);
    });
    dispatch_float(lora.b_type, "lora_add_rows_b", [&](auto b_tag) {
      using B = decltype(b_tag);
      const B* b = reinterpret_cast<const B*>(lora.b[piece.slot]);
      for (int64_t p = 0; p < lora.parts; ++p) {
        const int64_t first = lora.columns[p], width = lora.columns[p + 1] - first;
        up_project_add(h + p * rank, lora.band, m, rank, b + rank * first, width, rows, first, n,
                       static_cast<X*>(y));
      }
    });
  });
}

}  // namespace

void lora_add_rows(const void* x, int type, int64_t batch, int64_t k, const int64_t* row_slots,
                   const LoraSlots& lora, void* y, int64_t n) {
  AIOSERVE_CHECK(lora.columns[lora.parts] == n, "lora_add_rows: the parts' columns do not cover y");
  std::vector<int64_t> used;                  // the slots the rows use, the base's (0) aside
  std::vector<std::vector<int64_t>> rows_of;  // rows_of[u]: the rows of slot used[u]
  for (int64_t r = 0; r < batch; ++r) {
    const int64_t slot = row_slots[r];
    if (slot == 0) continue;
    AIOSERVE_CHECK(slot > 0 && slot < lora.slots, "lora_add_rows: a row's LoRA slot is out of range");
    const auto found = std::find(used.begin(), used.end(), slot);
    if (found == used.end()) {
      used.push_back(slot);
      rows_of.push_back({r});
    } else {
      rows_of[found - used.begin()].push_back(r);
    }
  }
  std::vector<Piece> pieces;
  for (size_t u = 0; u < used.size(); ++u) {
    const int64_t m = static_cast<int64_t>(rows_of[u].size());
    for (int64_t first = 0; first < m; first += kRowsPerPiece)
      pieces.push_back({used[u], rows_of[u].data() + first, std::min(kRowsPerPiece, m - first)});
  }
  parallel_pieces(static_cast<int64_t>(pieces.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) add_piece(x, type, k, pieces[i], lora, y, n);
  }, 1);
}

}  // namespace aioserve

extern "C" {

static int lora_add_rows_direct(const void* x, int type, int64_t batch, int64_t k, const int64_t* row_slots,
                                const int64_t* a, int a_type, const int64_t* b, int b_type,
                                int64_t slots, int64_t band, int64_t parts, const int64_t* columns, void* y,
                                int64_t n) {
  return aioserve::guarded([&] {
    const aioserve::LoraSlots lora = aioserve::lora_slots(a, a_type, b, b_type, slots, band, parts, columns);
    aioserve::lora_add_rows(x, type, batch, k, row_slots, lora, y, n);
  });
}

int aioserve_lora_add_rows(const void* record) { return aioserve::call_packed(lora_add_rows_direct, record); }

}  // extern "C"
