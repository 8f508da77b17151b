// A 4-bit group-wise weight-only matmul for x86-64 CPUs: y = x @ W^T, x and y bfloat16.
//
// Why not `_weight_int4pack_mm_for_cpu`: for the decode-shaped calls a draft makes (1-4 rows),
// that kernel dequantizes every weight to fp32 (a table lookup and a multiply-add) before its
// multiply-add with x, and is compute-bound: it reads its weights far below memory bandwidth
// (docs/performance.md#int4-kernels). This kernel applies the scale and the offset once per
// group of `group_size` inputs, not per weight, and comes in two builds, one per instruction set
// (the compiler's flags pick it):
//
//   * AVX-512 BF16: a 4-bit code q becomes the bf16 number 128 + q by OR-ing it into 0x4300
//     (bf16 has 7 mantissa bits, so 128 + q is exact), and `vdpbf16ps` multiplies 32 such
//     weights with a pair of x values and adds them, in fp32, in one instruction:
//     sum_k ((q_k - 8) * s + o) * x_k = s * sum_k (128 + q_k) * x_k + (o - 136 * s) * sum_k x_k.
//     It runs at memory speed (~25 GB/s there, the weights streamed in order with software
//     prefetch) and 2.2-2.4x the packed kernel's speed from cache.
//   * AVX2 and FMA (no bf16 arithmetic): each code becomes an fp32 integer (a shift, a mask and
//     a conversion for 8 codes) and one FMA multiplies 8 of them with a broadcast x value:
//     sum_k ((q_k - 8) * s + o) * x_k = s * sum_k q_k * x_k + (o - 8 * s) * sum_k x_k.
//
// (s, o) are the bf16 scale and offset `_weight_int4pack_mm_for_cpu` takes, so every kernel
// computes the same sum, up to fp32 rounding.
//
// Layout (built by `specdec.model.int4_dot.pack`), for N outputs, K inputs, groups of `gs`:
//   packed [N / 64, K / 4, 128] uint8: for each block of 64 outputs and each 4 inputs
//     k..k+3, four 32-byte pieces, one per 16 outputs; byte 2i holds output i's codes for
//     k (low nibble) and k + 2 (high), byte 2i + 1 those for k + 1 and k + 3.
//   sz [N / 64, K / gs, 2, 64] bf16: each block's scales, then its offsets, per group.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include "int4_dot.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using specdec::bf16_to_float;
using specdec::float_to_bf16;
using specdec::kBlockOut;
constexpr int64_t kChunkBytes = 128;  // one block's codes for 4 inputs
constexpr int64_t kPrefetchChunks = 8;
constexpr int kMaxRows = 4;

// One block of 64 outputs for 1..kMaxRows rows: (x as bf16, x as fp32, ld_x, x_sums, ld_sums,
// codes, scales and offsets, y, ld_y, groups, chunks_per_group); each build reads one of the x.
using BlockFn = void (*)(const uint16_t*, const float*, int64_t, const float*, int64_t, const uint8_t*,
                         const uint16_t*, uint16_t*, int64_t, int64_t, int64_t);

#if defined(__AVX512BF16__)

inline __m512 bf16_to_fp32(const uint16_t* p) {  // 16 bf16 -> 16 fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// x[k], x[k+1] (two bf16, any alignment) in every 32-bit lane, broadcast straight from memory:
// copied through a general register instead (as a memcpy into int32 compiled), each
// broadcast also cost a register-to-vector move on the vector pipes the products need.
inline __m512i broadcast_pair(const uint16_t* p) { return _mm512_broadcastd_epi32(_mm_loadu_si32(p)); }

// Each row's (x[k], x[k+1]) and (x[k+2], x[k+3]) for the 4 inputs of chunk c.
template <int ROWS>
inline void load_x_pairs(const uint16_t* x, int64_t ld_x, int64_t c, __m512i (&x01)[ROWS], __m512i (&x23)[ROWS]) {
  for (int r = 0; r < ROWS; ++r) {
    x01[r] = broadcast_pair(x + r * ld_x + 4 * c);
    x23[r] = broadcast_pair(x + r * ld_x + 4 * c + 2);
  }
}

// 16 outputs' codes for 4 inputs (32 bytes) as bf16 128 + q: inputs k, k+1 in `lo`, k+2, k+3 in `hi`.
inline void expand_codes(const uint8_t* piece, __m512i& lo, __m512i& hi) {
  const __m512i nibble = _mm512_set1_epi16(0x000F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);
  __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)piece));
  lo = _mm512_ternarylogic_epi32(bytes, nibble, bf16_128, 0xEA);  // (bytes & 0xF) | 0x4300
  hi = _mm512_or_si512(_mm512_srli_epi16(bytes, 4), bf16_128);
}

