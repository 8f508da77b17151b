// The 4-bit matmul of int4_dot.cpp as a plain function, for native code that calls it between
// its own steps (decode_layers.cpp) without a tensor per call, and the bf16 conversions both use.
#pragma once

#include <cstdint>
#include <cstring>

namespace specdec {

constexpr int64_t kBlockOut = 64;  // outputs per block of the packed layout

inline float bf16_to_float(uint16_t bits) { return __builtin_bit_cast(float, uint32_t(bits) << 16); }

// fp32 -> bf16, rounding to nearest even (a NaN stays a NaN), as torch's casts do.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x40);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

// out [rows, blocks * 64] = x [rows, K] @ W^T, bf16 in and out, W in int4_dot.cpp's packed layout
// (codes [blocks, K / 4, 128], scales and offsets [blocks, K / group_size, 2, 64]). `scratch`
// holds `int4_dot_scratch(rows, K, group_size)` floats. Runs on at::parallel_for's threads.
void int4_dot(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* scales,
              int64_t blocks, int64_t group_size, uint16_t* out, float* scratch);

// int4_dot in two parts, for a caller that splits the blocks over threads it already runs:
// `int4_dot_prepare` fills `scratch` from x (each thread its own, or one shared once ready),
// `int4_dot_blocks` computes the output blocks [first, last) on the calling thread.
void int4_dot_prepare(const uint16_t* x, int64_t rows, int64_t K, int64_t group_size, float* scratch);
void int4_dot_blocks(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* scales,
                     int64_t blocks, int64_t group_size, uint16_t* out, const float* scratch, int64_t first,
                     int64_t last);

inline int64_t int4_dot_scratch(int64_t rows, int64_t K, int64_t group_size) {
  return rows * (K / group_size + K);  // each row's group sums, then the row in fp32 (AVX2 build)
}

// The calling thread's buffer of at least `count` floats, grown once and then reused.
float* scratch_floats(int64_t count);

}  // namespace specdec
