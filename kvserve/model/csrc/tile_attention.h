// Attention of many query rows over one KV head's cached tokens: the shape of a shared prefix read once for a
// whole group of decoding sequences (every member's GQA rows against the same keys), where vector code that
// scores one row at a time is bound by its multiply-adds and horizontal sums, not by the bytes read.
//
// The keys and values are read in place through the block table and laid out in L1/L2 as pair products' operands
// (pairs of bf16 along the summed dimension), a part of at most kMaxPartTokens at a time:
//   scores [16 rows x 16 tokens] = q rows [16 x 32 dims] . key pairs [16 dim pairs x 16 tokens], over the dims;
//   sums   [16 rows x 16 dims]   = probabilities [16 x 32 tokens] . value pairs [16 token pairs x 16 dims].
// On AMX these are tile products; elsewhere (AVX512-BF16 without AMX: a Zen 4) vdpbf16ps takes one query row's
// pair of dims, broadcast, against 16 tokens' pairs, so each lane is one token's score and no horizontal sum is
// needed. Scores are fp32 sums of exact bf16 products (as vdpbf16ps gives the row-at-a-time path); softmax is
// fp32; each probability enters the values' product as two bf16 terms (its rounding and the remainder's), so it
// keeps 16 bits rather than bf16's 8, and the sums stay close to the row-at-a-time path's fp32 probabilities.
#pragma once

#include "amx.h"
#include "bf16_pairs.h"
#include "simd.h"

#if defined(__AVX512BF16__)
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

// The same on vectors: scores 8 query rows by 32 tokens at a time (16 sums in registers, each key pair loaded
// once for the 8 rows), sums 16 / kTiles rows by kTiles dim tiles at a time.
inline void vector_scores(const at::BFloat16* q, int64_t rows, int64_t head_dim, int64_t count, Scratch& s) {
  constexpr int kRows = 8;
  const int64_t pairs = head_dim / 2, token_tiles = (count + 15) / 16, padded32 = (count + 31) / 32 * 32;
  const uint32_t* q_pairs = reinterpret_cast<const uint32_t*>(q);
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {  // q holds 16 rows (zeros past `rows`)
    for (int64_t j = 0; j < token_tiles; j += 2) {
      const uint32_t* keys = s.keys.data() + j * pairs * 16;
      const bool two = j + 1 < token_tiles;
      __m512 acc[kRows][2];
      for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
      for (int64_t i = 0; i < pairs; ++i) {
        const __m512bh a = (__m512bh)_mm512_loadu_si512(keys + i * 16);
        const __m512bh b = two ? (__m512bh)_mm512_loadu_si512(keys + (pairs + i) * 16) : (__m512bh)_mm512_setzero_si512();
        for (int r = 0; r < kRows; ++r) {
          const __m512bh row = (__m512bh)_mm512_set1_epi32(static_cast<int>(q_pairs[(r0 + r) * pairs + i]));
          acc[r][0] = _mm512_dpbf16_ps(acc[r][0], row, a);
          acc[r][1] = _mm512_dpbf16_ps(acc[r][1], row, b);
        }
      }
      for (int r = 0; r < kRows; ++r) {
        _mm512_storeu_ps(s.scores.data() + (r0 + r) * padded32 + j * 16, acc[r][0]);
        if (two) _mm512_storeu_ps(s.scores.data() + (r0 + r) * padded32 + (j + 1) * 16, acc[r][1]);
      }
    }
  }
}

template <int kTiles>
inline void vector_sums(int64_t rows, int64_t head_dim, int64_t padded32, int64_t c0, Scratch& s) {
  constexpr int kRows = 16 / kTiles;
  const int64_t dim_tiles = head_dim / 16, row_pairs = padded32 / 2;
  const uint32_t* high = reinterpret_cast<const uint32_t*>(s.high.data());
  const uint32_t* low = reinterpret_cast<const uint32_t*>(s.low.data());
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {  // high and low hold 16 rows (zeros past `rows`)
    __m512 acc[kRows][kTiles];
    for (int r = 0; r < kRows; ++r)
      for (int c = 0; c < kTiles; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t k = 0; k < padded32 / 32; ++k) {
      const uint32_t* values = s.values.data() + (k * dim_tiles + c0) * 256;
      for (int64_t pair = 0; pair < 16; ++pair) {
        __m512bh v[kTiles];
        for (int c = 0; c < kTiles; ++c) v[c] = (__m512bh)_mm512_loadu_si512(values + c * 256 + pair * 16);
        for (int r = 0; r < kRows; ++r) {
          const int64_t at = (r0 + r) * row_pairs + 16 * k + pair;
          const __m512bh h = (__m512bh)_mm512_set1_epi32(static_cast<int>(high[at]));
          const __m512bh l = (__m512bh)_mm512_set1_epi32(static_cast<int>(low[at]));
          for (int c = 0; c < kTiles; ++c) acc[r][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][c], h, v[c]), l, v[c]);
        }
      }
    }
    for (int r = 0; r < kRows && r0 + r < rows; ++r)
      for (int c = 0; c < kTiles; ++c) _mm512_storeu_ps(s.sums.data() + (r0 + r) * head_dim + (c0 + c) * 16, acc[r][c]);
  }
}

