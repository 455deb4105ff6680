// Attention of many query rows over one KV head's cached tokens on AMX tiles: the shape of a shared prefix read
// once for a whole group of decoding sequences (every member's GQA rows against the same keys), where vector
// code is bound by its multiply-adds, not by the bytes read.
//
// The keys and values are read in place through the block table and laid out in L1/L2 as the tile products'
// right operands (pairs of bf16 along the summed dimension), a part of at most kMaxPartTokens at a time:
//   scores [16 rows x 16 tokens] = q rows [16 x 32 dims] . key pairs [16 dim pairs x 16 tokens], over the dims;
//   sums   [16 rows x 16 dims]   = probabilities [16 x 32 tokens] . value pairs [16 token pairs x 16 dims].
// Scores are fp32 sums of exact bf16 products (as vdpbf16ps gives the vector path); softmax is fp32; each
// probability enters the values' product as two bf16 terms (its rounding and the remainder's), so it keeps
// 16 bits rather than bf16's 8, and the sums stay close to the vector path's fp32 probabilities.
#pragma once

#include "amx.h"
#include "bf16_pairs.h"
#include "simd.h"

#if defined(KVSERVE_AMX)
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace tile_attention {

constexpr int64_t kMinRows = 16;       // fewer query rows than one tile's stay on the vector path
// The longest part the decode plan gives a task here (its max_part_tokens): K and V laid out for 512 tokens of 256
// dims stay within L2.
constexpr int64_t kMaxPartTokens = 512;

struct Scratch {
  std::vector<uint32_t> keys, values;  // the part's K and V as tiles' right operands
  std::vector<float> scores, sums;     // one row block's [16 x part rounded up to 32] scores, [16 x head_dim] sums
  std::vector<at::BFloat16> high, low; // its probabilities, [16 x part rounded up to 32], as two bf16 terms
  std::vector<at::BFloat16> q;         // a last row block padded to 16 rows
  std::vector<int64_t> offsets;        // each token's row in the caches
};

// keys[tile j][dim chunk c][pair i][token tt] = dims (32c + 2i, 32c + 2i + 1) of token 16j + tt; zeros past count.
inline void pack_keys(const at::BFloat16* cache, const int64_t* offsets, int64_t count, int64_t padded,
                      int64_t head_dim, uint32_t* keys) {
  const uint16_t* rows[16];
  for (int64_t t0 = 0; t0 < padded; t0 += 16) {
    const int64_t real = std::clamp<int64_t>(count - t0, 0, 16);
    for (int64_t j = 0; j < real; ++j) rows[j] = reinterpret_cast<const uint16_t*>(cache + offsets[t0 + j]);
    bf16_pairs::key_tile(rows, real, head_dim, keys + t0 * head_dim / 2, 16);
  }
}

// values[tile k][dim chunk c][pair p][dim i] = (token 32k + 2p, token 32k + 2p + 1) at dim 16c + i; zeros past count.
inline void pack_values(const at::BFloat16* cache, const int64_t* offsets, int64_t count, int64_t padded,
                        int64_t head_dim, uint32_t* values) {
  const int64_t chunks = head_dim / 16;
  auto row = [&](int64_t t) { return t < count ? reinterpret_cast<const uint16_t*>(cache + offsets[t]) : nullptr; };
  for (int64_t t = 0; t < padded; t += 2) {
    const uint16_t *even = row(t), *odd = row(t + 1);
    uint32_t* tile = values + (t / 32) * chunks * 256 + (t % 32) / 2 * 16;
    for (int64_t c = 0; c < chunks; ++c)
      _mm512_storeu_si512(tile + c * 256, even ? bf16_pairs::value_pairs(even, odd, 16 * c) : _mm512_setzero_si512());
  }
}

// A row's scores (the first `count`; the row is read up to `padded`, a multiple of 32) -> e^(scale x score - max)
// as two bf16 terms each (zeros past count), with the row's max and sum.
inline void softmax_row(const float* scores, int64_t count, int64_t padded, float scale, at::BFloat16* high,
                        at::BFloat16* low, float* row_max, float* row_sum) {
  const __m512 scale_v = _mm512_set1_ps(scale);
  auto valid = [&](int64_t t0) {
    return static_cast<__mmask16>(t0 >= count ? 0 : count - t0 >= 16 ? 0xffff : (1u << (count - t0)) - 1);
  };
  __m512 max_v = _mm512_set1_ps(-1e30f);  // not -inf: built with -ffast-math
  for (int64_t t0 = 0; t0 < count; t0 += 16)
    max_v = _mm512_mask_max_ps(max_v, valid(t0), max_v, _mm512_mul_ps(_mm512_loadu_ps(scores + t0), scale_v));
  const float max_score = _mm512_reduce_max_ps(max_v);
  const __m512 shift = _mm512_set1_ps(max_score);
  __m512 sum_v = _mm512_setzero_ps();
  for (int64_t t0 = 0; t0 < padded; t0 += 16) {
    const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(scores + t0), scale_v, shift);
    const __m512 p = _mm512_maskz_mov_ps(valid(t0), simd::exp_nonpositive(x));
    sum_v = _mm512_add_ps(sum_v, p);
    const __m256bh rounded = _mm512_cvtneps_pbh(p);
    const __m256bh rest = _mm512_cvtneps_pbh(_mm512_sub_ps(p, _mm512_cvtpbh_ps(rounded)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + t0), reinterpret_cast<const __m256i&>(rounded));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + t0), reinterpret_cast<const __m256i&>(rest));
  }
  *row_max = max_score;
  *row_sum = _mm512_reduce_add_ps(sum_v);
}

