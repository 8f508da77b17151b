// Attention of a decoding step's new tokens over their cached contexts (decode_attention.h).
//
// A unit of work is one row's query heads of one KV head over one piece of its context: the
// keys pass writes each position's score and keeps the piece's largest, the exp pass turns
// the scores into weights exp(score - largest) and sums them, the values pass adds up the
// weighted values. A pass holds its heads' queries, then their value sums, in registers (a template per
// head size and heads a pass): kept in arrays on the stack, every multiply-add stored and
// reloaded its accumulator, and a long context's attention took twice the time
// (docs/performance.md#native-draft-steps).
//
// A 1-token step of a model with 3 KV heads has 3 units, which 2 threads split 2 : 1; so where
// the units do not divide evenly over the team, each context is cut into pieces that make
// them, and a second pass merges the pieces' sums: the attended value is
// sum_p e^(m_p - m) * values_p / sum_p e^(m_p - m) * weights_p, m the largest of the pieces' m_p.
#include "decode_attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "decode_common.h"

namespace specdec {
namespace {

// How many positions ahead the keys pass prefetches a position's keys and values: the pool is
// read from L3 or memory, and without it attention took twice as long.
constexpr int64_t kPrefetchRows = 8;
// Vectors of queries (keys pass) or value sums (values pass) a pass keeps in registers: half of
// AVX-512's 32, the rest for a position's keys and the dots. AVX2 has 16 registers of half the
// width and spills some; 4 or 8 vectors timed no better there.
constexpr int kHeld = 16;
constexpr int64_t kMaxVectors = 8;  // heads of up to 128 values
// Positions a piece of a cut context has at least, so that the merge stays small beside the
// pieces: cut so, a 2,000-position context's attention took 0.89 of its uncut time and a
// 128-position one the same (docs/performance.md#native-draft-steps).
constexpr int64_t kMinPiece = 64;
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// Query heads a pass takes for heads of V vectors: as many as fit in `kHeld`, at most 4.
template <int V>
constexpr int kHeadsPerPass = std::max(1, std::min(4, kHeld / V));

// One pass of a unit: GP query heads (the same KV head's) of one row over positions
// [first, last) of its context.
struct Pass {
  const uint16_t* query;  // the first head's [D]; the next heads follow
  const uint16_t* keys;   // position l's keys of the KV head at keys + context_rows[l] * row_stride
  const uint16_t* values;
  int64_t row_stride;
  const int64_t* context_rows;  // [L]
  const float* bias;            // [L]
  int64_t first, last;
  float* scores;  // the first head's row [scores_per_row(L)]; the next heads' rows follow
  int64_t per_row;
  uint16_t* out;     // the first head's [D] (one piece), or null
  float* partial;    // the first head's [D + 2] (a piece of several), or null
  int64_t partial_stride;
  float scale;
};

template <int GP, int V>
void attend_pass(const Pass& p) {
  constexpr int64_t dim = V * kLanes;
  f32x16 query[GP][V];
  for (int g = 0; g < GP; ++g)
    for (int c = 0; c < V; ++c) query[g][c] = load_bf16x16(p.query + g * dim + c * kLanes) * p.scale;
  float most[GP];
  std::fill(most, most + GP, kMinusInf);
  for (int64_t l = p.first; l < p.last; ++l) {
    float* score = p.scores + l;
    if (p.bias[l] == kMinusInf) {
      for (int g = 0; g < GP; ++g) score[g * p.per_row] = kMinusInf;
      continue;
    }
    if (l + kPrefetchRows < p.last) {  // a later position's keys and values, on their way from L3
      const int64_t later = p.context_rows[l + kPrefetchRows] * p.row_stride;
      for (int64_t byte = 0; byte < dim * 2; byte += 64) {
        __builtin_prefetch(reinterpret_cast<const char*>(p.keys + later) + byte);
        __builtin_prefetch(reinterpret_cast<const char*>(p.values + later) + byte);
      }
    }
    const uint16_t* keys = p.keys + p.context_rows[l] * p.row_stride;
    f32x16 key[V];
    for (int c = 0; c < V; ++c) key[c] = load_bf16x16(keys + c * kLanes);
    for (int g = 0; g < GP; ++g) {
      f32x16 dot = query[g][0] * key[0];
      for (int c = 1; c < V; ++c) dot += query[g][c] * key[c];
      const float s = sum_lanes(dot) + p.bias[l];
      score[g * p.per_row] = s;
      most[g] = std::max(most[g], s);
    }
  }
  // Whole vectors: a piece of a cut context ends on one, and the context's end is padded with -inf.
  const int64_t end = scores_per_row(p.last);
  float total[GP];
  for (int g = 0; g < GP; ++g) {
    float* row = p.scores + g * p.per_row;
    std::fill(row + p.last, row + end, kMinusInf);
    total[g] = 0.0f;
    if (most[g] == kMinusInf) continue;  // an empty piece, or one the row sees none of
    f32x16 sum{};
    for (int64_t l = p.first; l < end; l += kLanes) {
      f32x16 v;
      std::memcpy(&v, row + l, sizeof v);
      v = exp16(v - most[g]);
      std::memcpy(row + l, &v, sizeof v);
      sum += v;
    }
    total[g] = sum_lanes(sum);
  }
  f32x16 acc[GP][V] = {};
  for (int64_t l = p.first; l < p.last; ++l) {
    if (p.bias[l] == kMinusInf) continue;
    const uint16_t* values = p.values + p.context_rows[l] * p.row_stride;
    f32x16 value[V];
    for (int c = 0; c < V; ++c) value[c] = load_bf16x16(values + c * kLanes);
    for (int g = 0; g < GP; ++g) {
      const float weight = p.scores[g * p.per_row + l];
      for (int c = 0; c < V; ++c) acc[g][c] += weight * value[c];
    }
  }
  for (int g = 0; g < GP; ++g) {
    if (p.out != nullptr) {
      const float inverse = 1.0f / total[g];
      for (int c = 0; c < V; ++c) store_bf16x16(p.out + g * dim + c * kLanes, acc[g][c] * inverse);
    } else {
      float* partial = p.partial + g * p.partial_stride;  // [D value sums, largest score, weights' sum]
      for (int c = 0; c < V; ++c) std::memcpy(partial + c * kLanes, &acc[g][c], sizeof acc[g][c]);
      partial[dim] = most[g];
      partial[dim + 1] = total[g];
    }
  }
}

using PassFn = void (*)(const Pass&);

template <int V>
PassFn pass_of(int64_t heads) {
  switch (heads) {
    case 1: return attend_pass<1, V>;
    case 2: if constexpr (kHeadsPerPass<V> >= 2) return attend_pass<2, V>; break;
    case 3: if constexpr (kHeadsPerPass<V> >= 3) return attend_pass<3, V>; break;
    case 4: if constexpr (kHeadsPerPass<V> >= 4) return attend_pass<4, V>; break;
  }
  return nullptr;
}

// The pass for `heads` query heads of `vectors` vectors each (heads <= `heads_per_pass`).
PassFn pass_of(int64_t vectors, int64_t heads) {
  switch (vectors) {
    case 1: return pass_of<1>(heads);
    case 2: return pass_of<2>(heads);
    case 3: return pass_of<3>(heads);
    case 4: return pass_of<4>(heads);
    case 5: return pass_of<5>(heads);
    case 6: return pass_of<6>(heads);
    case 7: return pass_of<7>(heads);
    case 8: return pass_of<8>(heads);
  }
  return nullptr;
}

int64_t heads_per_pass(int64_t vectors) {
  constexpr int kByVectors[kMaxVectors + 1] = {0, kHeadsPerPass<1>, kHeadsPerPass<2>, kHeadsPerPass<3>,
                                               kHeadsPerPass<4>, kHeadsPerPass<5>, kHeadsPerPass<6>,
                                               kHeadsPerPass<7>, kHeadsPerPass<8>};
  return kByVectors[vectors];
}

// Piece `piece` of `chunks` of a context of `length` positions: boundaries on whole vectors of
// scores, so no two threads' exp passes touch one vector.
std::pair<int64_t, int64_t> piece_of(int64_t length, int64_t piece, int64_t chunks) {
  const auto boundary = [&](int64_t i) { return i == chunks ? length : length * i / chunks / kLanes * kLanes; };
  return {boundary(piece), boundary(piece + 1)};
}

}  // namespace

bool attention_takes_dim(int64_t dim) { return dim % kLanes == 0 && dim > 0 && dim / kLanes <= kMaxVectors; }

int64_t context_chunks(int64_t rows, int64_t kv_heads, int64_t length, int64_t team) {
  const int64_t chunks = team / std::gcd(rows * kv_heads, team);
  return length >= chunks * kMinPiece ? chunks : 1;
}

void attention_part(const AttentionStep& a, int64_t chunks, int64_t me, int64_t team) {
  const int64_t groups = a.heads / a.kv_heads, vectors = a.dim / kLanes, per_pass = heads_per_pass(vectors);
  const int64_t per_row = scores_per_row(a.length), row_stride = 2 * a.kv_heads * a.dim;
  const float scale = 1.0f / std::sqrt(float(a.dim));
  const auto [first, last] = share(a.rows * a.kv_heads * chunks, me, team);
  for (int64_t unit = first; unit < last; ++unit) {
    const int64_t r = unit / (a.kv_heads * chunks), kv = unit / chunks % a.kv_heads, piece = unit % chunks;
    const auto [from, to] = piece_of(a.length, piece, chunks);
    for (int64_t g = 0; g < groups; g += per_pass) {
      const int64_t h = kv * groups + g, heads = std::min(per_pass, groups - g);
      Pass pass{a.queries + r * a.query_stride + h * a.dim, a.pool + kv * a.dim, a.pool + (a.kv_heads + kv) * a.dim,
                row_stride, a.context_rows + r / a.tokens * a.length, a.masks + r * a.length, from, to,
                a.scores + (r * a.heads + h) * per_row, per_row, nullptr, nullptr, chunks * (a.dim + 2), scale};
      if (chunks == 1)
        pass.out = a.out + (r * a.heads + h) * a.dim;
      else
        pass.partial = a.partials + ((r * a.heads + h) * chunks + piece) * (a.dim + 2);
      pass_of(vectors, heads)(pass);
    }
  }
}

void merge_part(const AttentionStep& a, int64_t chunks, int64_t me, int64_t team) {
  const int64_t vectors = a.dim / kLanes, stride = a.dim + 2;
  const auto [first, last] = share(a.rows * a.heads, me, team);
  for (int64_t unit = first; unit < last; ++unit) {  // (row, query head)
    const float* pieces = a.partials + unit * chunks * stride;  // [chunks, D + 2]
    float most = kMinusInf;
    for (int64_t p = 0; p < chunks; ++p) most = std::max(most, pieces[p * stride + a.dim]);
    f32x16 acc[kMaxVectors] = {};
    float total = 0.0f;
    for (int64_t p = 0; p < chunks; ++p) {
      const float* piece = pieces + p * stride;
      if (piece[a.dim] == kMinusInf) continue;  // saw no key
      const float weight = std::exp(piece[a.dim] - most);
      total += weight * piece[a.dim + 1];
      for (int64_t c = 0; c < vectors; ++c) {
        f32x16 v;
        std::memcpy(&v, piece + c * kLanes, sizeof v);
        acc[c] += weight * v;
      }
    }
    const float inverse = 1.0f / total;
    for (int64_t c = 0; c < vectors; ++c) store_bf16x16(a.out + unit * a.dim + c * kLanes, acc[c] * inverse);
  }
}

}  // namespace specdec
