// Every decoder layer of a 1-token decode step in one call: the draft's step without a kernel
// launch, an allocation or a Python frame per operation (specdec.model.native_steps).
//
// Per layer, for B requests of one new token each (hidden [B, h] bf16):
//   RMSNorm -> int4 q|k|v -> RoPE on q and k -> k, v written to the layer's pool
//   -> attention of each query head over its request's context (fp32 math) -> int4 o
//   -> residual -> RMSNorm -> int4 gate|up -> silu(gate) * up -> int4 down -> residual.
// Each elementwise step rounds to bf16 where the eager forward (specdec.model.llama) does, so
// the two agree up to the matmuls' and attention's fp32 summation order. The matmuls run on
// at::parallel_for's threads (int4_dot.cpp); attention splits its (request, KV head) pairs over
// them once the context is long enough to pay for the fork; the rest is a few thousand
// elements a layer and stays on the calling thread.
//
// Weights come as a table of addresses, built once by the Python side, which keeps the tensors
// alive: table int64 [layers, 4 matmuls (q|k|v, o, gate|up, down), 5] = (codes, scales and
// offsets, blocks of 64 outputs, inputs, group size); norms bf16 [layers, 2, h].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "int4_dot.h"

namespace {

constexpr int kMatmuls = 4, kFields = 5;
enum Matmul { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
// Attention runs on one thread below this many multiply-adds a step (a fork costs microseconds).
constexpr int64_t kParallelAttention = 1 << 20;
// Query heads per KV head times head size that `attend` holds on its stack.
constexpr int64_t kMaxGroupValues = 4096;
constexpr int64_t kMaxGroups = 64;

inline float bf16_to_float(uint16_t bits) { return __builtin_bit_cast(float, uint32_t(bits) << 16); }

// fp32 -> bf16, rounding to nearest even (a NaN stays a NaN), as torch's casts do.
inline uint16_t float_to_bf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((bits >> 16) | 0x40);
  return uint16_t((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

inline float round_bf16(float value) { return bf16_to_float(float_to_bf16(value)); }

struct Weights {
  const uint8_t* codes;
  const uint16_t* scales;
  int64_t blocks, inputs, group_size;
  int64_t outputs() const { return blocks * specdec::kBlockOut; }
};

Weights weights_of(const int64_t* table, int64_t layer, Matmul m) {
  const int64_t* row = table + (layer * kMatmuls + m) * kFields;
  return {reinterpret_cast<const uint8_t*>(row[0]), reinterpret_cast<const uint16_t*>(row[1]), row[2], row[3], row[4]};
}

void matmul(const Weights& w, const uint16_t* x, int64_t rows, uint16_t* y) {
  specdec::int4_dot(x, rows, w.inputs, w.codes, w.scales, w.blocks, w.group_size, y,
                    specdec::scratch_floats(specdec::int4_dot_scratch(rows, w.inputs, w.group_size)));
}

// specdec.model.llama.rms_norm: weight * bf16(x * rsqrt(mean(x^2) + eps)), x's sum in fp32.
void rms_norm(const uint16_t* x, const uint16_t* weight, int64_t size, float eps, uint16_t* out) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < size; ++i) {
    const float v = bf16_to_float(x[i]);
    squares += v * v;
  }
  const float scale = 1.0f / std::sqrt(squares / float(size) + eps);
#pragma omp simd
  for (int64_t i = 0; i < size; ++i)
    out[i] = float_to_bf16(bf16_to_float(weight[i]) * round_bf16(bf16_to_float(x[i]) * scale));
}

// x * cos + rotate_half(x) * sin on `heads` vectors of `dim`, in place, each product and the
// sum rounded to bf16 as the eager bf16 ops round them.
void rope(uint16_t* x, int64_t heads, int64_t dim, const uint16_t* cos, const uint16_t* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    uint16_t* v = x + h * dim;
    for (int64_t d = 0; d < half; ++d) {
      const float a = bf16_to_float(v[d]), b = bf16_to_float(v[d + half]);
      const float first = round_bf16(a * bf16_to_float(cos[d])) + round_bf16(-b * bf16_to_float(sin[d]));
      const float second = round_bf16(b * bf16_to_float(cos[d + half])) + round_bf16(a * bf16_to_float(sin[d + half]));
      v[d] = float_to_bf16(first);
      v[d + half] = float_to_bf16(second);
    }
  }
}

// h += y, each sum rounded to bf16 (a residual connection).
void add_rounded(uint16_t* h, const uint16_t* y, int64_t count) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) h[i] = float_to_bf16(bf16_to_float(h[i]) + bf16_to_float(y[i]));
}