// A tile product's result is ready many cycles after it starts, and tiles are not renamed, so each loop keeps two
// or four products in flight on separate result tiles and alternates the registers it loads into.
// Scores: results 0 and 4 (two token tiles), query chunks 1 and 3, keys 2 and 7 (even chunks), 5 and 6 (odd ones).
// Sums: results 0, 4, 5 and 6 (four dim tiles), probabilities 1 (high terms) and 3 (low ones), values 2 and 7.
#define KVSERVE_SCORE_CHUNK(Q, KA, KB)                                          \
  _tile_loadd(Q, q + c * amx::kTileValues, head_dim * 2);                       \
  _tile_loadd(KA, s.keys.data() + (j * dim_chunks + c) * 256, 64);              \
  _tile_dpbf16ps(0, Q, KA);                                                     \
  if (two) {                                                                    \
    _tile_loadd(KB, s.keys.data() + ((j + 1) * dim_chunks + c) * 256, 64);      \
    _tile_dpbf16ps(4, Q, KB);                                                   \
  }
#define KVSERVE_VALUE_PAIR(A, B, c0)                                            \
  _tile_loadd(2, s.values.data() + (k * dim_tiles + (c0)) * 256, 64);           \
  _tile_loadd(7, s.values.data() + (k * dim_tiles + (c0) + 1) * 256, 64);       \
  _tile_dpbf16ps(A, 1, 2);                                                      \
  _tile_dpbf16ps(B, 1, 7);                                                      \
  _tile_dpbf16ps(A, 3, 2);                                                      \
  _tile_dpbf16ps(B, 3, 7);

