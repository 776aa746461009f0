// packed_linear: y = x W^T (+ b) for a weight packed once at load.
//
// Why: a decode step multiplies a few rows by every weight of the model, so
// on a CPU it is bound by streaming the weights from memory, and BLAS calls
// made for large square products lose 2-3x there (measured on tiny-llama in
// a full step: the layers' matmuls ran at 10-20 GB/s of a 33 GB/s machine).
// Packing W [N, K] into column blocks [N / NB][K][NB] lets each thread read
// one contiguous stretch of memory exactly once per call, whatever the row
// count, while a tile of rows accumulates in registers. Half-precision
// weights (bf16, fp16) stay half in memory and are widened in registers, so
// a bf16 checkpoint computes in float32 from half the bytes on CPUs without
// bf16 matrix instructions.
//
// Every output is a float32 sum over k in increasing order, whatever the
// batch: a row's result does not depend on the rows beside it.
//
// On CPUs with AVX512-BF16, bf16 weights are packed in pairs along k
// ([N / NB][K / 2][NB][2]): bf16 activations (bf16 compute) then multiply
// two k at a time with the dot-product instruction (vdpbf16ps, twice the
// FMA rate), and float32 activations split each pair back into two float32
// vectors with a shift and a mask, keeping the one-k-at-a-time sum.

#include "half.h"
#include "kernels.h"
#include "parallel.h"
#include "tile_config.h"
#include "vec_math.h"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

using aioserve::BFloat16;
using aioserve::Half;

#if defined(__AVX512F__)
constexpr int kVec = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vset1(float v) { return _mm512_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm512_storeu_ps(p, v); }
template <typename T>
inline Vec vload(const T* p) { return aioserve::load16(p); }  // float, bf16, fp16 (vec_math.h)
constexpr bool kFused = true;
constexpr int kMaxRows = 12;  // 24 accumulators + 2 weights + 1 broadcast of 32 registers
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr int kVec = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vset1(float v) { return _mm256_set1_ps(v); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline void vstore(float* p, Vec v) { _mm256_storeu_ps(p, v); }
template <typename T>
inline Vec vload(const T* p) { return aioserve::load8(p); }  // float, bf16, fp16 (vec_math.h)
constexpr bool kFused = true;
constexpr int kMaxRows = 6;  // 12 accumulators + 2 weights + 1 broadcast of 16 registers
#else
// Portable fallback: the compiler vectorizes what it can.
constexpr int kVec = 8;
struct Vec { float v[kVec]; };
inline Vec vzero() { Vec r; for (float& x : r.v) x = 0.f; return r; }
inline Vec vset1(float s) { Vec r; for (float& x : r.v) x = s; return r; }
inline Vec vfma(Vec a, Vec b, Vec c) { for (int i = 0; i < kVec; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
inline void vstore(float* p, Vec v) { std::memcpy(p, v.v, sizeof v.v); }
template <typename T>
inline Vec vload(const T* p) { Vec r; for (int i = 0; i < kVec; ++i) r.v[i] = aioserve::to_float(p[i]); return r; }
constexpr bool kFused = false;  // whether c += a * b contracts to an fma is the compiler's choice
constexpr int kMaxRows = 4;
#endif

constexpr int kBlock = 2 * kVec;  // output columns per packed block
// Rows of x converted and kept hot per pass over the weight: a pass re-reads
// every weight block, so it should be long, and its rows should stay near
// (L2). Fewer, longer passes won: Qwen3-0.6B's prefill matmuls (256-row
// chunks) took 10.6-10.9 s at 256 KiB, 9.9-10.4 at 512 and 9.3-9.5 at 1 MiB,
// interleaved runs on a 2-core EPYC with 1 MiB of L2 per core.
constexpr int64_t kChunkBytes = 1024 << 10;

// The block after the one a tile reads, asked into L2 a row at a time while
// the tiles of one pass over the block run: the hardware prefetchers stop
// at each 4 KiB, so without it every block's first tile waited on memory
// for all of its weights, and the tiles after it (their weights in L2) left
// the memory idle. The rows of the next block are dealt over the passes
// (pass p of P fetches rows p, p + P, ...), so the memory works through
// every tile of the call, not only the first. `row_bytes`: the next block's
// bytes per loop iteration of the tile (a k, or a pair of k). Measured on
// tiny-llama's six float32 layers at 64 rows (weights 24 MB, from L3),
// interleaved in one process, 60 rounds, 2-core Emerald Rapids VM: 5.07 ->
// 4.87 ms (medians 5.61 -> 5.20), again 5.62 -> 5.41 (6.24 -> 5.83); the
// whole next block in the first pass measured the same as dealt, in the
// last pass 5.49 (5.96); at 16 rows (two passes) no change.
struct NextBlockFetch {
  const char* next = nullptr;
  int64_t row_bytes = 0;
  int64_t first = std::numeric_limits<int64_t>::max();  // none: never due
  int64_t stride = 1;

  // At the tile's loop iteration i: the next block's row i, if this pass's
  // turn (`due`: the iteration it next fetches at, starting from `first`).
  inline void at(int64_t i, int64_t& due) const {
    if (i != due) return;
    const char* row = next + i * row_bytes;
    for (int64_t line = 0; line < row_bytes; line += 64) _mm_prefetch(row + line, _MM_HINT_T1);
    due += stride;
  }
};

// One tile: `rows` rows of x (float32, row stride ld) against one packed
// block [k][kBlock]; writes a rows x kBlock float32 tile.
template <int Rows, typename W>
inline void tile(const float* __restrict x, int64_t k, int64_t ld, const W* __restrict block, float* __restrict out,
                 const NextBlockFetch& fetch) {
  Vec acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = vzero();
  for (int64_t i = 0, due = fetch.first; i < k; ++i) {
    fetch.at(i, due);
    const Vec w0 = vload(block + i * kBlock), w1 = vload(block + i * kBlock + kVec);
    for (int r = 0; r < Rows; ++r) {
      const Vec b = vset1(x[r * ld + i]);
      acc[r][0] = vfma(b, w0, acc[r][0]);
      acc[r][1] = vfma(b, w1, acc[r][1]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    vstore(out + r * kBlock, acc[r][0]);
    vstore(out + r * kBlock + kVec, acc[r][1]);
  }
}

#if defined(__AVX512BF16__)
constexpr bool kPairs = true;

// bf16 x (rows of k / 2 pairs, read as 32-bit words) against a pair-packed
// block [k / 2][kBlock][2]: each instruction adds x[2i] w[2i] + x[2i+1] w[2i+1].
template <int Rows>
inline void tile_dot_pairs(const uint32_t* __restrict x, int64_t pairs, int64_t ld,
                           const BFloat16* __restrict block, float* __restrict out, const NextBlockFetch& fetch) {
  __m512 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0, due = fetch.first; i < pairs; ++i) {
    fetch.at(i, due);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(block + i * 2 * kBlock);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(block + i * 2 * kBlock + 2 * kVec);
    for (int r = 0; r < Rows; ++r) {
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ld + i]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], b, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], b, w1);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    _mm512_storeu_ps(out + r * kBlock, acc[r][0]);
    _mm512_storeu_ps(out + r * kBlock + kVec, acc[r][1]);
  }
}

// float32 x against a pair-packed bf16 block: the low and high halves of each
// 32-bit word are the weights of k = 2i and 2i + 1, widened by shift and mask.
template <int Rows>
inline void tile_split_pairs(const float* __restrict x, int64_t k, int64_t ld, const BFloat16* __restrict block,
                             float* __restrict out, const NextBlockFetch& fetch) {
  __m512 acc[Rows][2];
  for (int r = 0; r < Rows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0, due = fetch.first; i < k / 2; ++i) {
    fetch.at(i, due);
    const aioserve::SplitPairs w0 = aioserve::split_pairs(block + i * 2 * kBlock);  // vec_math.h
    const aioserve::SplitPairs w1 = aioserve::split_pairs(block + i * 2 * kBlock + 2 * kVec);
    for (int r = 0; r < Rows; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ld + 2 * i]), b = _mm512_set1_ps(x[r * ld + 2 * i + 1]);
      acc[r][0] = _mm512_fmadd_ps(b, w0.odd, _mm512_fmadd_ps(a, w0.even, acc[r][0]));
      acc[r][1] = _mm512_fmadd_ps(b, w1.odd, _mm512_fmadd_ps(a, w1.even, acc[r][1]));
    }
  }
  for (int r = 0; r < Rows; ++r) {
    _mm512_storeu_ps(out + r * kBlock, acc[r][0]);
    _mm512_storeu_ps(out + r * kBlock + kVec, acc[r][1]);
  }
}
#else
constexpr bool kPairs = false;
#endif

