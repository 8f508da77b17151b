// The 4-bit matmul of int4_dot.cpp as a plain function, for native code that calls it between
// its own steps (decode_layers.cpp) without a tensor per call.
#pragma once

#include <cstdint>

namespace specdec {

constexpr int64_t kBlockOut = 64;  // outputs per block of the packed layout

// out [rows, blocks * 64] = x [rows, K] @ W^T, bf16 in and out, W in int4_dot.cpp's packed layout
// (codes [blocks, K / 4, 128], scales and offsets [blocks, K / group_size, 2, 64]). `scratch`
// holds `int4_dot_scratch(rows, K, group_size)` floats. Runs on at::parallel_for's threads.
void int4_dot(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* scales,
              int64_t blocks, int64_t group_size, uint16_t* out, float* scratch);

inline int64_t int4_dot_scratch(int64_t rows, int64_t K, int64_t group_size) {
  return rows * (K / group_size + K);  // each row's group sums, then the row in fp32 (AVX2 build)
}

// The calling thread's buffer of at least `count` floats, grown once and then reused.
float* scratch_floats(int64_t count);

}  // namespace specdec
