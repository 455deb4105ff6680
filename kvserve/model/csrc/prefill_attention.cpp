// Prefill attention straight over the paged KV cache, for CPUs with AVX512-BF16 (bf16 models; fp32 models
// have prefill_attention_fp32.cpp).
//
// Every prefill segment of a step (a sequence's new tokens, possibly continuing a cached past) in one call.
// The new tokens' K/V are already in the cache, so keys are read through the block table whatever their age:
// a prefix-cache hit or an earlier chunk costs no gather.
//
// Two phases:
//  1. pack: each (segment, KV head)'s keys and values are copied once into the operand layouts of vdpbf16ps
//     (which multiplies bf16 pairs and accumulates in fp32):
//       K tiles of 16 keys, [head_dim/2][16 keys][2 dims]: one load gives a dim pair for 16 keys;
//       V as [key pairs][head_dim][2 keys]: one load gives 16 dims of a key pair.
//  2. attend: a task is a block of query rows (positions x the KV head's GQA group) that walks its causal key
//     range in chunks with an online softmax (fp32 running max and sum, as flash attention does), so scratch
//     stays in cache at any context length. Scores are fp32, probabilities bf16 for the PV product. On CPUs
//     with AMX both products run on tiles (the packed layouts are already their right operands).
// Segments and tasks are planned as for every prefill kernel (prefill_plan.h).
#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "bf16_pairs.h"
#include "kv_dequant.h"
#include "prefill_plan.h"
#include "simd.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

using prefill::Segment;
using prefill::Shape;

constexpr int64_t kKeyTile = 16;     // keys per packed K tile: one zmm of fp32 scores
constexpr int64_t kChunk = 256;      // keys per online-softmax step (a multiple of kKeyTile)
constexpr int64_t kRowsTarget = 48;  // query rows per task: positions x group
constexpr int kQKRows = 8;           // rows per QK register tile (x 2 key tiles = 16 accumulators)
constexpr int kPVRows = 6;           // rows per PV register tile (x 4 dim chunks = 24 accumulators)
constexpr float kNoScore = -1e30f;   // not -inf: the kernels are built with -ffast-math

inline __m512bh as_bf16_pairs(__m512i x) { return (__m512bh)x; }

// Keys [i0, i0 + count) (count <= 16) from their bf16 rows into the packed layouts: one K tile, and the V pairs
// (a last odd key's pair with zeros).
inline void pack_tile(const uint16_t* const* k_rows, const uint16_t* const* v_rows, int64_t i0, int64_t count,
                      int64_t head_dim, uint16_t* k_packed, uint16_t* v_packed) {
  bf16_pairs::key_tile(k_rows, count, head_dim, reinterpret_cast<uint32_t*>(k_packed + i0 * head_dim), kKeyTile);
  for (int64_t j = 0; j < count; j += 2) {
    uint32_t* pair = reinterpret_cast<uint32_t*>(v_packed + (i0 + j) * head_dim);
    for (int64_t d = 0; d < head_dim; d += 16)
      _mm512_storeu_si512(pair + d, bf16_pairs::value_pairs(v_rows[j], j + 1 < count ? v_rows[j + 1] : nullptr, d));
  }
}

// Copies keys [key_begin, key_begin + num_keys) of one KV head into the packed layouts, a tile of 16 at a time.
void pack_head(const Segment& seg, const uint16_t* k_cache, const uint16_t* v_cache, int64_t block_size,
               int64_t num_kv_heads, int64_t kv_head, int64_t head_dim, uint16_t* k_packed, uint16_t* v_packed) {
  const uint16_t* k_rows[kKeyTile];
  const uint16_t* v_rows[kKeyTile];
  for (int64_t i0 = 0; i0 < seg.num_keys; i0 += kKeyTile) {
    const int64_t count = std::min(kKeyTile, seg.num_keys - i0);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t row = (prefill::key_slot(seg, i0 + j, block_size) * num_kv_heads + kv_head) * head_dim;
      k_rows[j] = k_cache + row;
      v_rows[j] = v_cache + row;
    }
    pack_tile(k_rows, v_rows, i0, count, head_dim, k_packed, v_packed);
  }
}