// AMX: on CPUs with tile registers (Sapphire Rapids and later), bf16 x
// against the same pair-packed blocks through tile instructions. A block's
// pair rows are exactly a B tile's rows (16 pairs of k by 16 columns, 64
// bytes, one tile per half block), so the packing does not change. Why: the
// pair dot (vdpbf16ps) multiplies 32 bf16 products per instruction, a tile
// 8192 per instruction, so a batch-64 decode step, compute-bound on the
// pair dots, becomes bound by reading the weights again; measured in
// docs/performance.md. The tiles sum each output over k in increasing pairs,
// as the pair dot does, and every row count takes them (a last partial tile
// of fewer rows), so a row's result still does not depend on the rows beside
// it.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define AIOSERVE_AMX_TILES 1  // built with the tile instructions (and Linux's permission call)
#endif
#if defined(AIOSERVE_AMX_TILES)
constexpr bool kTilesBuilt = true;
constexpr int kTileRows = 16;  // rows of x per A tile, pairs of k per B tile
constexpr int kTileK = 32;     // k per tile step: 16 pairs, 64 bytes of bf16 a row

// Linux hands the tile registers' state (8 KiB a thread) only to a process
// that asks for it once.
bool tiles_permitted() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// Tiles of 64-byte rows: 0-3 the sums (two row tiles by two half blocks),
// 4-5 x's row tiles, 6-7 the weights' half blocks (16 pairs of k). The sums
// and x's tiles have `rows` rows (16, or fewer for a last partial tile: its
// rows are all the tile multiplies, so one row costs a sixteenth of a full
// tile and x needs no zero padding). Loaded at every piece of work, since
// other code on the thread (oneDNN's AMX kernels) may have configured the
// tiles its own way in between.
inline void configure_tiles(int rows) {
  aioserve::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = static_cast<uint8_t>(t < 6 ? rows : kTileRows);
  }
  _tile_loadconfig(&config);
}

