// Conversions between float32 and bfloat16 that the compiler vectorizes.
// c10::BFloat16's own are exact but compile to scalar code (a NaN branch
// and a call per element): a bf16 model's elementwise kernels ran 9-40x
// slower than their float32 twins, and every packed matmul wrote its bf16
// output one element at a time. These give the same bits: widening is a
// shift, narrowing rounds to nearest even, and a NaN stays a quiet NaN.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace aioserve {

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

// T (float, c10::BFloat16 or c10::Half) to float32 and back.
template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }
template <>
inline float to_float<c10::BFloat16>(c10::BFloat16 v) { return bf16_bits_to_float(v.x); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float v) {
  return c10::BFloat16(float_to_bf16_bits(v), c10::BFloat16::from_bits());
}

// A float32 result as torch leaves it in a T tensor (a no-op for float).
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

}  // namespace aioserve