// The same from a quantized cache (kv_dequant.h): each row decoded to fp32, rounded to bf16 once.
void pack_head_quantized(const Segment& seg, const kvq::Source& keys, const kvq::Source& values, int64_t block_size,
                         int64_t kv_head, int64_t head_dim, uint16_t* k_packed, uint16_t* v_packed) {
  std::vector<float> k_row(head_dim), v_row(head_dim);
  std::vector<uint16_t> k_bits(kKeyTile * head_dim), v_bits(kKeyTile * head_dim);
  const uint16_t* k_rows[kKeyTile];
  const uint16_t* v_rows[kKeyTile];
  for (int64_t i0 = 0; i0 < seg.num_keys; i0 += kKeyTile) {
    const int64_t count = std::min(kKeyTile, seg.num_keys - i0);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t slot = prefill::key_slot(seg, i0 + j, block_size);
      keys.decode(slot, kv_head, k_row.data());
      values.decode(slot, kv_head, v_row.data());
      for (int64_t d = 0; d < head_dim; ++d) {
        k_bits[j * head_dim + d] = c10::BFloat16(k_row[d]).x;
        v_bits[j * head_dim + d] = c10::BFloat16(v_row[d]).x;
      }
      k_rows[j] = k_bits.data() + j * head_dim;
      v_rows[j] = v_bits.data() + j * head_dim;
    }
    pack_tile(k_rows, v_rows, i0, count, head_dim, k_packed, v_packed);
  }
}

// scores[r][t * 16 + lane] = q_r . k_(t * 16 + lane) for kTiles key tiles.
template <int kRows, int kTiles>
inline void qk_tile(const uint32_t* const* q_rows, const uint16_t* k_tiles, int64_t head_dim, float* scores,
                    int64_t stride) {
  __m512 acc[kRows][kTiles];
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kTiles; ++t) acc[r][t] = _mm512_setzero_ps();
  const int64_t half = head_dim / 2;
  for (int64_t dp = 0; dp < half; ++dp) {
    __m512bh k[kTiles];
    for (int t = 0; t < kTiles; ++t)
      k[t] = as_bf16_pairs(_mm512_loadu_si512(k_tiles + t * kKeyTile * head_dim + dp * 2 * kKeyTile));
    for (int r = 0; r < kRows; ++r) {
      const __m512bh q = as_bf16_pairs(_mm512_set1_epi32(static_cast<int>(q_rows[r][dp])));
      for (int t = 0; t < kTiles; ++t) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], q, k[t]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kTiles; ++t) _mm512_storeu_ps(scores + r * stride + t * kKeyTile, acc[r][t]);
}

template <int kRows>
void qk_rows(const uint32_t* const* q_rows, const uint16_t* k_tiles, int64_t num_tiles, int64_t head_dim,
             float* scores, int64_t stride) {
  int64_t t = 0;
  for (; t + 2 <= num_tiles; t += 2)
    qk_tile<kRows, 2>(q_rows, k_tiles + t * kKeyTile * head_dim, head_dim, scores + t * kKeyTile, stride);
  if (t < num_tiles) qk_tile<kRows, 1>(q_rows, k_tiles + t * kKeyTile * head_dim, head_dim, scores + t * kKeyTile, stride);
}

