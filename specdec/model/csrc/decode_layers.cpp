// Every decoder layer of a decoding forward in one call: the draft's step (or its round's
// opening feed, or a guessed forward) without a kernel launch, an allocation or a Python frame
// per operation (specdec.model.native_steps).
//
// Per layer, for B requests of T new tokens each over their cached context (hidden [B * T, h]
// bf16, a shorter chunk padded with rows that write nothing):
//   RMSNorm -> int4 q|k|v -> RoPE on q and k -> k, v written to the layer's pool
//   -> attention of each query head over its request's context (fp32 math) -> int4 o
//   -> residual -> RMSNorm -> int4 gate|up -> silu(gate) * up -> int4 down -> residual.
// The residual stream stays in fp32 through every layer and the elementwise math runs in fp32,
// rounded to bf16 only where a matmul takes its input (and at the end): where the eager bf16
// forward (specdec.model.llama) rounds every op's output, this is closer to the fp32 forward
// of the same weights, and its greedy drafts agreed with the target as often as the compiled
// layers' did (docs/performance.md#native-draft-steps). One OpenMP team (ATen's threads) runs
// the whole call, with a barrier between phases rather than a fork and join per matmul: each
// thread computes its share of each matmul's output blocks (int4_dot.cpp), with RoPE and the
// pool writes of the heads among them and SwiGLU of the gate columns among them, of
// attention's (row, KV head) pairs, and of the rows' norms and residual adds. Elementwise work
// runs on 16-float vectors.
//
// Weights come as a table of addresses, built once by the Python side, which keeps the tensors
// alive: table int64 [layers, 4 matmuls (q|k|v, o, gate|up, down), 5] = (codes, scales and
// offsets, blocks of 64 outputs, inputs, group size); norms bf16 [layers, 2, h].
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "int4_dot.h"

namespace {

constexpr int kMatmuls = 4, kFields = 5;
enum Matmul { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
// Query heads and their values (heads times head size) that `attend` holds on its stack.
constexpr int64_t kMaxHeads = 128;
constexpr int64_t kMaxHeadValues = 4096;
// How many rows ahead the keys pass prefetches a row (its keys and values): the pool is read
// from L3 or memory, and without it attention took twice as long.
constexpr int64_t kPrefetchRows = 8;

using specdec::bf16_to_float;
using specdec::float_to_bf16;

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

typedef int32_t i32x16 __attribute__((vector_size(64)));

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

// Thread `me` of `team`'s even share [first, last) of `n` items.
inline std::pair<int64_t, int64_t> share(int64_t n, int64_t me, int64_t team) {
  return {n * me / team, n * (me + 1) / team};
}


// Output blocks [first, last) of y [rows, outputs] = x @ W^T.
void matmul_blocks(const Weights& w, const uint16_t* x, int64_t rows, uint16_t* y, const float* scratch,
                   int64_t first, int64_t last) {
  specdec::int4_dot_blocks(x, rows, w.inputs, w.codes, w.scales, w.blocks, w.group_size, y, scratch, first, last);
}

// RMSNorm of one row of the fp32 residual stream, times the weight, rounded to bf16 (the next
// matmul's input).
void rms_norm(const float* x, const uint16_t* weight, int64_t size, float eps, uint16_t* out) {
  float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < size; ++i) squares += x[i] * x[i];
  const float scale = 1.0f / std::sqrt(squares / float(size) + eps);
#pragma omp simd
  for (int64_t i = 0; i < size; ++i) out[i] = float_to_bf16(bf16_to_float(weight[i]) * (x[i] * scale));
}

// x * cos + rotate_half(x) * sin on `heads` vectors of `dim`, in place, in fp32, rounded once.
void rope(uint16_t* x, int64_t heads, int64_t dim, const uint16_t* cos, const uint16_t* sin) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    uint16_t* v = x + h * dim;
    for (int64_t d = 0; d < half; ++d) {
      const float a = bf16_to_float(v[d]), b = bf16_to_float(v[d + half]);
      const float first = a * bf16_to_float(cos[d]) - b * bf16_to_float(sin[d]);
      const float second = b * bf16_to_float(cos[d + half]) + a * bf16_to_float(sin[d + half]);
      v[d] = float_to_bf16(first);
      v[d + half] = float_to_bf16(second);
    }
  }
}

