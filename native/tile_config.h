// The AMX tile configuration that _tile_loadconfig reads (palette 1): for
// each of the 16 tile registers its bytes per row and its rows. Shared by
// gemm.cpp's matmul tiles and prefill_attention.cpp's.
#pragma once

#include <cstdint>

namespace aioserve {

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

}  // namespace aioserve