__attribute__((target("amx-tile,amx-bf16"))) __attribute__((noinline)) inline void attend_part(
    const at::BFloat16* q, int64_t rows, int64_t head_dim, int64_t count, float scale, Scratch& s, float* maxima,
    float* totals) {
  const int64_t padded16 = (count + 15) / 16 * 16, padded32 = (count + 31) / 32 * 32;
  const int64_t dim_chunks = head_dim / amx::kTileValues, dim_tiles = head_dim / 16, token_tiles = padded16 / 16;
  for (int64_t j = 0; j < token_tiles; j += 2) {
    const bool two = j + 1 < token_tiles;
    _tile_zero(0);
    if (two) _tile_zero(4);
    for (int64_t c = 0; c < dim_chunks; ++c) {
      if (c % 2 == 0) {
        KVSERVE_SCORE_CHUNK(1, 2, 7)
      } else {
        KVSERVE_SCORE_CHUNK(3, 5, 6)
      }
    }
    _tile_stored(0, s.scores.data() + j * 16, padded32 * 4);
    if (two) _tile_stored(4, s.scores.data() + (j + 1) * 16, padded32 * 4);
  }
  for (int64_t r = 0; r < rows; ++r)
    softmax_row(s.scores.data() + r * padded32, count, padded32, scale, s.high.data() + r * padded32,
                s.low.data() + r * padded32, maxima + r, totals + r);
  for (int64_t r = rows; r < amx::kTileRows; ++r) {  // rows past the query's: zero weights
    std::fill_n(s.high.data() + r * padded32, padded32, at::BFloat16(0.f));
    std::fill_n(s.low.data() + r * padded32, padded32, at::BFloat16(0.f));
  }
  // head_dim is a multiple of 32: dim tiles come in pairs, four at a time while there are four.
  for (int64_t c0 = 0; c0 < dim_tiles; c0 += 4) {
    const bool four = c0 + 4 <= dim_tiles;
    _tile_zero(0);
    _tile_zero(4);
    if (four) {
      _tile_zero(5);
      _tile_zero(6);
    }
    for (int64_t k = 0; k < padded32 / 32; ++k) {
      _tile_loadd(1, s.high.data() + k * 32, padded32 * 2);
      _tile_loadd(3, s.low.data() + k * 32, padded32 * 2);
      KVSERVE_VALUE_PAIR(0, 4, c0)
      if (four) {
        KVSERVE_VALUE_PAIR(5, 6, c0 + 2)
      }
    }
    float* sums = s.sums.data() + c0 * 16;
    _tile_stored(0, sums, head_dim * 4);
    _tile_stored(4, sums + 16, head_dim * 4);
    if (four) {
      _tile_stored(5, sums + 32, head_dim * 4);
      _tile_stored(6, sums + 48, head_dim * 4);
    }
  }
}
#undef KVSERVE_SCORE_CHUNK
#undef KVSERVE_VALUE_PAIR

inline bool applies(int64_t num_rows, int64_t head_dim) {
  return num_rows >= kMinRows && head_dim % amx::kTileValues == 0 && head_dim <= 256 && amx::ready();
}

// `num_rows` bf16 query rows [num_rows x head_dim] over one KV head's tokens [first, end) of a bf16 cache
// [blocks, block_size, num_kv_heads, head_dim] read through `table`: writes partial = unnormalised sums
// [num_rows x head_dim] | row maxima [num_rows] | row sums [num_rows], as the decode tasks do.
__attribute__((target("amx-tile,amx-bf16"))) inline void attend_rows(
    const at::BFloat16* q, int64_t num_rows, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
    const int64_t* table, int64_t block_size, int64_t num_kv_heads, int64_t kv_head, int64_t head_dim, int64_t first,
    int64_t end, float scale, float* partial) {
  TORCH_INTERNAL_ASSERT(end - first <= kMaxPartTokens, "the plan caps a tile task's tokens");
  thread_local Scratch s;
  const int64_t count = end - first;
  const int64_t padded16 = (count + 15) / 16 * 16, padded32 = (count + 31) / 32 * 32;
  s.offsets.resize(count);
  for (int64_t t = 0; t < count; ++t) {
    const int64_t pos = first + t;
    s.offsets[t] = ((table[pos / block_size] * block_size + pos % block_size) * num_kv_heads + kv_head) * head_dim;
  }
  s.keys.resize(padded16 * head_dim / 2);
  s.values.resize(padded32 * head_dim / 2);
  s.scores.resize(amx::kTileRows * padded32);
  s.sums.resize(amx::kTileRows * head_dim);
  s.high.resize(amx::kTileRows * padded32);
  s.low.resize(amx::kTileRows * padded32);
  pack_keys(k_cache, s.offsets.data(), count, padded16, head_dim, s.keys.data());
  pack_values(v_cache, s.offsets.data(), count, padded32, head_dim, s.values.data());
  float* maxima = partial + num_rows * head_dim;
  float* totals = maxima + num_rows;
  const amx::TileConfig config(8);
  _tile_loadconfig(&config);
  for (int64_t r0 = 0; r0 < num_rows; r0 += amx::kTileRows) {
    const int64_t rows = std::min(amx::kTileRows, num_rows - r0);
    const at::BFloat16* rows_q = q + r0 * head_dim;
    if (rows < amx::kTileRows) {
      s.q.assign(amx::kTileRows * head_dim, at::BFloat16(0.f));
      std::copy_n(rows_q, rows * head_dim, s.q.data());
      rows_q = s.q.data();
    }
    attend_part(rows_q, rows, head_dim, count, scale, s, maxima + r0, totals + r0);
    std::copy_n(s.sums.data(), rows * head_dim, partial + r0 * head_dim);
  }
  _tile_release();
}

}  // namespace tile_attention
#endif