// RowTiles row tiles of bf16 x (as configured: 16 rows, or a last partial
// tile's; row stride ld_bytes; k a multiple of 32) against one pair-packed
// block [k / 2][kBlock][2]: out, a row tile's 16 rows apart, kBlock float32
// sums a row. `next`, if given, is the block after this one (the same size),
// asked into L2 a k step at a time: a tile load that misses stalls its
// products, and the hardware prefetchers stop at each 4 KiB, so without it
// the first pass over a block streamed W from memory at the loads' pace
// (Qwen3-0.6B's layer at 64 rows 2.82-2.96 -> 2.51-2.66 ms, at 256 rows
// 8.60-12.05 -> 7.88-11.13 ms, the LM head at 64 rows 27.6 -> 25.9-26.5 ms;
// measured interleaved on a 2-core Emerald Rapids VM).
template <int RowTiles>
inline void tile_amx(const char* x, int64_t k, int64_t ld_bytes, const BFloat16* block, float* out,
                     const BFloat16* next) {
  static_assert(kBlock == 2 * kTileRows, "a packed block is two B tiles wide");
  constexpr int64_t kPairRowBytes = 2 * kBlock * 2;
  constexpr int64_t kStepBytes = kTileK / 2 * kPairRowBytes;  // one k step of a block
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k0 = 0; k0 < k; k0 += kTileK) {
    const BFloat16* pairs = block + (k0 / 2) * 2 * kBlock;
    if (next != nullptr) {
      const char* ahead = reinterpret_cast<const char*>(next + (k0 / 2) * 2 * kBlock);
      for (int64_t line = 0; line < kStepBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T1);
    }
    _tile_loadd(6, pairs, kPairRowBytes);
    _tile_loadd(7, pairs + 2 * kTileRows, kPairRowBytes);
    _tile_loadd(4, x + k0 * 2, ld_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (RowTiles == 2) {
      _tile_loadd(5, x + kTileRows * ld_bytes + k0 * 2, ld_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t kOutRowBytes = kBlock * 4;
  _tile_stored(0, out, kOutRowBytes);
  _tile_stored(1, out + kTileRows, kOutRowBytes);
  if constexpr (RowTiles == 2) {
    _tile_stored(2, out + kTileRows * kBlock, kOutRowBytes);
    _tile_stored(3, out + kTileRows * kBlock + kTileRows, kOutRowBytes);
  }
}
#else
constexpr bool kTilesBuilt = false;
constexpr int kTileRows = 16;
constexpr int kTileK = 32;
bool tiles_permitted() { return false; }
#endif

// Whether bf16 x meets pair-packed blocks through the tiles: built and
// permitted, and not turned off (aioserve_gemm_use_tiles; AIOSERVE_AMX=0).
std::atomic<bool> tiles_wanted{true};
inline bool tiles_on() { return kTilesBuilt && tiles_wanted.load(std::memory_order_relaxed) && tiles_permitted(); }

// How x meets a block: plain float32 rows, or one of the pair forms.
enum class Form { kPlain, kDotPairs, kSplitPairs };

template <Form F, int Rows, typename W>
inline void tile_form(const void* x, int64_t k, int64_t ld, const W* block, float* out, const NextBlockFetch& fetch) {
  if constexpr (F == Form::kPlain) {
    tile<Rows>(static_cast<const float*>(x), k, ld, block, out, fetch);
  }
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<W, BFloat16> && F == Form::kDotPairs) {
    tile_dot_pairs<Rows>(static_cast<const uint32_t*>(x), k / 2, ld, block, out, fetch);
  }
  if constexpr (std::is_same_v<W, BFloat16> && F == Form::kSplitPairs) {
    tile_split_pairs<Rows>(static_cast<const float*>(x), k, ld, block, out, fetch);
  }
#endif
}

template <Form F, typename W>
void tile_rows(int rows, const void* x, int64_t k, int64_t ld, const W* block, float* out, const NextBlockFetch& fetch) {
  switch (rows) {
#define AIOSERVE_TILE(R) case R: if constexpr (R <= kMaxRows) { tile_form<F, R>(x, k, ld, block, out, fetch); return; } break;
    AIOSERVE_TILE(1) AIOSERVE_TILE(2) AIOSERVE_TILE(3) AIOSERVE_TILE(4) AIOSERVE_TILE(5) AIOSERVE_TILE(6)
    AIOSERVE_TILE(7) AIOSERVE_TILE(8) AIOSERVE_TILE(9) AIOSERVE_TILE(10) AIOSERVE_TILE(11) AIOSERVE_TILE(12)
#undef AIOSERVE_TILE
  }
  aioserve::fail("packed_linear: bad tile height ", rows);
}

// The output as a Y: X itself, or float32 holding X's rounding (the LM head:
// its logits go on in float32, and torch's own widening of [64, 151936] bf16
// logits took 19 ms of a 324 ms qwen3 step), or with Round false the float32
// sum itself (the greedy screen's bf16 dot products, greedy_screen.cpp).
template <typename X, typename Y, bool Round = true>
inline Y store_as(float v) {
  if constexpr (std::is_same_v<Y, float>) {
    return Round ? aioserve::round_to<X>(v) : v;
  } else {
    return aioserve::from_float<X>(v);
  }
}

// Where a tile's float32 sums (rows x kBlock, x's rows from `row`, W's
// columns col0 .. col0 + cols) go: a sink's operator(). The kernels below
// compute; the sink stores.

// Whether an output of m x n elements of `bytes` each goes to memory with
// non-temporal stores (RowsOut::stream): past 2 MiB, more than a core's L2,
// and its rows 64-byte aligned, as such a store needs. Whoever writes
// with them fences before the parallel region ends (end_streaming).
inline bool streams_output(const void* y, int64_t m, int64_t n, int64_t bytes) {
  constexpr int64_t kStreamBytes = 2 << 20;
  return m * n * bytes > kStreamBytes && (n * bytes) % 64 == 0 && reinterpret_cast<uintptr_t>(y) % 64 == 0;
}

// Non-temporal stores are weakly ordered: each thread fences its own before
// the parallel region's end hands the output to other threads.
inline void end_streaming() {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

// Into y's rows, with the bias: packed_linear's output.
template <typename X, typename Y, bool Round>
struct RowsOut {
  Y* y;
  int64_t n;
  const float* bias;
  // Whole blocks written with non-temporal stores (streams_output): an
  // output larger than a core's L2 leaves it before anything reads it, and
  // a plain store first reads each line it writes (a tile writes 32 rows'
  // lines n apart, each a miss that stalls the stores behind it). Qwen3-0.6B's
  // gate|up, silu and down at 2048 rows, in one process (2026-11-28, a 2-core
  // Emerald Rapids VM): 29.7 -> 26.9 ms; at 256 rows 3.56 -> 3.47; at 64-128
  // rows (under 2 MiB) the same either way.
  bool stream = false;

#if defined(__AVX512F__)
  void stream_rows(const float* out, int rows, int64_t row, int64_t col0) const {
    for (int r = 0; r < rows; ++r) {
      __m512 a = _mm512_loadu_ps(out + r * kBlock), b = _mm512_loadu_ps(out + r * kBlock + 16);
      if (bias != nullptr) {
        a = _mm512_add_ps(a, _mm512_loadu_ps(bias + col0));
        b = _mm512_add_ps(b, _mm512_loadu_ps(bias + col0 + 16));
      }
      Y* dst = y + (row + r) * n + col0;
      if constexpr (std::is_same_v<Y, BFloat16>) {  // X is bf16 too (Y is X or float)
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(aioserve::bf16_bits16(a)),
                                                aioserve::bf16_bits16(b), 1);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), both);
      } else {
        if constexpr (Round && std::is_same_v<X, BFloat16>) {
          a = aioserve::held_as_bf16(a);
          b = aioserve::held_as_bf16(b);
        }
        _mm512_stream_ps(dst, a);
        _mm512_stream_ps(dst + 16, b);
      }
    }
  }
#endif

  void operator()(const float* out, int rows, int64_t row, int64_t col0, int64_t cols) const {
#if defined(__AVX512F__)
    if constexpr (kBlock == 32 && !std::is_same_v<X, Half> && (std::is_same_v<Y, BFloat16> || std::is_same_v<Y, float>)) {
      if (stream && cols == kBlock) return stream_rows(out, rows, row, col0);
    }
#endif
    for (int r = 0; r < rows; ++r) {
      Y* dst = y + (row + r) * n + col0;
      const float* src = out + r * kBlock;
      if (bias != nullptr) {
        for (int64_t c = 0; c < cols; ++c) dst[c] = store_as<X, Y, Round>(src[c] + bias[col0 + c]);
      } else {
        for (int64_t c = 0; c < cols; ++c) dst[c] = store_as<X, Y, Round>(src[c]);
      }
    }
  }
};