// Floats a row of scores takes: the context rounded up to whole vectors.
inline int64_t scores_per_row(int64_t length) { return (length + 15) / 16 * 16; }

// silu(gate) * up for `count` gates and as many ups, in fp32, rounded once to bf16 (the down
// projection's input); `count` a multiple of 16.
void swiglu(const uint16_t* gate, const uint16_t* up, int64_t count, uint16_t* out) {
  for (int64_t i = 0; i < count; i += kLanes) {
    const f32x16 g = load_bf16x16(gate + i);
    const f32x16 silu = g / (1.0f + exp16(-g));
    store_bf16x16(out + i, silu * load_bf16x16(up + i));
  }
}

// The calling thread's intermediates, grown to the largest call so far and reused: a step
// allocates nothing but its output.
struct Buffers {
  std::vector<float> residual, scores, sums;
  std::vector<uint16_t> normed, qkv, attended, projected, activated;
};

Buffers& buffers() {
  thread_local Buffers held;
  return held;
}

template <typename T>
T* sized(std::vector<T>& buffer, int64_t count) {
  if (int64_t(buffer.size()) < count) buffer.resize(count);
  return buffer.data();
}

struct Context {
  const int64_t* rows;  // [L] pool row of each key position
  const float* bias;    // [L] 0 where the query sees the key, -inf elsewhere
  int64_t length;
};

// The query heads of KV heads [kv_first, kv_last) of one token over its request's context:
// q [heads, dim] bf16 -> out [heads, dim] bf16 (those heads' rows only), dim a multiple of 16,
// in fp32. The pool is [rows, 2, kv_heads, dim] bf16, head h reading KV head h / (heads /
// kv_heads). Each pass reads a row's keys (or values) of all those KV heads at once, a
// contiguous piece, where a pass per KV head would stride over the pool once per head.
void attend(const uint16_t* q, int64_t heads, int64_t kv_heads, int64_t kv_first, int64_t kv_last, int64_t dim,
            const uint16_t* pool, const Context& context, float* scores /* [heads, scores_per_row(L)] */,
            uint16_t* out) {
  const int64_t groups = heads / kv_heads, vectors = dim / kLanes, row_stride = 2 * kv_heads * dim;
  const int64_t first = kv_first * groups, last = kv_last * groups;  // the query heads
  const int64_t piece_bytes = (kv_last - kv_first) * dim * 2;         // their keys (or values) in a row
  const int64_t per_row = scores_per_row(context.length);
  const float scale = 1.0f / std::sqrt(float(dim));
  const float minus_inf = -std::numeric_limits<float>::infinity();
  f32x16 query[kMaxHeadValues / kLanes], acc[kMaxHeadValues / kLanes], dots[kMaxHeads];
  for (int64_t i = first * vectors; i < last * vectors; ++i)
    query[i] = load_bf16x16(q + i * kLanes) * scale, acc[i] = f32x16{};
  float most[kMaxHeads];
  std::fill(most, most + heads, minus_inf);
  for (int64_t h = first; h < last; ++h)
    std::fill(scores + h * per_row + context.length, scores + (h + 1) * per_row, minus_inf);
  for (int64_t l = 0; l < context.length; ++l) {
    if (context.bias[l] == minus_inf) {
      for (int64_t h = first; h < last; ++h) scores[h * per_row + l] = minus_inf;
      continue;
    }
    const uint16_t* keys = pool + context.rows[l] * row_stride;  // [kv_heads, dim], then the values
    if (l + kPrefetchRows < context.length) {  // a later row's keys and values, on their way from L3
      const uint16_t* later = pool + context.rows[l + kPrefetchRows] * row_stride + kv_first * dim;
      for (const uint16_t* piece : {later, later + kv_heads * dim})
        for (int64_t byte = 0; byte < piece_bytes; byte += 64)
          __builtin_prefetch(reinterpret_cast<const char*>(piece) + byte);
    }
    for (int64_t h = first; h < last; ++h) dots[h] = f32x16{};
    for (int64_t kv = kv_first; kv < kv_last; ++kv)
      for (int64_t c = 0; c < vectors; ++c) {
        const f32x16 k = load_bf16x16(keys + kv * dim + c * kLanes);
        for (int64_t g = 0; g < groups; ++g) dots[kv * groups + g] += query[(kv * groups + g) * vectors + c] * k;
      }
    for (int64_t h = first; h < last; ++h) {
      const float score = sum_lanes(dots[h]) + context.bias[l];
      scores[h * per_row + l] = score;
      most[h] = std::max(most[h], score);
    }
  }
  for (int64_t h = first; h < last; ++h) {  // the row is padded with -inf to whole vectors
    float* row = scores + h * per_row;
    f32x16 total{};
    for (int64_t l = 0; l < context.length; l += kLanes) {
      f32x16 v;
      std::memcpy(&v, row + l, sizeof v);
      v = exp16(v - most[h]);
      std::memcpy(row + l, &v, sizeof v);
      total += v;
    }
    const float inverse = 1.0f / sum_lanes(total);
    for (int64_t l = 0; l < context.length; ++l) row[l] *= inverse;
  }
  for (int64_t l = 0; l < context.length; ++l) {
    if (context.bias[l] == minus_inf) continue;
    const uint16_t* values = pool + context.rows[l] * row_stride + kv_heads * dim;  // [kv_heads, dim]
    for (int64_t kv = kv_first; kv < kv_last; ++kv)
      for (int64_t c = 0; c < vectors; ++c) {
        const f32x16 v = load_bf16x16(values + kv * dim + c * kLanes);
        for (int64_t g = 0; g < groups; ++g) {
          const int64_t h = kv * groups + g;
          acc[h * vectors + c] += scores[h * per_row + l] * v;
        }
      }
  }
  for (int64_t i = first * vectors; i < last * vectors; ++i) store_bf16x16(out + i * kLanes, acc[i]);
}

