// Experiment (benchmarks/experiments/int8_activations.py): the 4-bit matmul of
// specdec/model/csrc/int4_dot.cpp with int8 activations, as llama.cpp multiplies its Q4 blocks
// with Q8 ones. Same packed weights; each row of x is quantized per group of `group_size`
// inputs to int8 with one fp32 scale d (its largest magnitude / 127), and `vpdpbusd`
// (AVX-512 VNNI) multiplies 4 unsigned 4-bit codes with 4 signed int8 inputs and adds them into
// one int32 lane:
//   sum_k ((q_k - 8) * s + o) * x_k  ~  d * s * sum_k q_k * x8_k + d * (o - 8 * s) * sum_k x8_k.
// A 32-bit lane of codes is [q_k, q_k+1, q_k+2, q_k+3]: the packed layout's two bytes per output
// and 4 inputs, widened to 32 bits, shifted and masked once.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/extension.h>
#include <algorithm>
#include <vector>

namespace {
constexpr int64_t kBlockOut = 64, kChunkBytes = 128, kPrefetchChunks = 8;
constexpr int kMaxRows = 4;

inline __m512 bf16_to_fp32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// 16 outputs' codes for inputs k..k+3, as 4 bytes 0..15 in each 32-bit lane:
// (lane | lane << 12) & 0x0F0F0F0F puts k, k+1 in bytes 0, 1 and k+2, k+3 in bytes 2, 3.
inline __m512i codes4(const uint8_t* piece) {
  __m512i lane = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)piece));
  return _mm512_ternarylogic_epi32(lane, _mm512_slli_epi32(lane, 12), _mm512_set1_epi32(0x0F0F0F0F), 0xA8);
}

// One block of 64 outputs for ROWS rows, as int4_dot.cpp's block_lean: int32 sums per group, then
// scaled into fp32 sums kept in L1.
template <int ROWS>
void block(const int8_t* xq, int64_t K, const float* d, const float* dsum, int64_t groups, const uint8_t* codes,
           const uint16_t* sz, uint16_t* y, int64_t ld_y, int64_t cpg) {
  alignas(64) float out[ROWS][kBlockOut] = {};
  for (int64_t g = 0; g < groups; ++g) {
    __m512i acc[ROWS][4];
    for (int r = 0; r < ROWS; ++r) for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_si512();
    for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
      const uint8_t* chunk = codes + c * kChunkBytes;
      _mm_prefetch((const char*)(chunk + kPrefetchChunks * kChunkBytes), _MM_HINT_T0);
      _mm_prefetch((const char*)(chunk + kPrefetchChunks * kChunkBytes + 64), _MM_HINT_T0);
      __m512i xb[ROWS];
      for (int r = 0; r < ROWS; ++r) xb[r] = _mm512_set1_epi32(*(const int32_t*)(xq + r * K + 4 * c));
      for (int j = 0; j < 4; ++j) {
        __m512i w = codes4(chunk + 32 * j);
        for (int r = 0; r < ROWS; ++r) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], w, xb[r]);
      }
    }
    const uint16_t* scales = sz + g * 2 * kBlockOut;
    for (int j = 0; j < 4; ++j) {
      __m512 s = bf16_to_fp32(scales + 16 * j);
      __m512 zero = _mm512_fmadd_ps(s, _mm512_set1_ps(-8.0f), bf16_to_fp32(scales + kBlockOut + 16 * j));
      for (int r = 0; r < ROWS; ++r) {
        __m512 o = _mm512_load_ps(out[r] + 16 * j);
        o = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(d[r * groups + g])), _mm512_cvtepi32_ps(acc[r][j]), o);
        o = _mm512_fmadd_ps(zero, _mm512_set1_ps(dsum[r * groups + g]), o);
        _mm512_store_ps(out[r] + 16 * j, o);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256((__m256i*)(y + r * ld_y + 16 * j), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(out[r] + 16 * j)));
}
using Fn = decltype(&block<1>);
constexpr Fn kFns[kMaxRows] = {block<1>, block<2>, block<3>, block<4>};

// y [rows, N] bf16 = x [rows, K] bf16 @ W^T, W packed as int4_dot.cpp packs it; group_size a multiple of 16.
at::Tensor mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& sz, int64_t gs) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && gs % 16 == 0 &&
                  x.size(1) % gs == 0 && packed.is_contiguous() && sz.is_contiguous(),
              "int4_vnni.mm: x must be contiguous bf16 [rows, K], K a multiple of group_size, itself of 16");
  const int64_t rows = x.size(0), K = x.size(1), blocks = packed.size(0), N = blocks * kBlockOut, groups = K / gs;
  at::Tensor y = at::empty({rows, N}, x.options());
  thread_local std::vector<int8_t> xq;  // the calling thread's, grown once
  thread_local std::vector<float> dd;
  xq.resize(rows * K); dd.resize(2 * rows * groups);
  float* d = dd.data(); float* dsum = d + rows * groups;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.const_data_ptr());
  for (int64_t i = 0; i < rows * groups; ++i) {  // gs a multiple of 16
    const uint16_t* src = xb + i * gs;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < gs; k += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16_to_fp32(src + k)));
    const float m = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(m > 0 ? 127.f / m : 0.f);
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < gs; k += 16) {
      __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(bf16_to_fp32(src + k), inv));
      sum = _mm512_add_epi32(sum, q);
      _mm_storeu_si128((__m128i*)(xq.data() + i * gs + k), _mm512_cvtsepi32_epi8(q));
    }
    d[i] = m / 127.f; dsum[i] = d[i] * float(_mm512_reduce_add_epi32(sum));
  }
  const uint8_t* codes = packed.const_data_ptr<uint8_t>();
  const uint16_t* s = reinterpret_cast<const uint16_t*>(sz.const_data_ptr());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t chunks = K / 4;
  const int8_t* xqp = xq.data();
  at::parallel_for(0, blocks, 0, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t r = 0; r < rows; r += kMaxRows) {
        const int64_t n = std::min<int64_t>(kMaxRows, rows - r);
        kFns[n - 1](xqp + r * K, K, d + r * groups, dsum + r * groups, groups, codes + b * chunks * kChunkBytes,
                    s + b * groups * 2 * kBlockOut, out + r * N + b * kBlockOut, N, gs / 4);
      }
  });
  return y;
}
}  // namespace
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("mm", &mm); }