// Each row's first largest output within each block, as packed_linear's
// float_out would hold it (with the bias, rounded to X), a NaN counting as
// the largest: `best` [blocks, m] and `column` [blocks, m], merged across
// blocks by packed_linear_argmax. Greedy decoding's LM head: no [m, N]
// float32 logits written and read again (Qwen3-0.6B at 64 rows: 39 MB).
template <typename X>
struct BlockArgmax {
  float* best;
  int32_t* column;
  int64_t m;
  const float* bias;

  void operator()(const float* out, int rows, int64_t row, int64_t col0, int64_t cols) const {
    const int64_t at = col0 / kBlock * m + row;
#if defined(__AVX512F__)
    if constexpr (kBlock == 32 && !std::is_same_v<X, Half>) {
      if (cols == kBlock) {  // every block but perhaps the last: two vectors a row, no branch but NaN's
        for (int r = 0; r < rows; ++r) {
          __m512 a = _mm512_loadu_ps(out + r * kBlock), b = _mm512_loadu_ps(out + r * kBlock + 16);
          if (bias != nullptr) {
            a = _mm512_add_ps(a, _mm512_loadu_ps(bias + col0));
            b = _mm512_add_ps(b, _mm512_loadu_ps(bias + col0 + 16));
          }
          if constexpr (std::is_same_v<X, BFloat16>) {
            a = aioserve::held_as_bf16(a);
            b = aioserve::held_as_bf16(b);
          }
          const __mmask16 nan_a = _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
          const __mmask16 nan_b = _mm512_cmp_ps_mask(b, b, _CMP_UNORD_Q);
          int where;
          if (nan_a | nan_b) {  // the first NaN wins (torch.argmax's answer)
            where = nan_a ? __builtin_ctz(nan_a) : 16 + __builtin_ctz(nan_b);
          } else {
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(a, b)));
            const __mmask16 at_a = _mm512_cmp_ps_mask(a, top, _CMP_EQ_OQ);
            const __mmask16 at_b = _mm512_cmp_ps_mask(b, top, _CMP_EQ_OQ);
            where = at_a ? __builtin_ctz(at_a) : 16 + __builtin_ctz(at_b);
          }
          alignas(64) float row_values[kBlock];
          _mm512_store_ps(row_values, a);
          _mm512_store_ps(row_values + 16, b);
          best[at + r] = row_values[where];
          column[at + r] = static_cast<int32_t>(col0 + where);
        }
        return;
      }
    }
