// lora_add_rows: the LoRA updates of a step whose rows use different
// adapters (aioserve/layers/lora.py's grouped and one-adapter forms, and
// the DecoderStack).
//
// For every slot the step uses (and only those: a decode step is bound by
// the weights it reads), that slot's rows are multiplied by its A^T, then
// by each part's block of B, and added to those rows of y in y's type.
// The work is cut into pieces of at most kRowsPerPiece rows of one slot,
// the pieces split among the threads, and each piece's products and its
// add run inline on one thread (packed_linear does not open a team inside
// a parallel region): one fork and join a projection. Before, each slot's
// products each opened the team: 16 rows over 16 adapters were 32 tiny
// products a projection, each with its own fork and join (a Qwen3-0.6B
// decode step of 16 rows over 16 adapters: ~+210-320 ms over the base's
// ~200 ms that way, ~+40 ms with the slots split; 2-core EPYC); and one
// adapter over a 256-token prefill chunk ran its gather and add on one
// thread. Pieces' rows are disjoint, so each output row has one writer,
// and the packed products give a row the same sums whatever rows share its
// piece: a row's update does not depend on the step.

#include "half.h"
#include "kernels.h"
#include "parallel.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

namespace aioserve {

LoraSlots lora_slots(const int64_t* a, int a_type, int a_pairs, const int64_t* b, int b_type, int b_pairs,
                     int64_t slots, int64_t band, int64_t parts, const int64_t* columns) {
  AIOSERVE_CHECK(band > 0 && slots > 0 && parts > 0 && band % parts == 0, "LoRA slots: bad band, slots or parts");
  for (int64_t p = 0; p < parts; ++p)
    AIOSERVE_CHECK(columns[p] < columns[p + 1] && (p > 0 || columns[0] == 0), "LoRA slots: bad part columns");
  return LoraSlots{a, b, a_type, b_type, a_pairs != 0, b_pairs != 0, slots, band, parts, columns};
}

namespace {

constexpr int64_t kRowsPerPiece = 64;  // a prefill chunk of 256 rows under one adapter: 4 pieces

// Rows of one slot that one thread takes.
struct Piece {
  int64_t slot;
  const int64_t* rows;  // into the slot's row list
  int64_t count;
};

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
  Buffer h = allocate(m * lora.band, type);
  packed_linear(input, type, m, k, reinterpret_cast<const void*>(lora.a[piece.slot]), lora.a_type, lora.a_pairs,
                lora.band, nullptr, h.get(), false);
  Buffer band = lora.parts > 1 ? allocate(m * rank, type) : Buffer();
  Buffer update = allocate(m * n, type);
  for (int64_t p = 0; p < lora.parts; ++p) {
    const int64_t first = lora.columns[p], width = lora.columns[p + 1] - first;
    const char* part_h = h.get();
    if (lora.parts > 1) {  // this part's rank columns of h, contiguous for the product
      for (int64_t i = 0; i < m; ++i)
        std::memcpy(band.get() + i * rank * bytes, h.get() + (i * lora.band + p * rank) * bytes, rank * bytes);
      part_h = band.get();
    }
    packed_linear(part_h, type, m, rank, reinterpret_cast<const void*>(lora.b[piece.slot * lora.parts + p]),
                  lora.b_type, lora.b_pairs, width, nullptr, update.get(), false);
    dispatch_float(type, "lora_add_rows", [&](auto zero) {
      using T = decltype(zero);
      for (int64_t i = 0; i < m; ++i) {
        T* out_row = static_cast<T*>(y) + rows[i] * n + first;
        const T* add = reinterpret_cast<const T*>(update.get()) + i * width;
#pragma omp simd
        for (int64_t j = 0; j < width; ++j)  // rounded to T as torch's add is
          out_row[j] = from_float<T>(to_float(out_row[j]) + to_float(add[j]));
      }
    });
  }
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
                                const int64_t* a, int a_type, int a_pairs, const int64_t* b, int b_type, int b_pairs,
                                int64_t slots, int64_t band, int64_t parts, const int64_t* columns, void* y,
                                int64_t n) {
  return aioserve::guarded([&] {
    const aioserve::LoraSlots lora = aioserve::lora_slots(a, a_type, a_pairs, b, b_type, b_pairs, slots, band, parts,
                                                          columns);
    aioserve::lora_add_rows(x, type, batch, k, row_slots, lora, y, n);
  });
}

int aioserve_lora_add_rows(const void* record) { return aioserve::call_packed(lora_add_rows_direct, record); }

}  // extern "C"
