// Prefill attention straight over the paged KV cache for fp32 models: the dtype CPUs without native bf16
// dot products compute in. Written once over simd.h's vector type, so it runs on AVX-512 and on AVX2 + FMA.
//
// The plan is the bf16 kernel's (prefill_attention.cpp, prefill_plan.h): every prefill segment of a step in one
// call, keys read through the block table whatever their age (a cached past costs no gather), packed once
// per (segment, KV head):
//   K tiles of kLanes keys, [head_dim][kLanes]: one load gives one dimension of kLanes keys, so a broadcast
//     query element times a tile row accumulates kLanes scores;
//   V rows [keys][head_dim], as in the cache but contiguous.
// A task (a block of query positions x one KV head's GQA group) walks its causal key range in chunks with an
// online softmax (running max and sum, as flash attention does).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "kv_dequant.h"
#include "prefill_plan.h"
#include "simd.h"

#if defined(KVSERVE_SIMD)

namespace {

using prefill::Segment;
using prefill::Shape;
using simd::Simd;

constexpr int64_t kLanes = Simd::kLanes;
constexpr int64_t kChunk = 256;      // keys per online-softmax step (a multiple of kLanes)
constexpr int64_t kRowsTarget = 48;  // query rows per task: positions x group
// Register tiles: QK holds kQKRows x 2 key tiles of scores, PV kPVRows x (up to) 4 vectors of the head.
constexpr int kQKRows = Simd::kRegisters >= 32 ? 8 : 4;
constexpr int kPVRows = Simd::kRegisters >= 32 ? 6 : 2;
constexpr float kNoScore = -1e30f;        // not -inf: the kernels are built with -ffast-math

// A 16-bit cache (bf16 or fp16 under an fp32 model) is widened here, once per key, never in the inner loops.
template <typename cache_t>
void pack_head(const Segment& seg, const cache_t* k_cache, const cache_t* v_cache, int64_t block_size,
               int64_t num_kv_heads, int64_t kv_head, int64_t head_dim, float* k_packed, float* v_packed) {
  for (int64_t i = 0; i < seg.num_keys; ++i) {
    const int64_t slot = prefill::key_slot(seg, i, block_size);
    const cache_t* k_row = k_cache + (slot * num_kv_heads + kv_head) * head_dim;
    const cache_t* v_row = v_cache + (slot * num_kv_heads + kv_head) * head_dim;
    float* tile = k_packed + (i / kLanes) * kLanes * head_dim + i % kLanes;
    for (int64_t d = 0; d < head_dim; ++d) tile[d * kLanes] = static_cast<float>(k_row[d]);
    if constexpr (std::is_same_v<cache_t, float>) {
      std::memcpy(v_packed + i * head_dim, v_row, head_dim * sizeof(float));
    } else {
      for (int64_t d = 0; d < head_dim; ++d) v_packed[i * head_dim + d] = static_cast<float>(v_row[d]);
    }
  }
}

// A quantized cache (kv_dequant.h) is decoded here, once per key, into the same layouts.
void pack_head_quantized(const Segment& seg, const kvq::Source& keys, const kvq::Source& values, int64_t block_size,
                         int64_t kv_head, int64_t head_dim, float* k_packed, float* v_packed, std::vector<float>& row) {
  row.resize(head_dim);
  for (int64_t i = 0; i < seg.num_keys; ++i) {
    const int64_t slot = prefill::key_slot(seg, i, block_size);
    keys.decode(slot, kv_head, row.data());
    float* tile = k_packed + (i / kLanes) * kLanes * head_dim + i % kLanes;
    for (int64_t d = 0; d < head_dim; ++d) tile[d * kLanes] = row[d];
    values.decode(slot, kv_head, v_packed + i * head_dim);
  }
}

// scores[r][t * kLanes + lane] = q_r . k_(t * kLanes + lane) for kTiles key tiles.
template <int kRows, int kTiles>
inline void qk_tile(const float* const* q_rows, const float* k_tiles, int64_t head_dim, float* scores, int64_t stride) {
  Simd::V acc[kRows][kTiles];
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kTiles; ++t) acc[r][t] = Simd::zero();
  for (int64_t d = 0; d < head_dim; ++d) {
    Simd::V k[kTiles];
    for (int t = 0; t < kTiles; ++t) k[t] = Simd::load(k_tiles + t * kLanes * head_dim + d * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const Simd::V q = Simd::set1(q_rows[r][d]);
      for (int t = 0; t < kTiles; ++t) acc[r][t] = Simd::fmadd(q, k[t], acc[r][t]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int t = 0; t < kTiles; ++t) Simd::store(scores + r * stride + t * kLanes, acc[r][t]);
}

template <int kRows>
void qk_rows(const float* const* q_rows, const float* k_tiles, int64_t num_tiles, int64_t head_dim, float* scores,
             int64_t stride) {
  int64_t t = 0;
  for (; t + 2 <= num_tiles; t += 2)
    qk_tile<kRows, 2>(q_rows, k_tiles + t * kLanes * head_dim, head_dim, scores + t * kLanes, stride);
  if (t < num_tiles) qk_tile<kRows, 1>(q_rows, k_tiles + t * kLanes * head_dim, head_dim, scores + t * kLanes, stride);
}

// acc[r][0:kVecs lanes] += sum over keys j of p[r][j] * v[j][0:kVecs lanes], for one slice of the head.
template <int kRows, int kVecs>
inline void pv_tile(const float* probs, int64_t probs_stride, const float* v_rows, int64_t num_keys, int64_t head_dim,
                    float* acc, int64_t acc_stride) {
  Simd::V sum[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) sum[r][c] = Simd::load(acc + r * acc_stride + c * kLanes);
  for (int64_t j = 0; j < num_keys; ++j) {
    Simd::V v[kVecs];
    for (int c = 0; c < kVecs; ++c) v[c] = Simd::load(v_rows + j * head_dim + c * kLanes);
    for (int r = 0; r < kRows; ++r) {
      const Simd::V p = Simd::set1(probs[r * probs_stride + j]);
      for (int c = 0; c < kVecs; ++c) sum[r][c] = Simd::fmadd(p, v[c], sum[r][c]);
    }
  }
  for (int r = 0; r < kRows; ++r)
    for (int c = 0; c < kVecs; ++c) Simd::store(acc + r * acc_stride + c * kLanes, sum[r][c]);
}

// The head in slices of 4 vectors (2 or 1 for heads narrower than that, such as the tests' 16-dim ones).
template <int kRows>
void pv_slices(const float* probs, int64_t probs_stride, const float* v_rows, int64_t num_keys, int64_t head_dim,
               float* acc, int64_t acc_stride) {
  const int64_t vecs = head_dim % (4 * kLanes) == 0 ? 4 : head_dim % (2 * kLanes) == 0 ? 2 : 1;
  for (int64_t d = 0; d < head_dim; d += vecs * kLanes) {
    if (vecs == 4) pv_tile<kRows, 4>(probs, probs_stride, v_rows + d, num_keys, head_dim, acc + d, acc_stride);
    else if (vecs == 2) pv_tile<kRows, 2>(probs, probs_stride, v_rows + d, num_keys, head_dim, acc + d, acc_stride);
    else pv_tile<kRows, 1>(probs, probs_stride, v_rows + d, num_keys, head_dim, acc + d, acc_stride);
  }
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

struct Scratch {
  std::vector<float> scores, acc, row_max, row_sum;
  std::vector<const float*> q_rows;
};

// Scales a row's visible scores [first_visible, last_visible] (chunk-relative), hides the rest, and turns them
// into e^(score - new max) in place; returns (new max, sum of the exponentials).
std::pair<float, float> softmax_chunk_row(float* row, int64_t num_keys_padded, int64_t first_visible,
                                          int64_t last_visible, float scale, float old_max) {
  for (int64_t j = 0; j < num_keys_padded; ++j)
    row[j] = j >= first_visible && j <= last_visible ? row[j] * scale : kNoScore;
  Simd::V max_v = Simd::set1(kNoScore);
  for (int64_t j = 0; j < num_keys_padded; j += kLanes) max_v = Simd::max(max_v, Simd::load(row + j));
  const float new_max = std::max(old_max, Simd::reduce_max(max_v));
  const Simd::V shift = Simd::set1(new_max), hidden = Simd::set1(kNoScore * 0.5f);
  Simd::V sum_v = Simd::zero();
  for (int64_t j = 0; j < num_keys_padded; j += kLanes) {
    const Simd::V v = Simd::load(row + j);
    const Simd::V p = Simd::keep_where_greater(simd::exp_nonpositive(Simd::sub(v, shift)), v, hidden);
    sum_v = Simd::add(sum_v, p);
    Simd::store(row + j, p);
  }
  return {new_max, Simd::reduce_add(sum_v)};
}

// One task: query positions [first, first + count) of a segment, for the query heads of one KV head.
void attend_block(const Segment& seg, int64_t kv_head, int64_t first, int64_t count, const Shape& shape,
                  const float* q, const float* k_packed, const float* v_packed, float* out, Scratch& s) {
  const int64_t group = shape.group, head_dim = shape.head_dim, rows = count * group;
  const int64_t stride = kChunk;
  s.scores.resize(rows * stride);
  s.acc.assign(rows * head_dim, 0.f);
  s.row_max.assign(rows, kNoScore);
  s.row_sum.assign(rows, 0.f);
  s.q_rows.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = seg.token_start + first + r / group;
    s.q_rows[r] = q + token * shape.q_stride + (kv_head * group + r % group) * head_dim;
  }
  // Causal range of the block: up to its last position; from the window start of its first position.
  const int64_t first_pos = seg.num_past + first, end_pos = seg.num_past + first + count;
  int64_t lo = seg.key_begin;
  if (shape.sliding_window > 0) lo = std::max(lo, first_pos - shape.sliding_window + 1);
  lo = seg.key_begin + (lo - seg.key_begin) / kLanes * kLanes;
  for (int64_t chunk = lo; chunk < end_pos; chunk += kChunk) {
    const int64_t num_keys = std::min(kChunk, end_pos - chunk);
    const int64_t num_tiles = (num_keys + kLanes - 1) / kLanes;
    const float* k_tiles = k_packed + (chunk - seg.key_begin) * head_dim;
    for (int64_t r = 0; r < rows; r += kQKRows)
      dispatch_rows<kQKRows, QK>(static_cast<int>(std::min<int64_t>(kQKRows, rows - r)), s.q_rows.data() + r,
                                 k_tiles, num_tiles, head_dim, s.scores.data() + r * stride, stride);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t pos = seg.num_past + first + r / group;
      const int64_t first_visible = shape.sliding_window > 0 ? pos - shape.sliding_window + 1 - chunk : 0;
      const auto [new_max, chunk_sum] = softmax_chunk_row(s.scores.data() + r * stride, num_tiles * kLanes,
                                                          first_visible, pos - chunk, shape.scale, s.row_max[r]);
      // Online softmax: rescale the row's running sum and output by e^(old max - new max).
      const float correction = s.row_max[r] == new_max ? 1.f : std::exp(s.row_max[r] - new_max);
      s.row_sum[r] = s.row_sum[r] * correction + chunk_sum;
      s.row_max[r] = new_max;
      if (correction != 1.f) {
        float* acc = s.acc.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) acc[d] *= correction;
      }
    }
    const float* v_rows = v_packed + (chunk - seg.key_begin) * head_dim;
    for (int64_t r = 0; r < rows; r += kPVRows)
      dispatch_rows<kPVRows, PV>(static_cast<int>(std::min<int64_t>(kPVRows, rows - r)), s.scores.data() + r * stride,
                                 stride, v_rows, num_tiles * kLanes, head_dim, s.acc.data() + r * head_dim, head_dim);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = seg.token_start + first + r / group;
    float* dst = out + token * shape.out_stride + (kv_head * group + r % group) * head_dim;
    const float inv = 1.f / s.row_sum[r];
    const float* acc = s.acc.data() + r * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[d] * inv;
  }
}

}  // namespace