// acc[r][0:64] += sum over key pairs of p[r][pair] * v[pair][0:64], for one 64-dim slice of the head.
template <int kRows>
inline void pv_tile(const uint32_t* probs, int64_t probs_stride, const uint16_t* v_pairs, int64_t num_pairs,
                    int64_t head_dim, float* acc, int64_t acc_stride) {
  __m512 sum[kRows][4];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) sum[r][c] = _mm512_loadu_ps(acc + r * acc_stride + c * 16);
  for (int64_t jp = 0; jp < num_pairs; ++jp) {
    const uint16_t* row = v_pairs + jp * 2 * head_dim;
    __m512bh v[4];
    for (int c = 0; c < 4; ++c) v[c] = as_bf16_pairs(_mm512_loadu_si512(row + c * 32));
    for (int r = 0; r < kRows; ++r) {
      const __m512bh p = as_bf16_pairs(_mm512_set1_epi32(static_cast<int>(probs[r * probs_stride + jp])));
      for (int c = 0; c < 4; ++c) sum[r][c] = _mm512_dpbf16_ps(sum[r][c], p, v[c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + r * acc_stride + c * 16, sum[r][c]);
}

template <int kRows>
void pv_slices(const uint32_t* probs, int64_t probs_stride, const uint16_t* v_pairs, int64_t num_pairs,
               int64_t head_dim, float* acc, int64_t acc_stride) {
  for (int64_t d = 0; d < head_dim; d += 64)
    pv_tile<kRows>(probs, probs_stride, v_pairs + 2 * d, num_pairs, head_dim, acc + d, acc_stride);
}

// Runtime row count -> compile-time register tile.
template <int kMax, template <int> class Fn, typename... Args>
void dispatch_rows(int rows, Args&&... args) {
  if constexpr (kMax > 0) {
    if (rows == kMax) return Fn<kMax>::run(std::forward<Args>(args)...);
    return dispatch_rows<kMax - 1, Fn>(rows, std::forward<Args>(args)...);
  }
}
template <int kRows> struct QK { template <typename... A> static void run(A&&... a) { qk_rows<kRows>(a...); } };
template <int kRows> struct PV { template <typename... A> static void run(A&&... a) { pv_slices<kRows>(a...); } };

#if defined(KVSERVE_AMX)
// On CPUs with AMX both products run on tiles, 16 query rows at a time (q copied into dense rows, padded with
// zero rows): the packed K tiles above are already a tile product's right operand ([dim pairs][16 keys]), and so
// are 16 V pairs of 16 dims ([key pairs][dims][2 keys], rows 2 x head_dim apart). Tiles: 0 the result, 1 the
// left operand, 2 the right one.
__attribute__((target("amx-tile,amx-bf16"))) void qk_tiles(const uint16_t* q_dense, int64_t padded_rows,
                                                             const uint16_t* k_tiles, int64_t num_tiles,
                                                             int64_t head_dim, float* scores, int64_t stride) {
  const amx::TileConfig config(3);
  _tile_loadconfig(&config);
  for (int64_t r0 = 0; r0 < padded_rows; r0 += amx::kTileRows)
    for (int64_t t = 0; t < num_tiles; ++t) {
      _tile_zero(0);
      for (int64_t c = 0; c < head_dim / amx::kTileValues; ++c) {
        _tile_loadd(1, q_dense + r0 * head_dim + c * amx::kTileValues, head_dim * 2);
        _tile_loadd(2, k_tiles + t * kKeyTile * head_dim + c * amx::kTileValues * kKeyTile, 2 * kKeyTile * 2);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, scores + r0 * stride + t * kKeyTile, stride * 4);
    }
  _tile_release();
}

// acc[rows][head_dim] += probs [rows x key pairs] . V pairs, over num_pairs (a multiple of 16: the probabilities
// past the chunk's keys are zero, the packed buffer holds whole chunks).
__attribute__((target("amx-tile,amx-bf16"))) void pv_tiles(const uint32_t* probs, int64_t probs_stride,
                                                             int64_t padded_rows, const uint16_t* v_pairs,
                                                             int64_t num_pairs, int64_t head_dim, float* acc) {
  const amx::TileConfig config(3);
  _tile_loadconfig(&config);
  for (int64_t r0 = 0; r0 < padded_rows; r0 += amx::kTileRows)
    for (int64_t c = 0; c < head_dim / 16; ++c) {
      float* out = acc + r0 * head_dim + c * 16;
      _tile_loadd(0, out, head_dim * 4);
      for (int64_t jp = 0; jp < num_pairs; jp += 16) {
        _tile_loadd(1, probs + r0 * probs_stride + jp, probs_stride * 4);
        _tile_loadd(2, v_pairs + jp * 2 * head_dim + c * 32, head_dim * 4);
        _tile_dpbf16ps(0, 1, 2);
      }
      _tile_stored(0, out, head_dim * 4);
    }
  _tile_release();
}
#endif

struct Scratch {
  std::vector<float> scores, acc, row_max, row_sum;
  std::vector<uint32_t> probs;  // bf16 pairs
  std::vector<const uint32_t*> q_rows;
  std::vector<uint16_t> q_dense;  // AMX: the task's query rows, dense and padded to whole tiles
};

// One task: query positions [first, first + count) of a segment, for the query heads of one KV head.
void attend_block(const Segment& seg, int64_t kv_head, int64_t first, int64_t count, const Shape& shape,
                  const uint16_t* q, const uint16_t* k_packed, const uint16_t* v_packed, uint16_t* out,
                  Scratch& s) {
  const int64_t group = shape.group, head_dim = shape.head_dim, rows = count * group;
  const int64_t stride = kChunk;
#if defined(KVSERVE_AMX)
  const bool tiles = amx::ready();
#else
  constexpr bool tiles = false;
#endif
  const int64_t padded_rows = tiles ? (rows + amx::kTileRows - 1) / amx::kTileRows * amx::kTileRows : rows;
  s.scores.resize(padded_rows * stride);
  s.probs.resize(padded_rows * stride / 2);
  s.acc.assign(padded_rows * head_dim, 0.f);
  s.row_max.assign(rows, kNoScore);
  s.row_sum.assign(rows, 0.f);
  s.q_rows.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = seg.token_start + first + r / group;
    const int64_t head = kv_head * group + r % group;
    s.q_rows[r] = reinterpret_cast<const uint32_t*>(q + token * shape.q_stride + head * head_dim);
  }
  if (tiles) {
    s.q_dense.assign(padded_rows * head_dim, 0);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(s.q_dense.data() + r * head_dim, s.q_rows[r], head_dim * sizeof(uint16_t));
    std::fill(s.probs.begin() + rows * stride / 2, s.probs.end(), 0u);  // padding rows weigh nothing
  }
  // Causal range of the block: up to its last position; from the window start of its first position.
  const int64_t first_pos = seg.num_past + first, end_pos = seg.num_past + first + count;
  int64_t lo = seg.key_begin;
  if (shape.sliding_window > 0) lo = std::max(lo, first_pos - shape.sliding_window + 1);
  lo = seg.key_begin + (lo - seg.key_begin) / kKeyTile * kKeyTile;
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 scale = _mm512_set1_ps(shape.scale);
  for (int64_t chunk = lo; chunk < end_pos; chunk += kChunk) {
    const int64_t num_keys = std::min(kChunk, end_pos - chunk);
    const int64_t num_tiles = (num_keys + kKeyTile - 1) / kKeyTile;
    const uint16_t* k_tiles = k_packed + (chunk - seg.key_begin) * head_dim;
#if defined(KVSERVE_AMX)
    if (tiles) qk_tiles(s.q_dense.data(), padded_rows, k_tiles, num_tiles, head_dim, s.scores.data(), stride);
#endif
    for (int64_t r = 0; r < rows && !tiles; r += kQKRows)
      dispatch_rows<kQKRows, QK>(static_cast<int>(std::min<int64_t>(kQKRows, rows - r)), s.q_rows.data() + r,
                                 k_tiles, num_tiles, head_dim, s.scores.data() + r * stride, stride);
    // Online softmax: rescale each row's running sum and output by e^(old max - new max).
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = seg.num_past + first + r / group;
      const __m512i last_visible = _mm512_set1_epi32(static_cast<int>(pos - chunk));
      const __m512i first_visible = _mm512_set1_epi32(
          static_cast<int>(shape.sliding_window > 0 ? pos - shape.sliding_window + 1 - chunk : -1));
      float* row = s.scores.data() + r * stride;
      __m512 max_v = _mm512_set1_ps(kNoScore);
      for (int64_t t = 0; t < num_tiles; ++t) {
        const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(t * kKeyTile)));
        const __mmask16 visible = _mm512_cmple_epi32_mask(key, last_visible) & _mm512_cmpge_epi32_mask(key, first_visible);
        const __m512 v = _mm512_mask_mul_ps(_mm512_set1_ps(kNoScore), visible, _mm512_loadu_ps(row + t * kKeyTile), scale);
        _mm512_storeu_ps(row + t * kKeyTile, v);
        max_v = _mm512_max_ps(max_v, v);
      }
      const float old_max = s.row_max[r];
      const float new_max = std::max(old_max, _mm512_reduce_max_ps(max_v));
      const __m512 shift = _mm512_set1_ps(new_max);
      __m512 sum_v = _mm512_setzero_ps();
      __m256bh* probs = reinterpret_cast<__m256bh*>(s.probs.data() + r * stride / 2);
      for (int64_t t = 0; t < num_tiles; ++t) {
        const __m512 v = _mm512_loadu_ps(row + t * kKeyTile);
        const __mmask16 visible = _mm512_cmp_ps_mask(v, _mm512_set1_ps(kNoScore), _CMP_GT_OQ);
        const __m512 p = _mm512_maskz_mov_ps(visible, simd::exp_nonpositive(_mm512_sub_ps(v, shift)));
        sum_v = _mm512_add_ps(sum_v, p);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + t), (__m256i)_mm512_cvtneps_pbh(p));
      }
      if (tiles && num_tiles % 2) _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + num_tiles), _mm256_setzero_si256());
      const float correction = old_max == new_max ? 1.f : std::exp(old_max - new_max);
      s.row_sum[r] = s.row_sum[r] * correction + _mm512_reduce_add_ps(sum_v);
      s.row_max[r] = new_max;
      if (correction != 1.f) {
        float* acc = s.acc.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
      }
    }
    const int64_t num_pairs = num_tiles * kKeyTile / 2;
    const uint16_t* v_pairs = v_packed + (chunk - seg.key_begin) * head_dim;