#endif
    alignas(64) float held[kBlock];
    for (int r = 0; r < rows; ++r) {
      // Passes the compiler vectorizes (a scalar loop with a branch a column
      // cost more than the tile's products): the outputs as held, then
      // max_argmax (vec_math.h), row_max_argmax's own.
      const float* src = out + r * kBlock;
      if (bias != nullptr) {
        for (int64_t c = 0; c < cols; ++c) held[c] = store_as<X, float, true>(src[c] + bias[col0 + c]);
      } else {
        for (int64_t c = 0; c < cols; ++c) held[c] = store_as<X, float, true>(src[c]);
      }
      const auto [top, where] = aioserve::max_argmax(held, cols);  // a NaN first, else the first max
      best[at + r] = top;
      column[at + r] = static_cast<int32_t>(col0 + where);
    }
  }
};

// x's rows copied `ld_bytes` apart (rows 4 KiB apart alias in L1: see
// packed_linear_impl), by the team: one thread's copy was the serial part of
// a call, up to a sixth of o_proj's (K = 2048) on two cores at 512-2048 rows.
constexpr int64_t kStageGrain = 16;  // rows a piece

inline void stage_rows(const char* x, int64_t rows, int64_t row_bytes, char* staged, int64_t ld_bytes) {
  aioserve::parallel_pieces(rows, kStageGrain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) std::memcpy(staged + r * ld_bytes, x + r * row_bytes, row_bytes);
  });
}

// Where block b of a packed W lies: the b-th block, or, given a list, the
// list[b]-th (the int8 head screen's kept blocks, int8_head_screen.cpp,
// computed again where they lie: copied side by side first, a step kept
// ~1 MB of the head a row and copied it before reading it).
template <typename W>
struct PackedBlocks {
  const W* packed;
  int64_t block_elems;  // k x kBlock
  const int64_t* list = nullptr;
  const W* operator[](int64_t b) const { return packed + (list != nullptr ? list[b] : b) * block_elems; }
};

#if defined(AIOSERVE_AMX_TILES)
constexpr int64_t kGroupBytes = 512 << 10;  // of W's blocks, taken together (packed_linear_tiles)

// packed_linear for bf16 x and pair-packed bf16 W through the tiles (k a
// multiple of 32): x's whole 16-row tiles two at a time, then the rows left
// over (fewer than 16: a decode step's, a LoRA slot's) as one smaller tile.
// x is read where it is, unless its rows are 4 KiB apart (copied apart, as
// packed_linear_impl does); as many rows per pass over W as fit kChunkBytes.
template <typename Sink>
void packed_linear_tiles(const BFloat16* x, int64_t m, int64_t k, const PackedBlocks<BFloat16>& packed, int64_t n,
                         const Sink& sink) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  const int64_t row_bytes = k * 2;
  const bool aliased = m > 1 && row_bytes % 4096 == 0;
  const int64_t ld_bytes = aliased ? row_bytes + 64 : row_bytes;
  constexpr int64_t kPassRows = 2 * kTileRows;
  const int64_t most_rows = std::max<int64_t>(kPassRows, kChunkBytes / ld_bytes / kPassRows * kPassRows);
  std::unique_ptr<char[]> staged(aliased ? new char[std::min(m, most_rows) * ld_bytes] : nullptr);
  for (int64_t row0 = 0; row0 < m; row0 += most_rows) {
    const int64_t rows = std::min(most_rows, m - row0);
    const char* xs = reinterpret_cast<const char*>(x + row0 * k);
    if (aliased) {
      stage_rows(reinterpret_cast<const char*>(x + row0 * k), rows, row_bytes, staged.get(), ld_bytes);
      xs = staged.get();
    }
    const int64_t whole = rows / kTileRows * kTileRows;
    const int tail = static_cast<int>(rows - whole);
    // Blocks go in groups of up to kGroupBytes of W: for each pair of row
    // tiles, every block of the group, so a row's outputs are written
    // group x 64 bytes at a time, not 64 bytes a row and block (the lines
    // each store missed on stalled the tiles; Qwen3-0.6B's qkv at 512 rows
    // 1639 -> 1825 GFLOP/s, gate|up 1597 -> 1730, interleaved in one process
    // on a 2-core Emerald Rapids VM; the same at 64 rows), while the group's
    // blocks stay in L2 for the next pair. Then each block's partial tile,
    // before the next group: a pass for the whole tiles and another for the
    // partial one read every weight twice (a 20-row step's LM head: 2 x 311
    // MB for Qwen3-0.6B). Both tile shapes in one pass cost a
    // reconfiguration each: two a group.
    const int64_t group = std::clamp<int64_t>(kGroupBytes / (k * kBlock * 2), 1, 8);
    aioserve::parallel_pieces(blocks, 1, [&](int64_t first, int64_t last) {
      alignas(64) float out[kPassRows * kBlock];
      int configured = 0;  // the rows the tiles are configured for now
      for (int64_t g0 = first; g0 < last; g0 += group) {
        const int64_t g1 = std::min(last, g0 + group);
        if (whole > 0 && configured != kTileRows) configure_tiles(configured = kTileRows);
        for (int64_t r0 = 0; r0 < whole; r0 += kPassRows) {
          for (int64_t b = g0; b < g1; ++b) {
            const BFloat16* block = packed[b];
            const int64_t col0 = b * kBlock, cols = std::min<int64_t>(kBlock, n - col0);
            // The block after this one, fetched during the first pass over
            // this one (fetching the next group's counterpart instead left a
            // piece's first group unfetched: 7-15% slower at 1-64 rows).
            const BFloat16* next = r0 == 0 && b + 1 < last ? packed[b + 1] : nullptr;
            if (whole - r0 >= kPassRows) {
              tile_amx<2>(xs + r0 * ld_bytes, k, ld_bytes, block, out, next);
            } else {
              tile_amx<1>(xs + r0 * ld_bytes, k, ld_bytes, block, out, next);
            }
            const int valid = static_cast<int>(std::min<int64_t>(kPassRows, whole - r0));
            sink(out, valid, row0 + r0, col0, cols);
          }
        }
        if (tail > 0) {
          if (configured != tail) configure_tiles(configured = tail);
          for (int64_t b = g0; b < g1; ++b) {
            const BFloat16* block = packed[b];
            const int64_t col0 = b * kBlock, cols = std::min<int64_t>(kBlock, n - col0);
            const BFloat16* next = whole == 0 && b + 1 < last ? packed[b + 1] : nullptr;
            tile_amx<1>(xs + whole * ld_bytes, k, ld_bytes, block, out, next);
            sink(out, tail, row0 + whole, col0, cols);
          }
        }
      }
      _tile_release();
      end_streaming();
    });
  }
}
#endif

