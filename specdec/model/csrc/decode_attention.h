// The native decode step's attention (decode_attention.cpp): each new token's query heads over
// its request's cached context in the paged KV pool, shared by the threads of the step's team
// (decode_layers.cpp), in fp32.
#pragma once

#include <cstdint>

namespace specdec {

// One layer's attention for N query rows: B requests of T new tokens each, row r of request
// r / T. Key position l of request b is pool row context_rows[b * L + l].
struct AttentionStep {
  int64_t rows, tokens, heads, kv_heads, dim, length;  // N, T, H, Hkv, D, L
  const uint16_t* queries;      // q [H, D] bf16 at the start of each row, `query_stride` values apart
  int64_t query_stride;
  const uint16_t* pool;         // the layer's pool [rows, 2, Hkv, D] bf16: keys, then values
  const int64_t* context_rows;  // [B, L]
  const float* masks;           // [N, L]: 0 where the row sees the key, -inf elsewhere
  float* scores;                // [N, H, scores_per_row(L)]
  float* partials;              // [N, H, chunks, D + 2] where the context is split (`partial_floats`)
  uint16_t* out;                // [N, H, D] bf16
};

// Floats a row of scores takes: the context rounded up to whole vectors.
inline int64_t scores_per_row(int64_t length) { return (length + 15) / 16 * 16; }

// Whether the kernel takes heads of `dim` values.
bool attention_takes_dim(int64_t dim);

// Pieces each (row, KV head)'s context is cut into, so that the (row, KV head, piece) units
// divide evenly over a team of `team` threads (1: no cut).
int64_t context_chunks(int64_t rows, int64_t kv_heads, int64_t length, int64_t team);

// Floats of `AttentionStep::partials` for `chunks` pieces (0 for one).
inline int64_t partial_floats(int64_t rows, int64_t heads, int64_t dim, int64_t chunks) {
  return chunks > 1 ? rows * heads * chunks * (dim + 2) : 0;
}

// Thread `me` of `team`'s share of the units. With one piece a unit writes its heads' `out`;
// with more it writes its partials, and after a barrier `merge_part` combines them into `out`.
void attention_part(const AttentionStep& step, int64_t chunks, int64_t me, int64_t team);
void merge_part(const AttentionStep& step, int64_t chunks, int64_t me, int64_t team);

}  // namespace specdec
