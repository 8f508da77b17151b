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
// attention's units (decode_attention.cpp), and of the rows' norms and residual adds.
// Elementwise work runs on 16-float vectors (decode_common.h).
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
#include <numeric>
#include <utility>
#include <vector>

#include "decode_attention.h"
#include "decode_common.h"
#include "int4_dot.h"

namespace {

constexpr int kMatmuls = 4, kFields = 5;
enum Matmul { kQkv = 0, kO = 1, kGateUp = 2, kDown = 3 };
using specdec::bf16_to_float;
using specdec::float_to_bf16;
using specdec::exp16;
using specdec::f32x16;
using specdec::kLanes;
using specdec::load_bf16x16;
using specdec::share;
using specdec::store_bf16x16;

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
  std::vector<float> residual, scores, partials, sums;
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

// One call's sizes, inputs and intermediates (the calling thread's `Buffers`), which every
// thread of the team reads and writes its share of.
struct Step {
  int64_t rows, size, heads, kv_heads, dim, qkv_width, intermediate;
  float eps;
  const int64_t* weights = nullptr;  // the table [layers, 4, 5]
  const uint16_t *norms = nullptr, *cos = nullptr, *sin = nullptr;
  const int64_t* writes = nullptr;
  specdec::AttentionStep attention{};  // all but its pool, which is each layer's
  float* residual = nullptr;           // the fp32 stream [N, h]
  float* sums = nullptr;               // [threads, sums_stride]: each thread's int4_dot scratch
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
// and the next norm of the same rows need none. Attention cuts each context into `chunks`
// pieces (`specdec::context_chunks`), merged after a barrier of their own.
void layer_part(const Step& s, int64_t layer, uint16_t* pool, int64_t chunks, int64_t me, int64_t team) {
  const auto [row_first, row_last] = share(s.rows, me, team);
  const uint16_t* input_norm = s.norms + layer * 2 * s.size;
  for (int64_t r = row_first; r < row_last; ++r)
    rms_norm(s.residual + r * s.size, input_norm, s.size, s.eps, s.normed + r * s.size);
#pragma omp barrier
  qkv_part(s, weights_of(s.weights, layer, kQkv), pool, me, team);
#pragma omp barrier  // every row's key and value is in the pool before any query reads it
  specdec::AttentionStep attention = s.attention;
  attention.pool = pool;
  specdec::attention_part(attention, chunks, me, team);
#pragma omp barrier
  if (chunks > 1) {  // the same on every thread
    specdec::merge_part(attention, chunks, me, team);
#pragma omp barrier
  }
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
  TORCH_CHECK(specdec::attention_takes_dim(dim), "decode_layers: heads of ", dim, " values are past this kernel's limits");
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
  Step step{rows, size, num_heads, num_kv_heads, dim, qkv_width, intermediate, float(eps)};
  step.weights = weights;
  step.norms = reinterpret_cast<const uint16_t*>(norms.const_data_ptr());
  step.cos = reinterpret_cast<const uint16_t*>(cos.const_data_ptr());
  step.sin = reinterpret_cast<const uint16_t*>(sin.const_data_ptr());
  step.writes = writes;
  step.residual = sized(buffer.residual, rows * size);
  step.normed = sized(buffer.normed, rows * size);
  step.qkv = sized(buffer.qkv, rows * qkv_width);
  step.attended = sized(buffer.attended, rows * num_heads * dim);
  step.projected = sized(buffer.projected, rows * std::max<int64_t>(size, 2 * intermediate));
  step.activated = sized(buffer.activated, rows * intermediate);
  const int64_t threads = at::get_num_threads();
  const int64_t chunks = specdec::context_chunks(rows, num_kv_heads, length, threads);
  step.attention = {rows, tokens, num_heads, num_kv_heads, dim, length, step.qkv, qkv_width, nullptr, context_rows,
                    bias.const_data_ptr<float>(), sized(buffer.scores, rows * num_heads * specdec::scores_per_row(length)),
                    sized(buffer.partials, specdec::partial_floats(rows, num_heads, dim, chunks)), step.attended};
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
    const int64_t team_chunks = team == threads ? chunks : 1;  // the partials are sized for `threads`
    for (int64_t layer = 0; layer < layers; ++layer)
      layer_part(step, layer, reinterpret_cast<uint16_t*>(kv[layer].data_ptr()), team_chunks, me, team);
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