// One call's sizes, inputs and intermediates (the calling thread's `Buffers`), which every
// thread of the team reads and writes its share of.
struct Step {
  int64_t rows, tokens, size, heads, kv_heads, dim, qkv_width, intermediate, length;
  float eps;
  const int64_t* weights = nullptr;  // the table [layers, 4, 5]
  const uint16_t *norms = nullptr, *cos = nullptr, *sin = nullptr;
  const int64_t *writes = nullptr, *context_rows = nullptr;
  const float* masks = nullptr;
  float *residual = nullptr, *scores = nullptr;  // residual: the fp32 stream [N, h]
  float* sums = nullptr;                          // [threads, sums_stride]: each thread's int4_dot scratch
  int64_t sums_stride = 0;
  uint16_t *normed = nullptr, *qkv = nullptr, *attended = nullptr, *projected = nullptr, *activated = nullptr;
};

// x [rows, K] summed into thread `me`'s scratch for int4_dot_blocks (a few thousand floats:
// each thread prepares its own rather than wait at a barrier for one copy).
const float* prepared(const Step& s, const Weights& w, const uint16_t* x, int64_t me) {
  float* scratch = s.sums + me * s.sums_stride;
  specdec::int4_dot_prepare(x, s.rows, w.inputs, w.group_size, scratch);
  return scratch;
}

// A thread's share of attention: (row, KV head) pairs [first, last), a row's run of KV heads in
// one pass.
void attention_part(const Step& s, const uint16_t* pool, int64_t first, int64_t last) {
  for (int64_t unit = first; unit < last;) {
    const int64_t r = unit / s.kv_heads, kv = unit % s.kv_heads, kv_last = std::min(s.kv_heads, kv + last - unit);
    const Context context{s.context_rows + r / s.tokens * s.length, s.masks + r * s.length, s.length};
    attend(s.qkv + r * s.qkv_width, s.heads, s.kv_heads, kv, kv_last, s.dim, pool, context,
           s.scores + r * s.heads * scores_per_row(s.length), s.attended + r * s.heads * s.dim);
    unit += kv_last - kv;
  }
}