// One block of 64 outputs for ROWS rows of x.
template <int ROWS>
void block(const uint16_t* x, const float*, int64_t ld_x, const float* x_sums, int64_t ld_sums, const uint8_t* codes,
           const uint16_t* sz, uint16_t* y, int64_t ld_y, int64_t groups, int64_t chunks_per_group) {
  const __m512 minus_136 = _mm512_set1_ps(-136.0f);
  __m512 out[ROWS][4];
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j) out[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    // Two accumulators per output register (low and high nibbles) keep the dependency chains short.
    __m512 lo_acc[ROWS][4], hi_acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) lo_acc[r][j] = hi_acc[r][j] = _mm512_setzero_ps();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      const uint8_t* chunk = codes + c * kChunkBytes;
      _mm_prefetch((const char*)(chunk + kPrefetchChunks * kChunkBytes), _MM_HINT_T0);
      _mm_prefetch((const char*)(chunk + kPrefetchChunks * kChunkBytes + 64), _MM_HINT_T0);
      __m512i x01[ROWS], x23[ROWS];  // (x[k], x[k+1]) and (x[k+2], x[k+3]) in every 32-bit lane
      load_x_pairs<ROWS>(x, ld_x, c, x01, x23);
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        expand_codes(chunk + 32 * j, lo, hi);
        for (int r = 0; r < ROWS; ++r) {
          lo_acc[r][j] = _mm512_dpbf16_ps(lo_acc[r][j], (__m512bh)lo, (__m512bh)x01[r]);
          hi_acc[r][j] = _mm512_dpbf16_ps(hi_acc[r][j], (__m512bh)hi, (__m512bh)x23[r]);
        }
      }
    }
    const uint16_t* scales = sz + g * 2 * kBlockOut;
    for (int j = 0; j < 4; ++j) {
      __m512 s = bf16_to_fp32(scales + 16 * j);
      __m512 zero = _mm512_fmadd_ps(s, minus_136, bf16_to_fp32(scales + kBlockOut + 16 * j));
      for (int r = 0; r < ROWS; ++r) {
        out[r][j] = _mm512_fmadd_ps(s, _mm512_add_ps(lo_acc[r][j], hi_acc[r][j]), out[r][j]);
        out[r][j] = _mm512_fmadd_ps(zero, _mm512_set1_ps(x_sums[r * ld_sums + g]), out[r][j]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(y + r * ld_y + 16 * j), (__m256i)_mm512_cvtneps_pbh(out[r][j]));
}

// `block` for 3-4 rows, within the 32 zmm registers: `block`'s accumulators (12 zmm a row)
// spilled to the stack past two rows (190 vmovaps in block<4>, which ran at ~45 % of the
// CPU's vdpbf16ps rate). Here the low- and high-nibble products share one accumulator per
// row and 16 outputs, and the scaled sums live in a small fp32 buffer in L1, updated once
// per group: 4 zmm a row for the accumulators, 2 for the row's x pairs. The loop order is
// `block`'s (x broadcast once per 4 inputs, each 16 outputs' codes expanded once for all
// rows). Results equal `block`'s up to fp32 rounding order.
template <int ROWS>
void block_lean(const uint16_t* x, const float*, int64_t ld_x, const float* x_sums, int64_t ld_sums,
                const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t ld_y, int64_t groups,
                int64_t chunks_per_group) {
  const __m512 minus_136 = _mm512_set1_ps(-136.0f);
  alignas(64) float out[ROWS][kBlockOut] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      const uint8_t* chunk = codes + c * kChunkBytes;
      _mm_prefetch((const char*)(chunk + kPrefetchChunks * kChunkBytes), _MM_HINT_T0);
      _mm_prefetch((const char*)(chunk + kPrefetchChunks * kChunkBytes + 64), _MM_HINT_T0);
      __m512i x01[ROWS], x23[ROWS];
      load_x_pairs<ROWS>(x, ld_x, c, x01, x23);
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        expand_codes(chunk + 32 * j, lo, hi);
        for (int r = 0; r < ROWS; ++r) {
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)lo, (__m512bh)x01[r]);
          acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)hi, (__m512bh)x23[r]);
        }
      }
    }
    const uint16_t* scales = sz + g * 2 * kBlockOut;
    for (int j = 0; j < 4; ++j) {
      __m512 s = bf16_to_fp32(scales + 16 * j);
      __m512 zero = _mm512_fmadd_ps(s, minus_136, bf16_to_fp32(scales + kBlockOut + 16 * j));
      for (int r = 0; r < ROWS; ++r) {
        __m512 sum = _mm512_fmadd_ps(s, acc[r][j], _mm512_load_ps(out[r] + 16 * j));
        _mm512_store_ps(out[r] + 16 * j, _mm512_fmadd_ps(zero, _mm512_set1_ps(x_sums[r * ld_sums + g]), sum));
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(y + r * ld_y + 16 * j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(out[r] + 16 * j)));
}