template <Form F, typename X, typename W, typename Sink>
void packed_linear_impl(const X* x, int64_t m, int64_t k, const PackedBlocks<W>& packed, int64_t n, const Sink& sink) {
  if (k == 0) {  // empty sums: every output 0 (and the bias); the passes below divide by k's bytes
    alignas(64) float zeros[kMaxRows * kBlock] = {};
    for (int64_t col0 = 0; col0 < n; col0 += kBlock) {
      for (int64_t r0 = 0; r0 < m; r0 += kMaxRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxRows, m - r0));
        sink(zeros, rows, r0, col0, std::min<int64_t>(kBlock, n - col0));
      }
    }
    return;
  }
#if defined(AIOSERVE_AMX_TILES)
  if constexpr (F == Form::kDotPairs) {
    if (k % kTileK == 0 && tiles_on()) return packed_linear_tiles(x, m, k, packed, n, sink);
  }
#endif
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  // Rows per pass over W: as many as keep their x (bf16 pairs as they are,
  // else widened to float) within kChunkBytes, then evened out, since every
  // pass streams all of W again: the LM head's 311 MB at 64 rows went as 60 +
  // 4 rows, two passes for one.
  const int64_t x_row_bytes = k * (F == Form::kDotPairs ? 2 : 4);
  const int64_t most_rows = std::max<int64_t>(kMaxRows, kChunkBytes / x_row_bytes / kMaxRows * kMaxRows);
  const int64_t passes = (m + most_rows - 1) / most_rows;
  const int64_t chunk_rows = ((m + passes - 1) / passes + kMaxRows - 1) / kMaxRows * kMaxRows;
  // The tile source's rows, in 4-byte elements (floats, or bf16 pairs). A
  // tile reads one element of each of its rows per k, and rows a multiple of
  // 4 KiB apart map to one L1 set: 12 of them overflow its 8 ways and every
  // read misses (o_proj, K = 2048 in bf16: 280-330 GFLOP/s instead of ~440;
  // float32 at K = 1024: 140 instead of 210). Such rows are copied apart.
  const int64_t row_elems = F == Form::kDotPairs ? k / 2 : k;
  const bool aliased = m > 1 && (row_elems * 4) % 4096 == 0;
  const int64_t ld = aliased ? row_elems + 16 : row_elems;
  const int64_t loop_rows = F == Form::kPlain ? k : k / 2;  // a tile's loop iterations
  const int64_t block_row_bytes = k * kBlock * static_cast<int64_t>(sizeof(W)) / loop_rows;  // NextBlockFetch's
  std::vector<uint32_t> staged;
  for (int64_t row0 = 0; row0 < m; row0 += chunk_rows) {
    const int64_t rows = std::min(chunk_rows, m - row0);
    const void* xs;
    if constexpr (F == Form::kDotPairs || std::is_same_v<X, float>) {
      xs = x + row0 * k;  // bf16 rows read as 32-bit pairs, or float32 rows: as they are
      if (aliased) {
        staged.resize(rows * ld);
        stage_rows(reinterpret_cast<const char*>(x + row0 * k), rows, row_elems * 4,
                   reinterpret_cast<char*>(staged.data()), ld * 4);
        xs = staged.data();
      }
    } else {
      staged.resize(rows * ld);
      float* x32 = reinterpret_cast<float*>(staged.data());
      aioserve::parallel_pieces(rows, kStageGrain, [&](int64_t first, int64_t last) {
        for (int64_t r = first; r < last; ++r)
          for (int64_t i = 0; i < k; ++i) x32[r * ld + i] = aioserve::to_float(x[(row0 + r) * k + i]);
      });
      xs = x32;
    }
    const char* x_bytes = static_cast<const char*>(xs);
    // Threads take contiguous runs of blocks as pieces (parallel.h): each
    // piece streams its own stretch of W.
    const int64_t tile_passes = (rows + kMaxRows - 1) / kMaxRows;
    aioserve::parallel_pieces(blocks, 1, [&](int64_t first, int64_t last) {
      alignas(64) float out[kMaxRows * kBlock];
      for (int64_t b = first; b < last; ++b) {
        const W* block = packed[b];
        const int64_t col0 = b * kBlock, cols = std::min<int64_t>(kBlock, n - col0);
        for (int64_t r0 = 0; r0 < rows; r0 += kMaxRows) {
          const int tile_h = static_cast<int>(std::min<int64_t>(kMaxRows, rows - r0));
          NextBlockFetch fetch;
          if (b + 1 < last) {  // the piece's own next block: the next piece is another thread's
            fetch = {reinterpret_cast<const char*>(packed[b + 1]), block_row_bytes, r0 / kMaxRows, tile_passes};
          }
          tile_rows<F>(tile_h, x_bytes + r0 * ld * 4, k, ld, block, out, fetch);
          sink(out, tile_h, row0 + r0, col0, cols);
        }
      }
      end_streaming();
    });
  }
}