inline void zero_weights_past(int64_t rows, int64_t padded32, Scratch& s) {
  for (int64_t r = rows; r < amx::kTileRows; ++r) {
    std::fill_n(s.high.data() + r * padded32, padded32, at::BFloat16(0.f));
    std::fill_n(s.low.data() + r * padded32, padded32, at::BFloat16(0.f));
  }
}

inline void attend_part_on_vectors(const at::BFloat16* q, int64_t rows, int64_t head_dim, int64_t count, float scale,
                                   Scratch& s, float* maxima, float* totals) {
  const int64_t padded32 = (count + 31) / 32 * 32, dim_tiles = head_dim / 16;
  vector_scores(q, rows, head_dim, count, s);
  for (int64_t r = 0; r < rows; ++r)
    softmax_row(s.scores.data() + r * padded32, count, padded32, scale, s.high.data() + r * padded32,
                s.low.data() + r * padded32, maxima + r, totals + r);
  zero_weights_past(rows, padded32, s);
  for (int64_t c0 = 0; c0 < dim_tiles; c0 += 4) {  // head_dim is a multiple of 32: dim tiles come in pairs
    if (c0 + 4 <= dim_tiles) vector_sums<4>(rows, head_dim, padded32, c0, s);
    else vector_sums<2>(rows, head_dim, padded32, c0, s);
  }
}

#if defined(KVSERVE_AMX)
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
  zero_weights_past(rows, padded32, s);
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
#endif

inline bool applies(int64_t num_rows, int64_t head_dim) {
  return num_rows >= kMinRows && head_dim % amx::kTileValues == 0 && head_dim <= 256;
}

#if defined(KVSERVE_AMX)
// each_row_block(attend_part) with the tiles configured around it.
template <typename F>
__attribute__((target("amx-tile,amx-bf16"))) void on_tiles(F&& each_row_block) {
  const amx::TileConfig config(8);
  _tile_loadconfig(&config);
  each_row_block(attend_part);
  _tile_release();
}
#endif

// `num_rows` bf16 query rows [num_rows x head_dim] over one KV head's tokens [first, end) of a bf16 cache
// [blocks, block_size, num_kv_heads, head_dim] read through `table`: writes partial = unnormalised sums
// [num_rows x head_dim] | row maxima [num_rows] | row sums [num_rows], as the decode tasks do.
inline void attend_rows(const at::BFloat16* q, int64_t num_rows, const at::BFloat16* k_cache,
                        const at::BFloat16* v_cache, const int64_t* table, int64_t block_size, int64_t num_kv_heads,
                        int64_t kv_head, int64_t head_dim, int64_t first, int64_t end, float scale, float* partial) {
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
  auto each_row_block = [&](auto attend) {
    for (int64_t r0 = 0; r0 < num_rows; r0 += amx::kTileRows) {
      const int64_t rows = std::min(amx::kTileRows, num_rows - r0);
      const at::BFloat16* rows_q = q + r0 * head_dim;
      if (rows < amx::kTileRows) {
        s.q.assign(amx::kTileRows * head_dim, at::BFloat16(0.f));
        std::copy_n(rows_q, rows * head_dim, s.q.data());
        rows_q = s.q.data();
      }
      attend(rows_q, rows, head_dim, count, scale, s, maxima + r0, totals + r0);
      std::copy_n(s.sums.data(), rows * head_dim, partial + r0 * head_dim);
    }
  };
#if defined(KVSERVE_AMX)
  if (amx::ready()) return on_tiles(each_row_block);
#endif
  each_row_block(attend_part_on_vectors);
}

}  // namespace tile_attention
#endif