namespace {

// Plans, packs each (segment, KV head) with pack(seg, head, k_dst, v_dst), and attends; `cache_shape` is the
// cache's [num_blocks, block_size, num_kv_heads, ...].
template <typename Pack>
void prefill_fp32(const at::Tensor& q, at::IntArrayRef cache_shape, const at::Tensor& block_tables,
                  const at::Tensor& query_starts, const at::Tensor& num_past, double scale,
                  int64_t sliding_window, at::Tensor& out, Pack&& pack) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat,
              "the fp32 prefill kernel takes an fp32 query and output");
  const Shape shape = prefill::query_shape(q, out, cache_shape, kLanes, scale, sliding_window);
  const float* q_ptr = q.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  prefill::pack_and_attend<Scratch, float>(
      shape, block_tables, query_starts, num_past, kChunk, kRowsTarget, q.options(), pack,
      [&](const prefill::Task& t, const Segment& seg, const float* k_src, const float* v_src, Scratch& scratch) {
        attend_block(seg, t.kv_head, t.first, t.count, shape, q_ptr, k_src, v_src, out_ptr, scratch);
      });
}

}  // namespace

// Same contract as paged_prefill_attention_bf16, in fp32: q [tokens, num_heads, head_dim] (token stride free),
// out [tokens, num_heads * head_dim] written only at the segments' rows, caches holding the new tokens' K/V
// (fp32, or bf16/fp16 under an fp32 model, widened while packing).
void paged_prefill_attention_fp32(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor query_starts, at::Tensor num_past,
                                  double scale, int64_t sliding_window, at::Tensor out) {
  const auto cache_type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_type &&
              (cache_type == at::kFloat || cache_type == at::kBFloat16 || cache_type == at::kHalf),
              "paged_prefill_attention_fp32 takes an fp32, bf16 or fp16 cache");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches contiguous");
  const int64_t head_dim = q.size(2), block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  prefill_fp32(q, k_cache.sizes(), block_tables, query_starts, num_past, scale, sliding_window, out,
               [&](const Segment& seg, int64_t h, float* k_dst, float* v_dst) {
                 if (cache_type == at::kBFloat16)
                   pack_head(seg, k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), block_size,
                             num_kv_heads, h, head_dim, k_dst, v_dst);
                 else if (cache_type == at::kHalf)
                   pack_head(seg, k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), block_size, num_kv_heads,
                             h, head_dim, k_dst, v_dst);
                 else
                   pack_head(seg, k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), block_size, num_kv_heads, h,
                             head_dim, k_dst, v_dst);
               });
}

