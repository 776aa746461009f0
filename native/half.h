// The half-precision element types and their conversions to and from
// float32, without torch's headers (which made each file take ~40 s to
// compile: see aioserve/cpu/native.py).
//
// bf16: widening is a shift; narrowing rounds to nearest even and a NaN
// stays a quiet NaN, the bits torch's c10::BFloat16 gives, in code the
// compiler vectorizes (c10's compiles to a branch and a call per element).
// fp16: the conversion instructions where the CPU has them (F16C), as c10's
// Half uses under -march=native; elsewhere the same exact bit manipulation
// as c10's portable code.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace aioserve {

// Storage types: a bf16 or fp16 value's 16 bits (layout-compatible with torch's).
struct BFloat16 {
  uint16_t x;
};
struct Half {
  uint16_t x;
};
// An FP8 KV cache's element (torch.float8_e4m3fn): sign, 4 exponent bits
// (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN, +-448 the
// largest finite value.
struct Float8E4M3 {
  uint8_t x;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bf16_bits_to_float(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

inline uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_to_bits(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return f != f ? static_cast<uint16_t>(0x7fc0) : static_cast<uint16_t>(rounded);
}

inline float fp16_bits_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  // c10's fp16_ieee_to_fp32_value: normal numbers by an exponent shift and a
  // scale, subnormals by a magic-number subtraction.
  const uint32_t w = static_cast<uint32_t>(h) << 16, sign = w & 0x80000000u, two_w = w + w;
  const float normalized = bits_to_float((two_w >> 4) + (0xE0u << 23)) * bits_to_float(0x7800000u);
  const float denormalized = bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t result = sign | (two_w < (1u << 27) ? float_to_bits(denormalized) : float_to_bits(normalized));
  return bits_to_float(result);
#endif
}

inline uint16_t float_to_fp16_bits(float f) {
#if defined(__F16C__)
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
  // c10's fp16_ieee_from_fp32_value.
  float base = (std::fabs(f) * bits_to_float(239u << 23)) * bits_to_float(17u << 23);
  const uint32_t w = float_to_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  if (bias < 0x71000000u) bias = 0x71000000u;
  base = bits_to_float((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
#endif
}

inline float fp8_e4m3_bits_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80u) << 24, exponent = (b >> 3) & 0xFu, mantissa = b & 7u;
  if (exponent == 0xFu && mantissa == 7u) return bits_to_float(sign | 0x7FC00000u);  // NaN
  if (exponent == 0) return bits_to_float(sign | float_to_bits(static_cast<float>(mantissa) * 0x1p-9f));
  return bits_to_float(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

// Round to nearest even, saturated at +-448 (what the KV pool's
// to_cache_dtype does before torch's cast: aioserve/kvcache/kv_pool.py); a
// NaN stays a NaN. Bit arithmetic the compiler vectorizes (frexp and
// nearbyint made the KV store of a batch-64 decode step cost ~25 ms):
// normal values round their mantissa to 3 bits as float_to_bf16_bits does
// to 7; below 2^-6, value x 2^9 rounds to the subnormal's integer by the
// float add of 2^23 (exact RNE for anything under 2^22).
inline uint8_t float_to_fp8_e4m3_bits(float f) {
  const uint32_t u = float_to_bits(f), magnitude = u & 0x7FFFFFFFu;
  const uint32_t sign = (u >> 24) & 0x80u;
  const float a = std::fmin(bits_to_float(magnitude), 1.f);  // (the subnormal's form, computed for every value)
  const uint32_t subnormal = static_cast<uint32_t>((a * 512.f + 8388608.f) - 8388608.f);
  const uint32_t normal = ((magnitude + 0x7FFFFu + ((magnitude >> 20) & 1u)) >> 20) - (120u << 3);
  const uint32_t bits = magnitude > 0x7F800000u ? 0x7Fu                 // NaN
                        : magnitude >= 0x43E00000u ? 0x7Eu              // 448 and beyond: saturated
                        : magnitude < 0x3C800000u ? subnormal : normal;  // below 2^-6: subnormal
  return static_cast<uint8_t>(sign | bits);
}

// T (float, double, BFloat16, Half or Float8E4M3) to float32 and back.
template <typename T>
inline float to_float(T v) { return static_cast<float>(v); }
template <>
inline float to_float<BFloat16>(BFloat16 v) { return bf16_bits_to_float(v.x); }
template <>
inline float to_float<Half>(Half v) { return fp16_bits_to_float(v.x); }
template <>
inline float to_float<Float8E4M3>(Float8E4M3 v) { return fp8_e4m3_bits_to_float(v.x); }

template <typename T>
inline T from_float(float v) { return static_cast<T>(v); }
template <>
inline BFloat16 from_float<BFloat16>(float v) { return BFloat16{float_to_bf16_bits(v)}; }
template <>
inline Half from_float<Half>(float v) { return Half{float_to_fp16_bits(v)}; }
template <>
inline Float8E4M3 from_float<Float8E4M3>(float v) { return Float8E4M3{float_to_fp8_e4m3_bits(v)}; }

// A float32 result as torch leaves it in a T tensor (a no-op for float).
template <typename T>
inline float round_to(float v) { return to_float(from_float<T>(v)); }

}  // namespace aioserve