// The packing's form: plain blocks, or bf16 k-pairs (dotted as pairs under
// bf16 math, split into floats under float32 math).
template <typename X, typename W, typename Sink>
void run_packed(const X* x, int64_t m, int64_t k, const W* weight, bool pairs, int64_t n, const Sink& sink,
                const int64_t* block_list = nullptr) {
  const PackedBlocks<W> packed{weight, k * kBlock, block_list};
  if (!pairs) {
    packed_linear_impl<Form::kPlain>(x, m, k, packed, n, sink);
  } else if constexpr (std::is_same_v<W, BFloat16>) {
    if constexpr (std::is_same_v<X, BFloat16>) {
      packed_linear_impl<Form::kDotPairs>(x, m, k, packed, n, sink);
    } else {
      packed_linear_impl<Form::kSplitPairs>(x, m, k, packed, n, sink);
    }
  }
}

}  // namespace

// W [N, K] (any strides) -> [ceil(N / NB), K, NB] in W's dtype, zero-padded
// past N; bf16 with an even K on AVX512-BF16: [ceil(N / NB), K / 2, NB, 2].
// One pass that writes the pack in order (as torch ops, zero-pad, copy and a
// transposing copy, it ran at 0.3-1.3 GB/s: 1.8 s of Qwen3-0.6B's start).
// Transparent huge pages for a fresh, untouched buffer (where the kernel
// lets a process ask: THP "madvise" mode): its first touch then faults in 2
// MiB at a time instead of 4 KiB (Qwen's 311 MB LM head: 76k faults), and
// every decode step's pass over the packed weights walks 512x fewer pages.
static void ask_for_huge_pages(void* data, int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = 2u << 20;
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1), last = (begin + nbytes) & ~(kHuge - 1);
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice: failure is harmless
#else
  (void)data;
  (void)nbytes;
#endif
}

namespace {

template <typename T>
void pack_impl(const T* w, int64_t n, int64_t k, int64_t row_stride, int64_t col_stride, bool pairs, T* out) {
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  aioserve::parallel_pieces(blocks, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      T* dst = out + b * k * kBlock;
      const int64_t cols = std::min<int64_t>(kBlock, n - b * kBlock);
      // Row by row: each row of W is read in order, and the block it is
      // written into (k x NB values) stays in L2. (Reading the block's rows
      // side by side, k by k, ran at 0.2-1 GB/s: rows a multiple of 4 KiB
      // apart share an L1 set.)
      for (int64_t c = 0; c < kBlock; ++c) {
        const T* src = c < cols ? w + (b * kBlock + c) * row_stride : nullptr;  // none: zero padding
        for (int64_t i = 0; i < k; ++i) {
          T* to = pairs ? dst + (i / 2) * 2 * kBlock + 2 * c + i % 2 : dst + i * kBlock + c;
          *to = src != nullptr ? src[i * col_stride] : T{};  // T{}: +0.0 in every type
        }
      }
    }
  });
}

}  // namespace