constexpr BlockFn kBlockFns[kMaxRows] = {block<1>, block<2>, block_lean<3>, block_lean<4>};
constexpr bool kReadsFp32X = false;  // these blocks read x as bf16 pairs

#elif defined(__AVX2__) && defined(__FMA__)

inline __m256 bf16x8_to_fp32(const uint16_t* p) {  // 8 bf16 -> 8 fp32
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// 16 outputs' codes for 4 inputs (one 32-byte piece) as two vectors of 8 words, one output
// each: k in bits 0-3, k + 2 in bits 4-7, k + 1 in bits 8-11, k + 3 in bits 12-15.
inline void load_piece(const uint8_t* piece, __m256i& first, __m256i& second) {
  first = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)piece));
  second = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(piece + 16)));
}

// The codes of input k + T as 8 fp32 integers 0..15.
template <int T>
inline __m256 codes_of(__m256i words) {
  constexpr int kShift[4] = {0, 8, 4, 12};  // where input k + T's nibble sits in a word
  const __m256i nibble = _mm256_set1_epi32(0xF);
  if constexpr (kShift[T] == 0) return _mm256_cvtepi32_ps(_mm256_and_si256(words, nibble));
  if constexpr (kShift[T] == 12) return _mm256_cvtepi32_ps(_mm256_srli_epi32(words, 12));  // the top nibble
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(words, kShift[T]), nibble));
}

template <int T, int ROWS, int PIECES>
inline void multiply_input(const float* x, int64_t ld_x, int64_t k, const __m256i (&words)[PIECES][2],
                           __m256 (&acc)[ROWS][PIECES][2]) {
  for (int p = 0; p < PIECES; ++p) {
    const __m256 first = codes_of<T>(words[p][0]), second = codes_of<T>(words[p][1]);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xk = _mm256_broadcast_ss(x + r * ld_x + k + T);
      acc[r][p][0] = _mm256_fmadd_ps(first, xk, acc[r][p][0]);
      acc[r][p][1] = _mm256_fmadd_ps(second, xk, acc[r][p][1]);
    }
  }
}

