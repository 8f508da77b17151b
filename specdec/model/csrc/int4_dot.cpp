// A 4-bit group-wise weight-only matmul for CPUs with AVX-512 BF16: y = x @ W^T.
//
// Why not `_weight_int4pack_mm_for_cpu`: for the decode-shaped calls a draft makes (1-4 rows),
// that kernel dequantizes every weight to fp32 (a table lookup and a multiply-add) before its
// multiply-add with x, and is compute-bound: it reads its weights far below memory bandwidth
// (docs/performance.md#int4-kernels). This kernel does no per-weight float arithmetic:
//
//   * a 4-bit code q becomes the bf16 number 128 + q by OR-ing it into 0x4300 (bf16 has 7
//     mantissa bits, so 128 + q is exact), and `vdpbf16ps` multiplies 32 such weights with a
//     pair of x values and adds them, in fp32, in one instruction;
//   * the scale, the zero and the +128 are applied once per group of `group_size` inputs:
//     sum_k ((q_k - 8) * s + o) * x_k = s * sum_k (128 + q_k) * x_k + (o - 136 * s) * sum_k x_k,
//     with (s, o) the bf16 scale and offset `_weight_int4pack_mm_for_cpu` takes, so both
//     kernels compute the same sum, up to fp32 rounding.
//
// It then runs at memory speed (~25 GB/s there, the weights streamed in order with software
// prefetch) and 2.2-2.4x the packed kernel's speed from cache.
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

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlockOut = 64;     // outputs per block: four zmm registers of 16 fp32
constexpr int64_t kChunkBytes = 128;  // one block's codes for 4 inputs
constexpr int64_t kPrefetchChunks = 8;
constexpr int kMaxRows = 4;

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
void block(const uint16_t* x, int64_t ld_x, const float* x_sums, int64_t ld_sums, const uint8_t* codes,
           const uint16_t* sz, uint16_t* y, int64_t ld_y, int64_t chunks, int64_t groups, int64_t chunks_per_group) {
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
void block_lean(const uint16_t* x, int64_t ld_x, const float* x_sums, int64_t ld_sums, const uint8_t* codes,
                const uint16_t* sz, uint16_t* y, int64_t ld_y, int64_t chunks, int64_t groups, int64_t chunks_per_group) {
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

using BlockFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*, const uint16_t*, uint16_t*,
                         int64_t, int64_t, int64_t, int64_t);
constexpr BlockFn kBlockFns[kMaxRows] = {block<1>, block<2>, block_lean<3>, block_lean<4>};

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

  const auto* x_bf16 = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  std::vector<float> x_sums(rows * groups);  // sum of x over each group, per row
  for (int64_t i = 0; i < rows * groups; ++i) {
    float sum = 0.0f;
    for (int64_t k = 0; k < group_size; ++k) {
      uint32_t bits = uint32_t(x_bf16[i * group_size + k]) << 16;
      float value;
      std::memcpy(&value, &bits, sizeof value);
      sum += value;
    }
    x_sums[i] = sum;
  }
  const auto* codes = packed.const_data_ptr<uint8_t>();
  const auto* scales = reinterpret_cast<const uint16_t*>(sz.const_data_ptr());
  auto* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t chunks = K / 4;
  at::parallel_for(0, blocks, 0, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int64_t n = std::min<int64_t>(kMaxRows, rows - r);
        kBlockFns[n - 1](x_bf16 + r * K, K, x_sums.data() + r * groups, groups, codes + b * chunks * kChunkBytes,
                         scales + b * groups * 2 * kBlockOut, out + r * N + b * kBlockOut, N, chunks, groups,
                         group_size / 4);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specdec, m) {
  m.def("int4_dot_mm(Tensor x, Tensor packed, Tensor sz, int group_size) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) {
  m.impl("int4_dot_mm", &int4_dot_mm);
}