#if defined(KVSERVE_AMX)
    if (tiles)  // key pairs in whole tiles of 16: an odd tile of keys was followed by zero probabilities above
      pv_tiles(s.probs.data(), stride / 2, padded_rows, v_pairs, (num_pairs + 15) / 16 * 16, head_dim, s.acc.data());
#endif
    for (int64_t r = 0; r < rows && !tiles; r += kPVRows)
      dispatch_rows<kPVRows, PV>(static_cast<int>(std::min<int64_t>(kPVRows, rows - r)),
                                 s.probs.data() + r * stride / 2, stride / 2, v_pairs, num_pairs, head_dim,
                                 s.acc.data() + r * head_dim, head_dim);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = seg.token_start + first + r / group;
    const int64_t head = kv_head * group + r % group;
    const float inv = 1.f / s.row_sum[r];
    at::BFloat16* dst = reinterpret_cast<at::BFloat16*>(out + token * shape.out_stride + head * head_dim);
    const float* acc = s.acc.data() + r * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<at::BFloat16>(acc[d] * inv);
  }
}

}  // namespace

namespace {

// Plans, packs each (segment, KV head) with pack(seg, head, k_dst, v_dst), and attends; `cache_shape` is the
// cache's [num_blocks, block_size, num_kv_heads, ...].
template <typename Pack>
void prefill_bf16(const at::Tensor& q, at::IntArrayRef cache_shape, const at::Tensor& block_tables,
                  const at::Tensor& query_starts, const at::Tensor& num_past, double scale,
                  int64_t sliding_window, at::Tensor& out, Pack&& pack) {
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16,
              "the bf16 prefill kernel takes a bf16 query and output");
  const Shape shape = prefill::query_shape(q, out, cache_shape, 64, scale, sliding_window);
  const uint16_t* q_ptr = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  uint16_t* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  prefill::pack_and_attend<Scratch, uint16_t>(
      shape, block_tables, query_starts, num_past, kChunk, kRowsTarget, q.options(), pack,
      [&](const prefill::Task& t, const Segment& seg, const uint16_t* k_src, const uint16_t* v_src, Scratch& scratch) {
        attend_block(seg, t.kv_head, t.first, t.count, shape, q_ptr, k_src, v_src, out_ptr, scratch);
      });
}

}  // namespace