struct Context {
  const int64_t* rows;  // [L] pool row of each key position
  const float* bias;    // [L] 0 where the query sees the key, -inf elsewhere
  int64_t length;
};

// 16 floats in one vector: GCC's vector extensions compile it to one zmm register with
// AVX-512, two ymm with AVX2, so one source serves both builds.
typedef float f32x16 __attribute__((vector_size(64)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;

inline f32x16 load_bf16x16(const uint16_t* p) {
  u16x16 half;
  std::memcpy(&half, p, sizeof half);
  return (f32x16)(__builtin_convertvector(half, u32x16) << 16);
}

typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));

// The sum of the 16 lanes as a tree of halves (a loop over the lanes would add them one after
// another: a chain of 16 dependent additions per score).
inline float sum_lanes(f32x16 v) {
  const f32x8 eight = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                      __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const f32x4 four = __builtin_shufflevector(eight, eight, 0, 1, 2, 3) + __builtin_shufflevector(eight, eight, 4, 5, 6, 7);
  return (four[0] + four[2]) + (four[1] + four[3]);
}

// The `groups` query heads of one KV head over one request's context: q [groups, dim] bf16 ->
// out [groups, dim] bf16, dim a multiple of 16. The pool is [rows, 2, kv_heads, dim] bf16;
// `kv_head` picks the head. Scores, softmax and the weighted sum in fp32.
void attend(const uint16_t* q, int64_t groups, int64_t dim, const uint16_t* pool, int64_t kv_heads, int64_t kv_head,
            const Context& context, float* scores /* [groups, L] */, uint16_t* out) {
  const float scale = 1.0f / std::sqrt(float(dim));
  const int64_t row_stride = 2 * kv_heads * dim, vectors = dim / kLanes;
  const float minus_inf = -std::numeric_limits<float>::infinity();
  f32x16 query[kMaxGroupValues / kLanes], acc[kMaxGroupValues / kLanes];
  for (int64_t i = 0; i < groups * vectors; ++i) query[i] = load_bf16x16(q + i * kLanes) * scale, acc[i] = f32x16{};
  float most[kMaxGroups];
  std::fill(most, most + groups, minus_inf);
  for (int64_t l = 0; l < context.length; ++l) {
    if (context.bias[l] == minus_inf) {
      for (int64_t g = 0; g < groups; ++g) scores[g * context.length + l] = minus_inf;
      continue;
    }
    const uint16_t* key = pool + context.rows[l] * row_stride + kv_head * dim;
    for (int64_t c = 0; c < dim; c += 32) __builtin_prefetch(key + kv_heads * dim + c);  // this row's value, read next
    f32x16 dots[kMaxGroups];
    for (int64_t g = 0; g < groups; ++g) dots[g] = f32x16{};
    for (int64_t c = 0; c < vectors; ++c) {
      const f32x16 k = load_bf16x16(key + c * kLanes);
      for (int64_t g = 0; g < groups; ++g) dots[g] += query[g * vectors + c] * k;
    }
    for (int64_t g = 0; g < groups; ++g) {
      const float score = sum_lanes(dots[g]) + context.bias[l];
      scores[g * context.length + l] = score;
      most[g] = std::max(most[g], score);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    float total = 0.0f;
    float* row = scores + g * context.length;
    for (int64_t l = 0; l < context.length; ++l) total += row[l] = std::exp(row[l] - most[g]);
    const float inverse = 1.0f / total;
    for (int64_t l = 0; l < context.length; ++l) row[l] *= inverse;
  }
  for (int64_t l = 0; l < context.length; ++l) {
    if (context.bias[l] == minus_inf) continue;
    const uint16_t* value = pool + context.rows[l] * row_stride + kv_heads * dim + kv_head * dim;
    for (int64_t c = 0; c < vectors; ++c) {
      const f32x16 v = load_bf16x16(value + c * kLanes);
      for (int64_t g = 0; g < groups; ++g) acc[g * vectors + c] += scores[g * context.length + l] * v;
    }
  }
  for (int64_t i = 0; i < groups * vectors; ++i)
    for (int j = 0; j < kLanes; ++j) out[i * kLanes + j] = float_to_bf16(acc[i][j]);
}

at::Tensor decode_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& write_index, const at::Tensor& context_index, const at::Tensor& bias,
                         at::TensorList kv, const at::Tensor& table, const at::Tensor& norms, int64_t num_heads,
                         int64_t num_kv_heads, double eps) {
  const int64_t batch = hidden_in.size(0), size = hidden_in.size(1), layers = int64_t(kv.size());
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kBFloat16 && hidden_in.is_contiguous(),
              "decode_layers: hidden must be contiguous bfloat16 [B, hidden]");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.numel() == layers * kMatmuls * kFields,
              "decode_layers: table must be contiguous int64 [layers, 4, 5]");
  TORCH_CHECK(norms.scalar_type() == at::kBFloat16 && norms.is_contiguous() && norms.numel() == layers * 2 * size,
              "decode_layers: norms must be contiguous bfloat16 [layers, 2, hidden]");
  TORCH_CHECK(layers > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0, "decode_layers: bad head counts");
  const int64_t dim = kv[0].size(3), groups = num_heads / num_kv_heads, length = context_index.size(1);
  TORCH_CHECK(groups <= kMaxGroups && groups * dim <= kMaxGroupValues && dim % kLanes == 0,
              "decode_layers: ", groups, " query heads of ", dim, " per KV head are past this kernel's limits");
  TORCH_CHECK(cos.numel() == batch * dim && sin.numel() == batch * dim && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "decode_layers: cos and sin must be contiguous bfloat16 [B, head_dim]");
  TORCH_CHECK(write_index.numel() == batch && write_index.scalar_type() == at::kLong && write_index.is_contiguous(),
              "decode_layers: write_index must be int64 [B]");
  TORCH_CHECK(context_index.size(0) == batch && context_index.scalar_type() == at::kLong &&
                  context_index.is_contiguous() && bias.numel() == batch * length &&
                  bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "decode_layers: context_index must be int64 [B, L] and bias float32 [B, L]");
  for (const at::Tensor& pool : kv)
    TORCH_CHECK(pool.scalar_type() == at::kBFloat16 && pool.is_contiguous() && pool.dim() == 4 &&
                    pool.size(1) == 2 && pool.size(2) == num_kv_heads && pool.size(3) == dim,
                "decode_layers: each pool must be contiguous bfloat16 [rows, 2, kv_heads, head_dim]");
  const auto* weights = table.const_data_ptr<int64_t>();
  const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * dim;
  for (int64_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(weights_of(weights, layer, kQkv).outputs() == qkv_width && weights_of(weights, layer, kQkv).inputs == size &&
                    weights_of(weights, layer, kO).outputs() == size &&
                    weights_of(weights, layer, kO).inputs == num_heads * dim &&
                    weights_of(weights, layer, kGateUp).inputs == size &&
                    weights_of(weights, layer, kDown).outputs() == size &&
                    2 * weights_of(weights, layer, kDown).inputs == weights_of(weights, layer, kGateUp).outputs(),
                "decode_layers: layer ", layer, "'s matmul shapes do not fit the model");
  }
  const int64_t intermediate = weights_of(weights, 0, kDown).inputs;

  at::Tensor hidden = hidden_in.clone();
  auto* h = reinterpret_cast<uint16_t*>(hidden.data_ptr());
  // One buffer for every intermediate, reused by each layer.
  std::vector<uint16_t> normed(batch * size), qkv(batch * qkv_width), attended(batch * num_heads * dim),
      projected(batch * std::max<int64_t>(size, 2 * intermediate)), activated(batch * intermediate);
  std::vector<float> scores(batch * num_kv_heads * groups * length);
  const auto* rows = context_index.const_data_ptr<int64_t>();
  const auto* masks = bias.const_data_ptr<float>();
  const auto* writes = write_index.const_data_ptr<int64_t>();
  const auto* cos_p = reinterpret_cast<const uint16_t*>(cos.const_data_ptr());
  const auto* sin_p = reinterpret_cast<const uint16_t*>(sin.const_data_ptr());
  const auto* norm_p = reinterpret_cast<const uint16_t*>(norms.const_data_ptr());
  const float epsilon = float(eps);
  const int64_t pairs = batch * num_kv_heads;
  const int64_t grain = pairs * groups * length * dim * 2 >= kParallelAttention ? 1 : pairs;

  for (int64_t layer = 0; layer < layers; ++layer) {
    auto* pool = reinterpret_cast<uint16_t*>(kv[layer].data_ptr());
    const int64_t pool_rows = kv[layer].size(0), row_stride = 2 * num_kv_heads * dim;
    const uint16_t* input_norm = norm_p + layer * 2 * size;
    for (int64_t b = 0; b < batch; ++b) rms_norm(h + b * size, input_norm, size, epsilon, normed.data() + b * size);
    matmul(weights_of(weights, layer, kQkv), normed.data(), batch, qkv.data());
    for (int64_t b = 0; b < batch; ++b) {
      uint16_t* token = qkv.data() + b * qkv_width;  // q [H, D], k [Hkv, D], v [Hkv, D]
      rope(token, num_heads + num_kv_heads, dim, cos_p + b * dim, sin_p + b * dim);
      TORCH_CHECK(writes[b] >= 0 && writes[b] < pool_rows, "decode_layers: write_index out of the pool");
      std::memcpy(pool + writes[b] * row_stride, token + num_heads * dim, 2 * num_kv_heads * dim * sizeof(uint16_t));
    }
    at::parallel_for(0, pairs, grain, [&](int64_t begin, int64_t end) {
      for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t b = pair / num_kv_heads, head = pair % num_kv_heads;
        const Context context{rows + b * length, masks + b * length, length};
        attend(qkv.data() + b * qkv_width + head * groups * dim, groups, dim, pool, num_kv_heads, head, context,
               scores.data() + pair * groups * length, attended.data() + (b * num_heads + head * groups) * dim);
      }
    });
    matmul(weights_of(weights, layer, kO), attended.data(), batch, projected.data());
    add_rounded(h, projected.data(), batch * size);
    for (int64_t b = 0; b < batch; ++b)
      rms_norm(h + b * size, input_norm + size, size, epsilon, normed.data() + b * size);
    matmul(weights_of(weights, layer, kGateUp), normed.data(), batch, projected.data());
    for (int64_t b = 0; b < batch; ++b) {
      const uint16_t* gate = projected.data() + b * 2 * intermediate;
      const uint16_t* up = gate + intermediate;
      for (int64_t i = 0; i < intermediate; ++i) {
        const float g = bf16_to_float(gate[i]);
        const float silu = round_bf16(g / (1.0f + std::exp(-g)));
        activated[b * intermediate + i] = float_to_bf16(silu * bf16_to_float(up[i]));
      }
    }
    matmul(weights_of(weights, layer, kDown), activated.data(), batch, projected.data());
    add_rounded(h, projected.data(), batch * size);
  }
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor write_index, Tensor context_index, "
        "Tensor bias, Tensor(a!)[] kv, Tensor table, Tensor norms, int num_heads, int num_kv_heads, "
        "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("decode_layers", &decode_layers); }