// Pieces first_piece..first_piece + PIECES - 1 (16 outputs each) of one block for ROWS rows,
// added into out [ROWS][64]: PIECES * ROWS <= 4 keeps the 2 accumulators of each in the 16
// ymm registers with the codes.
template <int ROWS, int PIECES>
void pieces(const float* x, int64_t ld_x, const float* x_sums, int64_t ld_sums, const uint8_t* codes,
            const uint16_t* sz, float (*out)[kBlockOut], int first_piece, int64_t groups, int64_t chunks_per_group) {
  for (int64_t g = 0; g < groups; ++g) {
    __m256 acc[ROWS][PIECES][2];
    for (int r = 0; r < ROWS; ++r)
      for (int p = 0; p < PIECES; ++p) acc[r][p][0] = acc[r][p][1] = _mm256_setzero_ps();
    for (int64_t c = g * chunks_per_group; c < (g + 1) * chunks_per_group; ++c) {
      const uint8_t* piece = codes + c * kChunkBytes + 32 * first_piece;
      _mm_prefetch((const char*)(piece + kPrefetchChunks * kChunkBytes), _MM_HINT_T0);
      __m256i words[PIECES][2];
      for (int p = 0; p < PIECES; ++p) load_piece(piece + 32 * p, words[p][0], words[p][1]);
      multiply_input<0>(x, ld_x, 4 * c, words, acc);
      multiply_input<1>(x, ld_x, 4 * c, words, acc);
      multiply_input<2>(x, ld_x, 4 * c, words, acc);
      multiply_input<3>(x, ld_x, 4 * c, words, acc);
    }
    const uint16_t* scales = sz + g * 2 * kBlockOut;
    for (int p = 0; p < PIECES; ++p) {
      for (int h = 0; h < 2; ++h) {
        const int o = 16 * (first_piece + p) + 8 * h;
        const __m256 s = bf16x8_to_fp32(scales + o);
        const __m256 offset = bf16x8_to_fp32(scales + kBlockOut + o);
        const __m256 zero = _mm256_fnmadd_ps(s, _mm256_set1_ps(8.0f), offset);  // o - 8 s
        for (int r = 0; r < ROWS; ++r) {
          __m256 sum = _mm256_fmadd_ps(s, acc[r][p][h], _mm256_loadu_ps(out[r] + o));
          _mm256_storeu_ps(out[r] + o, _mm256_fmadd_ps(zero, _mm256_set1_ps(x_sums[r * ld_sums + g]), sum));
        }
      }
    }
  }
}

// One block of 64 outputs for ROWS rows of x (fp32), a pass over the block's codes per
// PIECES pieces: the later passes find the block's codes (K / 4 * 128 bytes) in L2.
template <int ROWS>
void avx2_block(const uint16_t*, const float* x, int64_t ld_x, const float* x_sums, int64_t ld_sums,
                const uint8_t* codes, const uint16_t* sz, uint16_t* y, int64_t ld_y, int64_t groups,
                int64_t chunks_per_group) {
  constexpr int kPieces = 4 / ROWS;  // 4, 2, 1, 1
  alignas(32) float out[ROWS][kBlockOut] = {};
  for (int first = 0; first < 4; first += kPieces)
    pieces<ROWS, kPieces>(x, ld_x, x_sums, ld_sums, codes, sz, out, first, groups, chunks_per_group);
  for (int r = 0; r < ROWS; ++r)
    for (int o = 0; o < kBlockOut; ++o) y[r * ld_y + o] = float_to_bf16(out[r][o]);
}
constexpr BlockFn kBlockFns[kMaxRows] = {avx2_block<1>, avx2_block<2>, avx2_block<3>, avx2_block<4>};
constexpr bool kReadsFp32X = true;

#else
#error "int4_dot.cpp needs AVX-512 BF16, or AVX2 and FMA"
#endif

}  // namespace

