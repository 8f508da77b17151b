// What the native decode step's two files share (decode_layers.cpp, decode_attention.cpp):
// a thread's share of a phase, and 16 floats in one vector with the fp32 math done on them.
// GCC's vector extensions compile a vector to one zmm register with AVX-512, two ymm with
// AVX2, so one source serves both builds.
#pragma once

#include <cstdint>
#include <cstring>
#include <utility>

namespace specdec {

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
constexpr int64_t kLanes = 16;

// Thread `me` of `team`'s even share [first, last) of `n` items.
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t me, int64_t team) {
  return {n * me / team, n * (me + 1) / team};
}

inline f32x16 load_bf16x16(const uint16_t* p) {
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  return (f32x16)(__builtin_convertvector(half, u32x16) << 16);
}

// Each lane rounded to bf16 (nearest even; a NaN stays a NaN), as `float_to_bf16` does.
inline u16x16 to_bf16x16(f32x16 v) {
  const u32x16 bits = (u32x16)v;
  const u32x16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  const u32x16 nan = (bits >> 16) | 0x40u;
  return __builtin_convertvector((bits & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded, u16x16);
}

inline void store_bf16x16(uint16_t* p, f32x16 v) {
  const u16x16 half = to_bf16x16(v);
  std::memcpy(p, &half, sizeof half);
}

// The sum of the 16 lanes as a tree of halves (a loop over the lanes would add them one after
// another: a chain of 16 dependent additions per score).
inline float sum_lanes(f32x16 v) {
  const f32x8 eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// e^x in each lane, to about 2 fp32 ulp (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in
// r, 2^n put into the exponent), 0 below e^-87 (a masked score's weight); std::exp one value
// at a time was half of a step's attention and SiLU.
inline f32x16 exp16(f32x16 x) {
  const f32x16 low = x < -87.0f ? f32x16{} + 1.0f : f32x16{};  // 1 where the result is 0
  x = x < -87.0f ? f32x16{} - 87.0f : x;
  x = x > 88.0f ? f32x16{} + 88.0f : x;
  const f32x16 shift = f32x16{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const f32x16 n = (x * 1.44269504088896341f + shift) - shift;
  const f32x16 r = x - n * 0.693359375f + n * 2.12194440e-4f;
  f32x16 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x16 bits = (__builtin_convertvector(n, i32x16) + 127) << 23;
  const f32x16 result = p * (f32x16)bits;
  return low != 0.0f ? f32x16{} : result;
}

}  // namespace specdec