// Thread `me` of `team`'s share of q|k|v for every row: whole heads (the fewest blocks that
// hold whole heads, at a time), then RoPE on its query and key heads and its key and value
// heads written to the pool, so no other thread's output is needed before the barrier.
void qkv_part(const Step& s, const Weights& w, uint16_t* pool, int64_t me, int64_t team) {
  const int64_t unit = std::lcm(s.dim, specdec::kBlockOut) / specdec::kBlockOut;  // blocks
  const auto [first, last] = share(w.blocks / unit, me, team);
  matmul_blocks(w, s.normed, s.rows, s.qkv, prepared(s, w, s.normed, me), first * unit, last * unit);
  const int64_t heads_per_unit = unit * specdec::kBlockOut / s.dim;
  const int64_t head_first = first * heads_per_unit, head_last = last * heads_per_unit;
  const int64_t rope_last = std::min(head_last, s.heads + s.kv_heads), kv_first = std::max(head_first, s.heads);
  for (int64_t r = 0; r < s.rows; ++r) {
    uint16_t* token = s.qkv + r * s.qkv_width;  // q [H, D], k [Hkv, D], v [Hkv, D]
    if (rope_last > head_first)
      rope(token + head_first * s.dim, rope_last - head_first, s.dim, s.cos + r * s.dim, s.sin + r * s.dim);
    if (s.writes[r] >= 0 && head_last > kv_first)  // a pool row is [k heads, v heads], as q|k|v's tail
      std::memcpy(pool + s.writes[r] * 2 * s.kv_heads * s.dim + (kv_first - s.heads) * s.dim,
                  token + kv_first * s.dim, (head_last - kv_first) * s.dim * sizeof(uint16_t));
  }
}

// Thread `me`'s share of gate|up and SwiGLU: gate blocks [first, last) and the up blocks of
// the same columns, so its SwiGLU columns need no other thread's output.
void gate_up_part(const Step& s, const Weights& w, int64_t me, int64_t team) {
  const int64_t half = w.blocks / 2;  // gate blocks, then as many up blocks
  const auto [first, last] = share(half, me, team);
  const float* scratch = prepared(s, w, s.normed, me);
  matmul_blocks(w, s.normed, s.rows, s.projected, scratch, first, last);
  matmul_blocks(w, s.normed, s.rows, s.projected, scratch, half + first, half + last);
  const int64_t column = first * specdec::kBlockOut, columns = (last - first) * specdec::kBlockOut;
  for (int64_t r = 0; r < s.rows; ++r) {
    const uint16_t* gate = s.projected + r * 2 * s.intermediate + column;
    swiglu(gate, gate + s.intermediate, columns, s.activated + r * s.intermediate + column);
  }
}

// Thread `me` of `team`'s share of one decoder layer; a barrier wherever the next phase reads
// what other threads wrote. A thread's rows are the same in every phase, so a residual add
// and the next norm of the same rows need none.
void layer_part(const Step& s, int64_t layer, uint16_t* pool, int64_t me, int64_t team) {
  const auto [row_first, row_last] = share(s.rows, me, team);
  const uint16_t* input_norm = s.norms + layer * 2 * s.size;
  for (int64_t r = row_first; r < row_last; ++r)
    rms_norm(s.residual + r * s.size, input_norm, s.size, s.eps, s.normed + r * s.size);
#pragma omp barrier
  qkv_part(s, weights_of(s.weights, layer, kQkv), pool, me, team);
#pragma omp barrier  // every row's key and value is in the pool before any query reads it
  const auto [unit_first, unit_last] = share(s.rows * s.kv_heads, me, team);
  attention_part(s, pool, unit_first, unit_last);
#pragma omp barrier
  const Weights o = weights_of(s.weights, layer, kO);
  const auto [o_first, o_last] = share(o.blocks, me, team);
  matmul_blocks(o, s.attended, s.rows, s.projected, prepared(s, o, s.attended, me), o_first, o_last);
#pragma omp barrier
  for (int64_t r = row_first; r < row_last; ++r) {
    for (int64_t i = r * s.size; i < (r + 1) * s.size; ++i) s.residual[i] += bf16_to_float(s.projected[i]);
    rms_norm(s.residual + r * s.size, input_norm + s.size, s.size, s.eps, s.normed + r * s.size);
  }
#pragma omp barrier
  gate_up_part(s, weights_of(s.weights, layer, kGateUp), me, team);
#pragma omp barrier
  const Weights down = weights_of(s.weights, layer, kDown);
  const auto [down_first, down_last] = share(down.blocks, me, team);
  matmul_blocks(down, s.activated, s.rows, s.projected, prepared(s, down, s.activated, me), down_first, down_last);
#pragma omp barrier
  for (int64_t i = row_first * s.size; i < row_last * s.size; ++i) s.residual[i] += bf16_to_float(s.projected[i]);
}