// The same over a quantized cache (the arguments of paged_decode_attention_quantized).
void paged_prefill_attention_fp32_quantized(at::Tensor q, at::Tensor k_data, at::Tensor v_data,
                                            at::Tensor k_scales, at::Tensor v_scales, double k_tensor_scale,
                                            double v_tensor_scale, int64_t format, at::Tensor block_tables,
                                            at::Tensor query_starts, at::Tensor num_past, double scale,
                                            int64_t sliding_window, at::Tensor out) {
  const int64_t head_dim = q.size(2), block_size = k_data.size(1);
  const kvq::Source keys = kvq::make_source(k_data, k_scales, k_tensor_scale, format, head_dim, true);
  const kvq::Source values = kvq::make_source(v_data, v_scales, v_tensor_scale, format, head_dim, false);
  prefill_fp32(q, k_data.sizes(), block_tables, query_starts, num_past, scale, sliding_window, out,
               [&](const Segment& seg, int64_t h, float* k_dst, float* v_dst) {
                 thread_local std::vector<float> row;
                 pack_head_quantized(seg, keys, values, block_size, h, head_dim, k_dst, v_dst, row);
               });
}

int64_t prefill_attention_fp32_head_dim_multiple() { return kLanes; }

#else

void paged_prefill_attention_fp32(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                  at::Tensor, double, int64_t, at::Tensor) {
  TORCH_CHECK(false, "the fp32 prefill attention kernel needs AVX2 + FMA or AVX-512");
}

int64_t prefill_attention_fp32_head_dim_multiple() { return 0; }

void paged_prefill_attention_fp32_quantized(at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                            double, double, int64_t, at::Tensor, at::Tensor, at::Tensor,
                                            double, int64_t, at::Tensor) {
  TORCH_CHECK(false, "the fp32 prefill attention kernel needs AVX2 + FMA or AVX-512");
}

#endif