namespace aioserve {

bool gemm_fuses_multiply_add() { return kFused; }

bool amx_tiles_on() { return tiles_on(); }

void packed_linear(const void* x, int x_type, int64_t m, int64_t k, const void* packed, int w_type, bool pairs,
                   int64_t n, const float* bias, void* y, bool float_out) {
  AIOSERVE_CHECK(x_type != kFloat64 && w_type != kFloat64, "packed_linear: float64 is not supported");
  if (m == 0) return;
  dispatch_float(x_type, "packed_linear_x", [&](auto x_tag) {
    using X = decltype(x_tag);
    dispatch_float(w_type, "packed_linear_w", [&](auto w_tag) {
      using W = decltype(w_tag);
      const auto* xs = static_cast<const X*>(x);
      const auto* ws = static_cast<const W*>(packed);
      if (float_out) {
        run_packed(xs, m, k, ws, pairs, n, RowsOut<X, float, true>{static_cast<float*>(y), n, bias,
                                                                   streams_output(y, m, n, sizeof(float))});
      } else {
        run_packed(xs, m, k, ws, pairs, n, RowsOut<X, X, true>{static_cast<X*>(y), n, bias,
                                                               streams_output(y, m, n, sizeof(X))});
      }
    });
  });
}

// x W^T as the float32 sums themselves, for bf16 x [m, k] and a bf16 W
// packed in k-pairs (AVX512-BF16 only): not rounded to bf16 as
// packed_linear's are (the greedy screen's dot products).
void packed_linear_unrounded(const BFloat16* x, int64_t m, int64_t k, const BFloat16* packed, int64_t n, float* y) {
  AIOSERVE_CHECK(kPairs, "packed_linear_unrounded: the weight must be bf16 packed in k-pairs");
  if (m > 0) {
    packed_linear_impl<Form::kDotPairs>(x, m, k, PackedBlocks<BFloat16>{packed, k * kBlock}, n,
                                        RowsOut<BFloat16, float, false>{y, n, nullptr});
  }
}

// Each row's largest output of x W^T (+ b) as packed_linear's float_out holds
// it, and its first column (a NaN's, if any): row_max_argmax of those
// logits, without them. Each block's best per row, then the blocks in
// column order (later_max_wins, vec_math.h). With a block list, W is the
// listed blocks side by side (n their columns), as they lie in `packed`.
void packed_linear_argmax(const void* x, int x_type, int64_t m, int64_t k, const void* packed, int w_type, bool pairs,
                          int64_t n, const float* bias, float* max_out, int64_t* arg_out, const int64_t* block_list) {
  AIOSERVE_CHECK(x_type != kFloat64 && w_type != kFloat64, "packed_linear_argmax: float64 is not supported");
  AIOSERVE_CHECK(n > 0 && n <= std::numeric_limits<int32_t>::max(), "packed_linear_argmax: bad N");
  if (m == 0) return;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  std::unique_ptr<float[]> best(new float[blocks * m]);
  std::unique_ptr<int32_t[]> column(new int32_t[blocks * m]);
  dispatch_float(x_type, "packed_linear_argmax_x", [&](auto x_tag) {
    using X = decltype(x_tag);
    dispatch_float(w_type, "packed_linear_argmax_w", [&](auto w_tag) {
      using W = decltype(w_tag);
      run_packed(static_cast<const X*>(x), m, k, static_cast<const W*>(packed), pairs, n,
                 BlockArgmax<X>{best.get(), column.get(), m, bias}, block_list);
    });
  });
  for (int64_t r = 0; r < m; ++r) {
    float top = best[r];
    int64_t where = column[r];
    for (int64_t b = 1; b < blocks; ++b) {
      if (aioserve::later_max_wins(top, best[b * m + r])) {
        top = best[b * m + r];
        where = column[b * m + r];
      }
    }
    max_out[r] = top;
    arg_out[r] = where;
  }
}

}  // namespace aioserve

extern "C" {

int64_t aioserve_gemm_block_width() { return kBlock; }

int aioserve_gemm_packs_bf16_pairs() { return kPairs ? 1 : 0; }

int aioserve_gemm_fuses_multiply_add() { return kFused ? 1 : 0; }

// Let bf16 products through the AMX tiles (want != 0) or keep them on the
// pair dots; returns whether the tiles are now in use (built, permitted by
// the OS, and wanted). Process-wide.
int aioserve_gemm_use_tiles(int want) {
  tiles_wanted.store(want != 0, std::memory_order_relaxed);
  return tiles_on() ? 1 : 0;
}

// Whether bf16 products run on the tiles now (built, permitted, wanted).
int aioserve_gemm_tiles_in_use() { return tiles_on() ? 1 : 0; }

// out: a fresh buffer of ceil(n / NB) * k * NB elements of W's type.
static int pack_linear_weight_direct(const void* weight, int type, int64_t n, int64_t k, int64_t row_stride,
                                int64_t col_stride, int pairs, void* out, int64_t out_bytes) {
  return aioserve::guarded([&] {
    ask_for_huge_pages(out, out_bytes);
    switch (type) {
      case aioserve::kFloat32:
        return pack_impl(static_cast<const float*>(weight), n, k, row_stride, col_stride, pairs, static_cast<float*>(out));
      case aioserve::kBFloat16:
        return pack_impl(static_cast<const BFloat16*>(weight), n, k, row_stride, col_stride, pairs,
                         static_cast<BFloat16*>(out));
      case aioserve::kFloat16:
        return pack_impl(static_cast<const Half*>(weight), n, k, row_stride, col_stride, pairs, static_cast<Half*>(out));
      case aioserve::kFloat64:
        return pack_impl(static_cast<const double*>(weight), n, k, row_stride, col_stride, pairs,
                         static_cast<double*>(out));
      default: aioserve::fail("pack_linear_weight: unsupported dtype");
    }
  });
}

static int packed_linear_direct(const void* x, int x_type, int64_t m, int64_t k, const void* packed, int w_type, int pairs,
                           int64_t n, const float* bias, void* y, int float_out) {
  return aioserve::guarded(
      [&] { aioserve::packed_linear(x, x_type, m, k, packed, w_type, pairs != 0, n, bias, y, float_out != 0); });
}

static int packed_linear_argmax_direct(const void* x, int x_type, int64_t m, int64_t k, const void* packed, int w_type,
                                       int pairs, int64_t n, const float* bias, float* max_out, int64_t* arg_out) {
  return aioserve::guarded([&] {
    aioserve::packed_linear_argmax(x, x_type, m, k, packed, w_type, pairs != 0, n, bias, max_out, arg_out);
  });
}

}  // extern "C"

extern "C" {

int aioserve_pack_linear_weight(const void* record) { return aioserve::call_packed(pack_linear_weight_direct, record); }
int aioserve_packed_linear(const void* record) { return aioserve::call_packed(packed_linear_direct, record); }
int aioserve_packed_linear_argmax(const void* record) {
  return aioserve::call_packed(packed_linear_argmax_direct, record);
}

}  // extern "C"