namespace specdec {

void int4_dot_prepare(const uint16_t* x_bf16, int64_t rows, int64_t K, int64_t group_size, float* scratch) {
  const int64_t groups = K / group_size;
  float* x_sums = scratch;                                          // [rows, groups]: sum of x over each group
  float* x_f32 = kReadsFp32X ? scratch + rows * groups : nullptr;  // [rows, K]: where the AVX2 blocks broadcast x
  for (int64_t i = 0; i < rows * groups; ++i) {
    float sum = 0.0f;
    for (int64_t k = 0; k < group_size; ++k) {
      const float value = bf16_to_float(x_bf16[i * group_size + k]);
      if (kReadsFp32X) x_f32[i * group_size + k] = value;
      sum += value;
    }
    x_sums[i] = sum;
  }
}

void int4_dot_blocks(const uint16_t* x_bf16, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* scales,
                     int64_t blocks, int64_t group_size, uint16_t* out, const float* scratch, int64_t first,
                     int64_t last) {
  const int64_t N = blocks * kBlockOut, groups = K / group_size, chunks = K / 4;
  const float* x_sums = scratch;
  const float* x_f32 = kReadsFp32X ? scratch + rows * groups : nullptr;
  for (int64_t b = first; b < last; ++b) {
    for (int64_t r = 0; r < rows; r += kMaxRows) {
      const int64_t n = std::min<int64_t>(kMaxRows, rows - r);
      const float* x_rows = kReadsFp32X ? x_f32 + r * K : nullptr;
      kBlockFns[n - 1](x_bf16 + r * K, x_rows, K, x_sums + r * groups, groups, codes + b * chunks * kChunkBytes,
                       scales + b * groups * 2 * kBlockOut, out + r * N + b * kBlockOut, N, groups, group_size / 4);
    }
  }
}

void int4_dot(const uint16_t* x_bf16, int64_t rows, int64_t K, const uint8_t* codes, const uint16_t* scales,
              int64_t blocks, int64_t group_size, uint16_t* out, float* scratch) {
  int4_dot_prepare(x_bf16, rows, K, group_size, scratch);
  at::parallel_for(0, blocks, 0, [&](int64_t begin, int64_t end) {
    int4_dot_blocks(x_bf16, rows, K, codes, scales, blocks, group_size, out, scratch, begin, end);
  });
}

float* scratch_floats(int64_t count) {
  thread_local std::vector<float> buffer;
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

}  // namespace specdec

namespace {

at::Tensor int4_dot_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t group_size) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.device().is_cpu(),
              "int4_dot_mm: x must be a contiguous 2-D bfloat16 CPU tensor");
  const int64_t rows = x.size(0), K = x.size(1);
  TORCH_CHECK(group_size > 0 && group_size % 4 == 0 && K % group_size == 0, "int4_dot_mm: bad group_size ",
              group_size, " for ", K, " inputs");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
                  packed.size(1) == K / 4 && packed.size(2) == kChunkBytes,
              "int4_dot_mm: packed must be contiguous uint8 [N / 64, K / 4, 128]");
  const int64_t blocks = packed.size(0), N = blocks * kBlockOut, groups = K / group_size;
  TORCH_CHECK(sz.scalar_type() == at::kBFloat16 && sz.is_contiguous() && sz.numel() == blocks * groups * 2 * kBlockOut,
              "int4_dot_mm: sz must be contiguous bfloat16 [N / 64, K / group_size, 2, 64]");
  at::Tensor y = at::empty({rows, N}, x.options());
  if (rows == 0 || N == 0) return y;
  specdec::int4_dot(reinterpret_cast<const uint16_t*>(x.const_data_ptr()), rows, K, packed.const_data_ptr<uint8_t>(),
                    reinterpret_cast<const uint16_t*>(sz.const_data_ptr()), blocks, group_size,
                    reinterpret_cast<uint16_t*>(y.data_ptr()),
                    specdec::scratch_floats(specdec::int4_dot_scratch(rows, K, group_size)));
  return y;
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("int4_dot_mm(Tensor x, Tensor packed, Tensor sz, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("int4_dot_mm", &int4_dot_mm);
}