// q: [tokens, num_heads, head_dim] bf16 (token stride free: a view of the fused qkv works); out: [tokens,
// num_heads * head_dim] bf16, written only at the segments' rows. caches: [num_blocks, block_size,
// num_kv_heads, head_dim] bf16, already holding the new tokens' K/V. Segment s covers query rows
// [query_starts[s], query_starts[s + 1]) at context positions num_past[s].. ; block_tables: [segments,
// max_blocks] int64. sliding_window <= 0 means none.
void paged_prefill_attention_bf16(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor query_starts, at::Tensor num_past,
                                  double scale, int64_t sliding_window, at::Tensor out) {
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "paged_prefill_attention_bf16 takes a bf16 cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches contiguous");
  const int64_t head_dim = q.size(2), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const uint16_t* k_ptr = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const uint16_t* v_ptr = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  prefill_bf16(q, k_cache.sizes(), block_tables, query_starts, num_past, scale, sliding_window, out,
               [&](const Segment& seg, int64_t h, uint16_t* k_dst, uint16_t* v_dst) {
                 pack_head(seg, k_ptr, v_ptr, block_size, num_kv_heads, h, head_dim, k_dst, v_dst);
               });
}

// The same over a quantized cache (the arguments of paged_decode_attention_quantized).
void paged_prefill_attention_bf16_quantized(at::Tensor q, at::Tensor k_data, at::Tensor v_data,
                                            at::Tensor k_scales, at::Tensor v_scales, double k_tensor_scale,
                                            double v_tensor_scale, int64_t format, at::Tensor block_tables,
                                            at::Tensor query_starts, at::Tensor num_past, double scale,
                                            int64_t sliding_window, at::Tensor out) {
  const int64_t head_dim = q.size(2), block_size = k_data.size(1);
  const kvq::Source keys = kvq::make_source(k_data, k_scales, k_tensor_scale, format, head_dim, true);
  const kvq::Source values = kvq::make_source(v_data, v_scales, v_tensor_scale, format, head_dim, false);
  prefill_bf16(q, k_data.sizes(), block_tables, query_starts, num_past, scale, sliding_window, out,
               [&](const Segment& seg, int64_t h, uint16_t* k_dst, uint16_t* v_dst) {
                 pack_head_quantized(seg, keys, values, block_size, h, head_dim, k_dst, v_dst);
               });
}

bool has_prefill_attention_bf16() { return true; }

#else

void paged_prefill_attention_bf16(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                  at::Tensor, double, int64_t, at::Tensor) {
  TORCH_CHECK(false, "the bf16 prefill attention kernel needs a CPU with AVX512-BF16");
}

bool has_prefill_attention_bf16() { return false; }

void paged_prefill_attention_bf16_quantized(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                            double, double, int64_t, at::Tensor, at::Tensor, at::Tensor,
                                            double, int64_t, at::Tensor) {
  TORCH_CHECK(false, "the bf16 prefill attention kernel needs a CPU with AVX512-BF16");
}

#endif