at::Tensor decode_layers(const at::Tensor& hidden_in, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& write_index, const at::Tensor& context_index, const at::Tensor& bias,
                         at::TensorList kv, const at::Tensor& table, const at::Tensor& norms, int64_t num_heads,
                         int64_t num_kv_heads, double eps) {
  // N rows: B requests of T tokens each, request b's tokens in rows b * T .. b * T + T - 1.
  const int64_t rows = hidden_in.size(0), size = hidden_in.size(1), layers = int64_t(kv.size());
  const int64_t requests = context_index.size(0), length = context_index.size(1);
  TORCH_CHECK(hidden_in.dim() == 2 && hidden_in.scalar_type() == at::kBFloat16 && hidden_in.is_contiguous(),
              "decode_layers: hidden must be contiguous bfloat16 [N, hidden]");
  TORCH_CHECK(requests > 0 && rows > 0 && rows % requests == 0, "decode_layers: ", rows, " rows are not ",
              requests, " requests' tokens");
  const int64_t tokens = rows / requests;
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.numel() == layers * kMatmuls * kFields,
              "decode_layers: table must be contiguous int64 [layers, 4, 5]");
  TORCH_CHECK(norms.scalar_type() == at::kBFloat16 && norms.is_contiguous() && norms.numel() == layers * 2 * size,
              "decode_layers: norms must be contiguous bfloat16 [layers, 2, hidden]");
  TORCH_CHECK(layers > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0, "decode_layers: bad head counts");
  const int64_t dim = kv[0].size(3);
  TORCH_CHECK(num_heads <= kMaxHeads && num_heads * dim <= kMaxHeadValues && dim % kLanes == 0,
              "decode_layers: ", num_heads, " query heads of ", dim, " are past this kernel's limits");
  TORCH_CHECK(cos.numel() == rows * dim && sin.numel() == rows * dim && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16,
              "decode_layers: cos and sin must be contiguous bfloat16 [N, head_dim]");
  TORCH_CHECK(write_index.numel() == rows && write_index.scalar_type() == at::kLong && write_index.is_contiguous(),
              "decode_layers: write_index must be int64 [N]");
  TORCH_CHECK(context_index.scalar_type() == at::kLong && context_index.is_contiguous() &&
                  bias.numel() == rows * length && bias.scalar_type() == at::kFloat && bias.is_contiguous(),
              "decode_layers: context_index must be int64 [B, L] and bias float32 [N, L]");
  for (const at::Tensor& pool : kv)
    TORCH_CHECK(pool.scalar_type() == at::kBFloat16 && pool.is_contiguous() && pool.dim() == 4 &&
                    pool.size(0) == kv[0].size(0) && pool.size(1) == 2 && pool.size(2) == num_kv_heads &&
                    pool.size(3) == dim,
                "decode_layers: the pools must be contiguous bfloat16 [rows, 2, kv_heads, head_dim], alike");
  const int64_t pool_rows = kv[0].size(0);
  const auto* context_rows = context_index.const_data_ptr<int64_t>();
  const auto* writes = write_index.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < requests * length; ++i)
    TORCH_CHECK(context_rows[i] >= 0 && context_rows[i] < pool_rows, "decode_layers: context_index out of the pool");
  for (int64_t r = 0; r < rows; ++r)  // -1: a padding row, which writes nothing
    TORCH_CHECK(writes[r] >= -1 && writes[r] < pool_rows, "decode_layers: write_index out of the pool");
  const auto* weights = table.const_data_ptr<int64_t>();
  const int64_t qkv_width = (num_heads + 2 * num_kv_heads) * dim;
  for (int64_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(weights_of(weights, layer, kQkv).outputs() == qkv_width &&
                    weights_of(weights, layer, kQkv).inputs == size && weights_of(weights, layer, kO).outputs() == size &&
                    weights_of(weights, layer, kO).inputs == num_heads * dim &&
                    weights_of(weights, layer, kGateUp).inputs == size &&
                    weights_of(weights, layer, kDown).outputs() == size &&
                    2 * weights_of(weights, layer, kDown).inputs == weights_of(weights, layer, kGateUp).outputs(),
                "decode_layers: layer ", layer, "'s matmul shapes do not fit the model");
  }
  const int64_t intermediate = weights_of(weights, 0, kDown).inputs;
  // Whole blocks, as int4dot's gate and up projections have: a thread's SwiGLU columns are its gate blocks'.
  TORCH_CHECK(intermediate % specdec::kBlockOut == 0, "decode_layers: the MLP's width must be a multiple of 64");

  at::Tensor hidden = at::empty_like(hidden_in);
  auto* out = reinterpret_cast<uint16_t*>(hidden.data_ptr());
  const auto* in = reinterpret_cast<const uint16_t*>(hidden_in.const_data_ptr());
  Buffers& buffer = buffers();  // the calling thread's, shared with the team
  Step step{rows, tokens, size, num_heads, num_kv_heads, dim, qkv_width, intermediate, length, float(eps)};
  step.weights = weights;
  step.norms = reinterpret_cast<const uint16_t*>(norms.const_data_ptr());
  step.cos = reinterpret_cast<const uint16_t*>(cos.const_data_ptr());
  step.sin = reinterpret_cast<const uint16_t*>(sin.const_data_ptr());
  step.writes = writes;
  step.context_rows = context_rows;
  step.masks = bias.const_data_ptr<float>();
  step.residual = sized(buffer.residual, rows * size);
  step.normed = sized(buffer.normed, rows * size);
  step.qkv = sized(buffer.qkv, rows * qkv_width);
  step.attended = sized(buffer.attended, rows * num_heads * dim);
  step.projected = sized(buffer.projected, rows * std::max<int64_t>(size, 2 * intermediate));
  step.activated = sized(buffer.activated, rows * intermediate);
  step.scores = sized(buffer.scores, rows * num_heads * scores_per_row(length));
  const int64_t threads = at::get_num_threads();
  for (int64_t layer = 0; layer < layers; ++layer)
    for (int m = 0; m < kMatmuls; ++m) {
      const Weights w = weights_of(weights, layer, Matmul(m));
      step.sums_stride = std::max(step.sums_stride, specdec::int4_dot_scratch(rows, w.inputs, w.group_size));
    }
  step.sums = sized(buffer.sums, threads * step.sums_stride);  // nothing is allocated inside the team
  for (int64_t i = 0; i < rows * size; ++i) step.residual[i] = bf16_to_float(in[i]);
#pragma omp parallel num_threads(threads)
  {
    const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
    for (int64_t layer = 0; layer < layers; ++layer)
      layer_part(step, layer, reinterpret_cast<uint16_t*>(kv[layer].data_ptr()), me, team);
  }
  for (int64_t i = 0; i < rows * size; ++i) out[i] = float_to_bf16(step.residual[i]);
  return hidden;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specdec, m) {
  m.def("decode_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor write_index, Tensor context_index, "
        "Tensor bias, Tensor(a!)[] kv, Tensor table, Tensor norms, int num_heads, int num_kv_heads, "
        "float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("decode_layers", &decode_layers); }
