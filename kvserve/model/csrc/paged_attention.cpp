// Decode attention straight over the paged KV cache, for CPUs.
//
// One query token per sequence. Each (sequence, KV head) pair is one task: its query heads (the GQA group)
// walk the sequence's blocks through the block table, so K and V are read exactly once, in place; nothing is
// gathered or padded. With fewer pairs than threads, contexts are split into parts whose partial results are
// merged (flash decoding). Scores and softmax are fp32; the output is written in the query's dtype.
// Built once per ISA family (simd.h): AVX-512 (with vdpbf16ps scores where AVX512-BF16 is, and VNNI integer
// scores over int8/int4 caches beside it), AVX2 + FMA, and plain C++ for anything else.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <memory>
#include <type_traits>
#include <vector>

#include "kv_dequant.h"
#include "simd.h"
#include "tile_attention.h"

namespace {

constexpr int64_t kMinPartTokens = 256;  // the shortest stretch of context one decode task takes on

// Rows are widened to fp32 in a separate loop the compiler can vectorise (bf16 -> fp32 is a 16-bit shift).
template <typename scalar_t>
inline void to_float(const scalar_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void to_float<at::BFloat16>(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

using simd::Fp8E4m3;
using simd::Fp8E5m2;
template <>
inline void to_float<Fp8E4m3>(const Fp8E4m3* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = simd::to_float(src[i]);
}
template <>
inline void to_float<Fp8E5m2>(const Fp8E5m2* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = simd::to_float(src[i]);
}

#if defined(KVSERVE_SIMD)
// Asks for a cache row ahead of use: the context of a decode step is usually out of cache (30 layers of a
// batch's KV exceed L3), and its rows are strided, which hardware prefetchers follow poorly. Every request in
// this file is into L2 (prefetcht1): a context row is read once, soon after, and requests into L1 hold the
// core's few L1 miss buffers, which capped how many rows were on their way (RESULTS.md, section 32).
constexpr int64_t kPrefetchDistance = 64;  // tokens
template <typename scalar_t>
inline void prefetch_row(const scalar_t* row, int64_t head_dim) {
  for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(scalar_t)); byte += 64)
    _mm_prefetch(reinterpret_cast<const char*>(row) + byte, _MM_HINT_T1);
}

// Before scoring keys [t0, t0 + 16): asks for the K and V rows up to kPrefetchDistance tokens ahead that are not
// on their way yet (all of them at t0 = 0), so they arrive while these are summed. The values pass then finds its
// rows in L2: a decode step is bound by how many misses are in flight, not by DRAM's bandwidth, and asking for V
// beside K doubles them (1.2x at 8 x 4,096 tokens, bf16 or int8).
template <typename scalar_t>
inline void prefetch_ahead(const scalar_t* k_cache, const scalar_t* v_cache, const std::vector<int64_t>& offsets,
                           int64_t t0, int64_t head_dim) {
  const int64_t num_tokens = static_cast<int64_t>(offsets.size());
  for (int64_t i = t0 == 0 ? 0 : t0 + kPrefetchDistance - 16; i < std::min(t0 + kPrefetchDistance, num_tokens); ++i) {
    prefetch_row(k_cache + offsets[i], head_dim);
    prefetch_row(v_cache + offsets[i], head_dim);
  }
}

// A chunk's two fp16 scales, as [first, second, ...].
inline __m128 int4_chunk_scales(const uint16_t* scales) {
  uint32_t pair;
  std::memcpy(&pair, scales, sizeof(pair));
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(pair)));
}

// Asks for a row's codes and scales (rows: (slot, KV head) indices; int4 keys' scales are per block).
inline void prefetch_int4_row(const kvq::Source& source, int64_t row) {
  _mm_prefetch(reinterpret_cast<const char*>(source.data + row * source.data_dim()), _MM_HINT_T1);
  if (!source.channel_keys())
    _mm_prefetch(reinterpret_cast<const char*>(static_cast<const uint16_t*>(source.scales) + row * source.groups()),
                 _MM_HINT_T1);
}

// ---- int4 keys read in place (fp32 products; kv_dequant.h has the format) ----
// A block's keys share each channel's step and zero point, so per block each query row becomes qs = q x step
// and a bias q . (z x step), formed once; a key's score is then qs . codes + bias, its codes widened to fp32 once
// for every query row of the GQA group.

// qs [group, kHeadDim] and bias [group] for one block's channel bytes.
template <int kHeadDim>
void int4_key_block_queries(const float* qf, const uint8_t* channel, int64_t group, float* qs, float* bias) {
  alignas(32) float step[kHeadDim], zero[kHeadDim];
  for (int d = 0; d < kHeadDim; d += 8) {
    _mm256_store_ps(step + d, kvq::byte_scales8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(channel + d)))));
    _mm256_store_ps(zero + d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                  _mm_loadl_epi64(reinterpret_cast<const __m128i*>(channel + kHeadDim + d)))));
  }
  for (int64_t g = 0; g < group; ++g) {
    __m256 sum = _mm256_setzero_ps();
    for (int d = 0; d < kHeadDim; d += 8) {
      const __m256 product = _mm256_mul_ps(_mm256_loadu_ps(qf + g * kHeadDim + d), _mm256_load_ps(step + d));
      _mm256_storeu_ps(qs + g * kHeadDim + d, product);
      sum = _mm256_fmadd_ps(product, _mm256_load_ps(zero + d), sum);
    }
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    bias[g] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
}

// Walks context tokens [first_token, end_token) block by block: score(channel, t0, t1) for each block's stretch
// (t relative to first_token), after asking for the rows kPrefetchDistance ahead of it.
template <typename ScoreStretch>
void for_each_key_block(const kvq::Source& keys, const kvq::Source& values, const int64_t* table,
                        int64_t first_token, int64_t end_token, int64_t block_size, int64_t kv_head,
                        const std::vector<int64_t>& rows, ScoreStretch&& score) {
  const int64_t num_tokens = end_token - first_token;
  for (int64_t pos = first_token; pos < end_token;) {
    const int64_t block = pos / block_size, stop = std::min(end_token, (block + 1) * block_size);
    const int64_t t0 = pos - first_token, t1 = stop - first_token;
    for (int64_t i = t0 == 0 ? 0 : t0 + kPrefetchDistance; i < std::min(t1 + kPrefetchDistance, num_tokens); ++i) {
      prefetch_int4_row(keys, rows[i]);
      prefetch_int4_row(values, rows[i]);
    }
    // and the channel bytes of the block as far ahead (two cache lines at head size 64, four at 128)
    const int64_t ahead = (pos + kPrefetchDistance) / block_size;
    if (ahead * block_size < end_token) {
      const char* bytes = reinterpret_cast<const char*>(keys.block_channels(table[ahead], kv_head));
      for (int64_t line = 0; line < 2 * keys.head_dim; line += 64) _mm_prefetch(bytes + line, _MM_HINT_T1);
    }
    score(keys.block_channels(table[block], kv_head), t0, t1);
    pos = stop;
  }
}
#endif

#if defined(__AVX512F__)
using simd::Simd;

// The values pass keeps the GQA group's accumulators in registers across the whole context: kChunks registers
// per query row, at most 16 registers in all.
template <int kHeadDim>
struct RegisterPlan {
  static constexpr int kChunks = kHeadDim / 16;
  static constexpr int kMaxGroup = kHeadDim > 0 && kHeadDim % 16 == 0 ? 16 / kChunks : 0;
};

// Lane i of the result is the horizontal sum of v[i]: a transpose-and-add tree, ~3 instructions per vector
// where a reduction per vector takes ~10. The shuffles move bits; `add` says what the lanes hold (fp32 by
// default, int32 for integer dot products passed as __m512 bits).
inline __m512 add_fp32(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 add_int32(__m512 a, __m512 b) {
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
}

template <__m512 (*add)(__m512, __m512) = add_fp32>
inline __m512 horizontal_sums16(const __m512* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)
    pairs[i] = add(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    quads[i] = add(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                   _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quads[i], 128-bit lane L: partial sums over lane L of v[4i..4i+3]; now add the four lanes.
  const __m512 low = add(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 high = add(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(2, 0, 2, 0)),
                          _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return add(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
             _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// fp32 scores with the whole GQA group's query rows held in registers, each key loaded once for all of them:
// faster than 16 keys at a time (below) over rows already in L2 (a quantized cache's decoded part), slower over
// 16-bit rows from DRAM, where one reduction per key and query row dominates (benchmarks/attention_kernels.py).
template <typename scalar_t, int kHeadDim, typename ForEachToken>
void scores_avx512_in_registers(const float* qf, const scalar_t* k_cache, int64_t group, int64_t num_tokens, float* scores,
                   ForEachToken&& for_each_token) {
  constexpr int kChunks = RegisterPlan<kHeadDim>::kChunks, kMaxGroup = RegisterPlan<kHeadDim>::kMaxGroup;
  __m512 qv[kMaxGroup][kChunks];
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < kChunks; ++c) qv[g][c] = _mm512_loadu_ps(qf + g * kHeadDim + c * 16);
  for_each_token([&](int64_t t, int64_t offset) {
    __m512 key[kChunks];
    for (int c = 0; c < kChunks; ++c) key[c] = Simd::load(k_cache + offset + c * 16);
    for (int g = 0; g < kMaxGroup && g < group; ++g) {
      __m512 dot = _mm512_mul_ps(qv[g][0], key[0]);
      for (int c = 1; c < kChunks; ++c) dot = _mm512_fmadd_ps(qv[g][c], key[c], dot);
      scores[g * num_tokens + t] = _mm512_reduce_add_ps(dot);
    }
  });
}

// Each query row of the GQA group against 16 keys at a time, the 16 dot products reduced together (a reduction
// per key costs more than the key's products). The group's first row streams the keys in, asking for K and V
// kPrefetchDistance tokens ahead; the later rows find them in L2. row_scorer(g) gives row g's `dot(key)` (one
// key's lane sums, fp32 or int32 bits as `add` says) and `finish(sums)` (the 16 sums -> fp32 scores).
template <__m512 (*add)(__m512, __m512) = add_fp32, typename scalar_t, typename RowScorer>
void scores_16_keys_at_a_time(const scalar_t* k_cache, const scalar_t* v_cache, const std::vector<int64_t>& offsets,
                              int64_t group, int64_t head_dim, float* scores, RowScorer&& row_scorer) {
  const int64_t num_tokens = static_cast<int64_t>(offsets.size());
  for (int64_t g = 0; g < group; ++g) {
    const auto row = row_scorer(g);
    for (int64_t t0 = 0; t0 < num_tokens; t0 += 16) {
      const int64_t count = std::min<int64_t>(16, num_tokens - t0);
      if (g == 0) prefetch_ahead(k_cache, v_cache, offsets, t0, head_dim);
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) dots[i] = row.dot(k_cache + offsets[t0 + std::min<int64_t>(i, count - 1)]);
      _mm512_mask_storeu_ps(scores + g * num_tokens + t0, static_cast<__mmask16>((1u << count) - 1),
                            row.finish(horizontal_sums16<add>(dots)));
    }
  }
}

// fp32 scores over a 16-bit cache or an int8 cache's codes (widened in registers). qf is scaled.
template <typename scalar_t, int kHeadDim>
void scores_avx512(const float* qf, const scalar_t* k_cache, const scalar_t* v_cache,
                   const std::vector<int64_t>& offsets, int64_t group, float* scores) {
  constexpr int kChunks = kHeadDim / 16;
  struct Row {
    __m512 qv[kChunks];
    __m512 dot(const scalar_t* key) const {
      __m512 acc = _mm512_mul_ps(qv[0], Simd::load(key));
      for (int c = 1; c < kChunks; ++c) acc = _mm512_fmadd_ps(qv[c], Simd::load(key + c * 16), acc);
      return acc;
    }
    __m512 finish(__m512 sums) const { return sums; }
  };
  scores_16_keys_at_a_time(k_cache, v_cache, offsets, group, kHeadDim, scores, [&](int64_t g) {
    Row row;
    for (int c = 0; c < kChunks; ++c) row.qv[c] = _mm512_loadu_ps(qf + g * kHeadDim + c * 16);
    return row;
  });
}

// fp32 scores over rows whose widening costs more than a product (fp8: six instructions a vector): each 16-key
// tile is widened once into fp32 on the stack (L1) for all of the group's query rows, which then score it 16 keys
// at a time, as scores_avx512 does from the cache. qf is scaled.
template <typename scalar_t, int kHeadDim>
void scores_widened_tiles(const float* qf, const scalar_t* k_cache, const scalar_t* v_cache,
                          const std::vector<int64_t>& offsets, int64_t group, float* scores) {
  constexpr int kChunks = kHeadDim / 16;
  const int64_t num_tokens = static_cast<int64_t>(offsets.size());
  for (int64_t t0 = 0; t0 < num_tokens; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, num_tokens - t0);
    prefetch_ahead(k_cache, v_cache, offsets, t0, kHeadDim);
    __m512 keys[16][kChunks];
    for (int i = 0; i < 16; ++i)
      for (int c = 0; c < kChunks; ++c)
        keys[i][c] = Simd::load(k_cache + offsets[t0 + std::min<int64_t>(i, count - 1)] + c * 16);
    for (int64_t g = 0; g < group; ++g) {
      __m512 qv[kChunks];
      for (int c = 0; c < kChunks; ++c) qv[c] = _mm512_loadu_ps(qf + g * kHeadDim + c * 16);
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) {
        dots[i] = _mm512_mul_ps(qv[0], keys[i][0]);
        for (int c = 1; c < kChunks; ++c) dots[i] = _mm512_fmadd_ps(qv[c], keys[i][c], dots[i]);
      }
      _mm512_mask_storeu_ps(scores + g * num_tokens + t0, static_cast<__mmask16>((1u << count) - 1),
                            horizontal_sums16(dots));
    }
  }
}

template <typename scalar_t, int kHeadDim, typename ForEachToken>
void values_avx512(const scalar_t* v_cache, const float* probs, int64_t group, int64_t num_tokens, float* acc,
                   ForEachToken&& for_each_token) {
  constexpr int kChunks = RegisterPlan<kHeadDim>::kChunks, kMaxGroup = RegisterPlan<kHeadDim>::kMaxGroup;
  __m512 sum[kMaxGroup][kChunks];
  for (int g = 0; g < kMaxGroup; ++g)
    for (int c = 0; c < kChunks; ++c) sum[g][c] = _mm512_setzero_ps();
  for_each_token([&](int64_t t, int64_t offset) {
    __m512 value[kChunks];
    for (int c = 0; c < kChunks; ++c) value[c] = Simd::load(v_cache + offset + c * 16);
    for (int g = 0; g < kMaxGroup && g < group; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * num_tokens + t]);
      for (int c = 0; c < kChunks; ++c) sum[g][c] = _mm512_fmadd_ps(p, value[c], sum[g][c]);
    }
  });
  for (int g = 0; g < group; ++g)
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + g * kHeadDim + c * 16, sum[g][c]);
}

#if defined(__AVX512BF16__)

// bf16 scores straight from the cache rows with vdpbf16ps (bf16 pair products, fp32 sums): no widening, and
// 16 keys reduced together. q is the GQA group's unscaled bf16 rows; `scale` applies to the fp32 scores.
template <int kHeadDim>
void scores_bf16(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                 const std::vector<int64_t>& offsets, int64_t group, float scale, float* scores) {
  constexpr int kVectors = kHeadDim / 32;
  struct Row {
    __m512bh qv[kVectors];
    float scale;
    __m512 dot(const at::BFloat16* key) const {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < kVectors; ++c) acc = _mm512_dpbf16_ps(acc, qv[c], (__m512bh)_mm512_loadu_si512(key + c * 32));
      return acc;
    }
    __m512 finish(__m512 sums) const { return _mm512_mul_ps(sums, _mm512_set1_ps(scale)); }
  };
  scores_16_keys_at_a_time(k_cache, v_cache, offsets, group, kHeadDim, scores, [&](int64_t g) {
    Row row;
    for (int c = 0; c < kVectors; ++c) row.qv[c] = (__m512bh)_mm512_loadu_si512(q + g * kHeadDim + c * 32);
    row.scale = scale;
    return row;
  });
}
#endif

#if defined(__AVX512VNNI__)
// Quantized keys scored in place with VNNI integer dot products (vpdpbusd: four u8 x s8 products summed per
// int32 lane, 64 elements an instruction), for bf16 queries; fp32 queries keep exact fp32 scores.
//
// A query row as two int8 vectors per 64 elements: codes of step absmax / 127 and the remainder's codes of
// step / 256, so q keeps ~15 bits, finer than its bf16 rounding (one int8 vector alone, as llama.cpp's q8_0
// path takes, gave 2.6x the kernel's rms error at bf16). The keys' codes are unsigned, `key_offset` above their
// values (int8 flipped by +128, int4's stored codes are value + 8); each lane starts from -key_offset x its
// query codes' sum, which cancels the offset exactly. A key's lane sums, high x 256 + low, are the dot product
// in units of step / 256; they stay within int32 for head sizes up to 128.
template <int kVectors>
struct QueryCodes {
  __m512i coarse[kVectors], fine[kVectors], start[kVectors];
  float unit;  // step / 256

  QueryCodes() = default;
  QueryCodes(const float* row, int key_offset) { init(row, key_offset); }

  void init(const float* row, int key_offset) {
    constexpr int kDim = kVectors * 64;
    float absmax = 0.f;
    for (int d = 0; d < kDim; ++d) absmax = std::max(absmax, std::abs(row[d]));
    const float step = absmax > 0.f ? absmax / 127.f : 1.f;
    unit = step / 256.f;
    alignas(64) int8_t coarse_codes[kDim], fine_codes[kDim];
    for (int d = 0; d < kDim; ++d) {
      const float code = std::nearbyint(row[d] / step);
      coarse_codes[d] = static_cast<int8_t>(code);
      fine_codes[d] = static_cast<int8_t>(std::clamp(std::nearbyint((row[d] - code * step) / unit), -128.f, 127.f));
    }
    const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
    for (int c = 0; c < kVectors; ++c) {
      coarse[c] = _mm512_load_si512(coarse_codes + c * 64);
      fine[c] = _mm512_load_si512(fine_codes + c * 64);
      const __m512i sums = _mm512_add_epi32(_mm512_slli_epi32(_mm512_dpbusd_epi32(zero, ones, coarse[c]), 8),
                                            _mm512_dpbusd_epi32(zero, ones, fine[c]));
      start[c] = _mm512_mullo_epi32(sums, _mm512_set1_epi32(-key_offset));
    }
  }

  // Lane sums of key vector c (unsigned codes) against this row, added to `low`'s start.
  __m512i dot(__m512i key, int c) const {
    const __m512i high = _mm512_dpbusd_epi32(_mm512_setzero_si512(), key, coarse[c]);
    return _mm512_add_epi32(_mm512_slli_epi32(high, 8), _mm512_dpbusd_epi32(start[c], key, fine[c]));
  }
};

// int8 keys: the caller applies the keys' per-row scales.
template <int kHeadDim>
void scores_int8_vnni(const float* qf, const int8_t* k_cache, const int8_t* v_cache,
                      const std::vector<int64_t>& offsets, int64_t group, float* scores) {
  constexpr int kVectors = kHeadDim / 64;
  struct Row {
    QueryCodes<kVectors> query;
    __m512 dot(const int8_t* key) const {
      const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
      __m512i sums = query.dot(_mm512_xor_si512(_mm512_loadu_si512(key), flip), 0);
      for (int c = 1; c < kVectors; ++c)
        sums = _mm512_add_epi32(sums, query.dot(_mm512_xor_si512(_mm512_loadu_si512(key + c * 64), flip), c));
      return _mm512_castsi512_ps(sums);
    }
    __m512 finish(__m512 sums) const {
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_castps_si512(sums)), _mm512_set1_ps(query.unit));
    }
  };
  scores_16_keys_at_a_time<add_int32>(k_cache, v_cache, offsets, group, kHeadDim, scores,
                                      [&](int64_t g) { return Row{QueryCodes<kVectors>(qf + g * kHeadDim, 128)}; });
}

#endif  // __AVX512VNNI__

// int4 keys' codes of one 64-element chunk as four fp32 vectors in element order (bytes 0-15's low nibbles are
// elements 0-15, bytes 16-31's elements 16-31, their high nibbles 32-63).
inline void int4_key_chunk(const uint8_t* bytes, __m512 out[4]) {
  const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes + 16)));
  const __m512i nibble = _mm512_set1_epi32(0x0F);
  out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(first, nibble));
  out[1] = _mm512_cvtepi32_ps(_mm512_and_si512(second, nibble));
  out[2] = _mm512_cvtepi32_ps(_mm512_srli_epi32(first, 4));
  out[3] = _mm512_cvtepi32_ps(_mm512_srli_epi32(second, 4));
}

// A block's steps and zero points as fp32 vectors (kvq::byte_scales8, 16 lanes).
template <int kHeadDim>
inline void int4_key_channels(const uint8_t* channel, __m512 step[], __m512 zero[]) {
  for (int c = 0; c < kHeadDim / 16; ++c) {
    const __m512i code = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(channel + 16 * c)));
    const __m512i exponent = _mm512_slli_epi32(_mm512_add_epi32(_mm512_srli_epi32(code, 3), _mm512_set1_epi32(107)), 23);
    const __m512i mantissa = _mm512_slli_epi32(_mm512_and_si512(code, _mm512_set1_epi32(7)), 20);
    step[c] = _mm512_castsi512_ps(_mm512_or_si512(exponent, mantissa));
    zero[c] = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(channel + kHeadDim + 16 * c))));
  }
}

// Scores of every query row of the group over int4 keys, 16 keys at a time: the tile's keys widened once into fp32
// scratch (L1); then per query row, qs = q x step in registers, one vector of lane products per key started from
// the lanes of q . (z x step) (so the bias needs no reduction of its own), and the lanes of the 16 keys summed
// together (horizontal_sums16).
template <int kHeadDim>
void scores_int4_keys(const float* qf, const kvq::Source& keys, const kvq::Source& values, const int64_t* table,
                      int64_t first_token, int64_t end_token, int64_t block_size, int64_t kv_head, int64_t group,
                      const std::vector<int64_t>& rows, float* scores, std::vector<float>&) {
  constexpr int kVectors = kHeadDim / 16;
  const int64_t num_tokens = end_token - first_token;
  alignas(64) float tile[16 * kHeadDim];
  for_each_key_block(keys, values, table, first_token, end_token, block_size, kv_head, rows,
                     [&](const uint8_t* channel, int64_t t0, int64_t t1) {
    __m512 step[kVectors], zero[kVectors];
    int4_key_channels<kHeadDim>(channel, step, zero);
    for (int64_t t = t0; t < t1; t += 16) {
      const int64_t count = std::min<int64_t>(16, t1 - t);
      for (int64_t i = 0; i < 16; ++i) {
        __m512 key[kVectors];
        if (i < count) {
          for (int c = 0; c < kHeadDim / 64; ++c) int4_key_chunk(keys.data + rows[t + i] * (kHeadDim / 2) + c * 32, key + 4 * c);
        } else {
          for (int c = 0; c < kVectors; ++c) key[c] = _mm512_setzero_ps();
        }
        for (int c = 0; c < kVectors; ++c) _mm512_store_ps(tile + i * kHeadDim + 16 * c, key[c]);
      }
      for (int64_t g = 0; g < group; ++g) {
        __m512 q[kVectors], bias = _mm512_setzero_ps(), dots[16];
        for (int c = 0; c < kVectors; ++c) {
          q[c] = _mm512_mul_ps(_mm512_loadu_ps(qf + g * kHeadDim + 16 * c), step[c]);
          bias = _mm512_fmadd_ps(q[c], zero[c], bias);
        }
        for (int i = 0; i < 16; ++i) {
          __m512 dot = _mm512_fmadd_ps(q[0], _mm512_load_ps(tile + i * kHeadDim), bias);
          for (int c = 1; c < kVectors; ++c) dot = _mm512_fmadd_ps(q[c], _mm512_load_ps(tile + i * kHeadDim + 16 * c), dot);
          dots[i] = dot;
        }
        _mm512_mask_storeu_ps(scores + g * num_tokens + t, static_cast<__mmask16>((1u << count) - 1),
                              horizontal_sums16(dots));
      }
    }
  });
}

// Probability-weighted sums of int4 value rows for up to RegisterPlan's kMaxGroup query rows (their accumulators
// in registers): each row's codes are widened in element order, each group's scale folds into the probability,
// and the codes' +8 comes off once at the end (8 x the sum of each group's weights).
template <int kHeadDim>
void values_int4(const kvq::Source& values, const std::vector<int64_t>& rows, const float* probs, int64_t group,
                 float* acc) {
  constexpr int kVectors = kHeadDim / 64, kChunks = kHeadDim / 16, kGroups = kHeadDim / kvq::kInt4Group;
  constexpr int kMaxGroup = RegisterPlan<kHeadDim>::kMaxGroup;
  const int64_t num_tokens = static_cast<int64_t>(rows.size());
  __m512 sum[kMaxGroup][kChunks];
  float weights[kMaxGroup][kGroups] = {};
  for (int g = 0; g < kMaxGroup; ++g)
    for (int c = 0; c < kChunks; ++c) sum[g][c] = _mm512_setzero_ps();
  const __m256i mask = _mm256_set1_epi8(0x0F);
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t row = rows[t];
    const uint8_t* bytes = values.data + row * (kHeadDim / 2);
    const uint16_t* row_scales = static_cast<const uint16_t*>(values.scales) + row * kGroups;
    for (int c = 0; c < kVectors; ++c) {
      const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes + c * 32));
      const __m256i low = _mm256_and_si256(packed, mask), high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
      // unpacklo: elements 0-15 | 32-47; unpackhi: 16-31 | 48-63
      const __m256i first = _mm256_unpacklo_epi8(low, high), second = _mm256_unpackhi_epi8(low, high);
      const __m128i parts[4] = {_mm256_castsi256_si128(first), _mm256_castsi256_si128(second),
                                _mm256_extracti128_si256(first, 1), _mm256_extracti128_si256(second, 1)};
      __m512 value[4];
      for (int k = 0; k < 4; ++k) value[k] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(parts[k]));
      const float scale_first = kvq::half_to_float(row_scales[2 * c]), scale_second = kvq::half_to_float(row_scales[2 * c + 1]);
      for (int g = 0; g < kMaxGroup && g < group; ++g) {
        const float p = probs[g * num_tokens + t];
        const float w_first = p * scale_first, w_second = p * scale_second;
        weights[g][2 * c] += w_first;
        weights[g][2 * c + 1] += w_second;
        const __m512 first_weight = _mm512_set1_ps(w_first), second_weight = _mm512_set1_ps(w_second);
        sum[g][4 * c] = _mm512_fmadd_ps(first_weight, value[0], sum[g][4 * c]);
        sum[g][4 * c + 1] = _mm512_fmadd_ps(first_weight, value[1], sum[g][4 * c + 1]);
        sum[g][4 * c + 2] = _mm512_fmadd_ps(second_weight, value[2], sum[g][4 * c + 2]);
        sum[g][4 * c + 3] = _mm512_fmadd_ps(second_weight, value[3], sum[g][4 * c + 3]);
      }
    }
  }
  for (int g = 0; g < kMaxGroup && g < group; ++g)
    for (int c = 0; c < kChunks; ++c)
      _mm512_storeu_ps(acc + g * kHeadDim + c * 16,
                       _mm512_sub_ps(sum[g][c], _mm512_set1_ps(8.f * weights[g][c / 2])));
}
#endif  // __AVX512F__

#if defined(KVSERVE_SIMD) && !defined(__AVX512F__)
// AVX2 has 16 registers: too few to hold a GQA group's query rows and accumulators at once, so each query row
// walks the context on its own; rows after the first find the task's keys and values in L1/L2 (a task's
// context is tens of KB), and the first asks for rows kPrefetchDistance tokens ahead.
template <typename scalar_t, int kHeadDim>
void scores_avx2(const float* qf, const scalar_t* k_cache, const scalar_t* v_cache,
                 const std::vector<int64_t>& offsets, int64_t group, float* scores) {
  using simd::Simd;
  constexpr int kChunks = kHeadDim / Simd::kLanes;
  static_assert(kChunks % 2 == 0, "two accumulators per dot product");
  const int64_t num_tokens = static_cast<int64_t>(offsets.size());
  for (int64_t g = 0; g < group; ++g) {
    Simd::V qv[kChunks];
    for (int c = 0; c < kChunks; ++c) qv[c] = Simd::load(qf + g * kHeadDim + c * Simd::kLanes);
    float* row_scores = scores + g * num_tokens;
    for (int64_t t = 0; t < num_tokens; ++t) {
      if (g == 0 && t + kPrefetchDistance < num_tokens) {
        prefetch_row(k_cache + offsets[t + kPrefetchDistance], kHeadDim);
        prefetch_row(v_cache + offsets[t + kPrefetchDistance], kHeadDim);
      }
      const scalar_t* key = k_cache + offsets[t];
      Simd::V even = Simd::zero(), odd = Simd::zero();
      for (int c = 0; c < kChunks; c += 2) {
        even = Simd::fmadd(qv[c], Simd::load(key + c * Simd::kLanes), even);
        odd = Simd::fmadd(qv[c + 1], Simd::load(key + (c + 1) * Simd::kLanes), odd);
      }
      row_scores[t] = Simd::reduce_add(Simd::add(even, odd));
    }
  }
}

template <typename scalar_t, int kHeadDim>
void values_avx2(const scalar_t* v_cache, const std::vector<int64_t>& offsets, const float* probs, int64_t group,
                 float* acc) {
  using simd::Simd;
  constexpr int kSlice = std::min(kHeadDim / Simd::kLanes, 8);  // accumulators per walk over the context
  const int64_t num_tokens = static_cast<int64_t>(offsets.size());
  for (int64_t g = 0; g < group; ++g) {
    for (int d0 = 0; d0 < kHeadDim; d0 += kSlice * Simd::kLanes) {
      Simd::V sum[kSlice];
      for (int c = 0; c < kSlice; ++c) sum[c] = Simd::zero();
      for (int64_t t = 0; t < num_tokens; ++t) {
        if (g == 0 && d0 == 0 && t + kPrefetchDistance < num_tokens)
          prefetch_row(v_cache + offsets[t + kPrefetchDistance], kHeadDim);
        const Simd::V p = Simd::set1(probs[g * num_tokens + t]);
        const scalar_t* value = v_cache + offsets[t] + d0;
        for (int c = 0; c < kSlice; ++c) sum[c] = Simd::fmadd(p, Simd::load(value + c * Simd::kLanes), sum[c]);
      }
      for (int c = 0; c < kSlice; ++c) Simd::store(acc + g * kHeadDim + d0 + c * Simd::kLanes, sum[c]);
    }
  }
}

// fp8 rows cost several instructions a vector to widen (simd.h), which the walks above repeat for every query row
// of the group. These widen each tile of 16 keys (or values) once into fp32 scratch in L1, which every row of the
// group then reads.
constexpr int kTile = 16;

template <typename scalar_t, int kHeadDim>
inline void widen_tile(const scalar_t* cache, const std::vector<int64_t>& offsets, int64_t t0, int64_t count,
                       float* tile) {
  // 16 bytes at a time: one sign extension and one shift for two fp16 conversions (simd.h's loads, twice as wide)
  constexpr bool kE4m3 = std::is_same_v<scalar_t, Fp8E4m3>;
  for (int64_t i = 0; i < count; ++i)
    for (int c = 0; c < kHeadDim; c += 16) {
      const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(cache + offsets[t0 + i] + c)));
      const __m256i half = kE4m3 ? _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)))
                                 : _mm256_slli_epi16(wide, 8);
      _mm256_store_ps(tile + i * kHeadDim + c, _mm256_cvtph_ps(_mm256_castsi256_si128(half)));
      _mm256_store_ps(tile + i * kHeadDim + c + 8, _mm256_cvtph_ps(_mm256_extracti128_si256(half, 1)));
    }
}

template <typename scalar_t, int kHeadDim>
void scores_avx2_tiled(const float* qf, const scalar_t* k_cache, const scalar_t* v_cache,
                       const std::vector<int64_t>& offsets, int64_t group, float* scores) {
  using simd::Simd;
  constexpr int kChunks = kHeadDim / Simd::kLanes;
  const int64_t num_tokens = static_cast<int64_t>(offsets.size());
  alignas(32) float tile[kTile * kHeadDim];
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kTile) {
    const int64_t count = std::min<int64_t>(kTile, num_tokens - t0);
    prefetch_ahead(k_cache, v_cache, offsets, t0, kHeadDim);
    widen_tile<scalar_t, kHeadDim>(k_cache, offsets, t0, count, tile);
    for (int64_t g = 0; g < group; ++g) {
      const float* q = qf + g * kHeadDim;
      for (int64_t i = 0; i < count; ++i) {
        Simd::V even = Simd::zero(), odd = Simd::zero();
        for (int c = 0; c < kChunks; c += 2) {
          even = Simd::fmadd(Simd::load(q + c * Simd::kLanes), Simd::load(tile + i * kHeadDim + c * Simd::kLanes), even);
          odd = Simd::fmadd(Simd::load(q + (c + 1) * Simd::kLanes), Simd::load(tile + i * kHeadDim + (c + 1) * Simd::kLanes), odd);
        }
        scores[g * num_tokens + t0 + i] = Simd::reduce_add(Simd::add(even, odd));
      }
    }
  }
}

template <typename scalar_t, int kHeadDim>
void values_avx2_tiled(const scalar_t* v_cache, const std::vector<int64_t>& offsets, const float* probs,
                       int64_t group, float* acc) {
  using simd::Simd;
  constexpr int kSlice = std::min(kHeadDim / Simd::kLanes, 8);  // accumulators held per row and walk
  const int64_t num_tokens = static_cast<int64_t>(offsets.size());
  alignas(32) float tile[kTile * kHeadDim];
  std::fill(acc, acc + group * kHeadDim, 0.f);
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kTile) {
    const int64_t count = std::min<int64_t>(kTile, num_tokens - t0);
    for (int64_t i = t0 + kPrefetchDistance; i < std::min(t0 + kPrefetchDistance + kTile, num_tokens); ++i)
      prefetch_row(v_cache + offsets[i], kHeadDim);
    widen_tile<scalar_t, kHeadDim>(v_cache, offsets, t0, count, tile);
    for (int64_t g = 0; g < group; ++g)
      for (int d0 = 0; d0 < kHeadDim; d0 += kSlice * Simd::kLanes) {
        float* out = acc + g * kHeadDim + d0;
        Simd::V sum[kSlice];
        for (int c = 0; c < kSlice; ++c) sum[c] = Simd::load(out + c * Simd::kLanes);
        for (int64_t i = 0; i < count; ++i) {
          const Simd::V p = Simd::set1(probs[g * num_tokens + t0 + i]);
          for (int c = 0; c < kSlice; ++c)
            sum[c] = Simd::fmadd(p, Simd::load(tile + i * kHeadDim + d0 + c * Simd::kLanes), sum[c]);
        }
        for (int c = 0; c < kSlice; ++c) Simd::store(out + c * Simd::kLanes, sum[c]);
      }
  }
}

// ---- int4 K and V read in place (AVX2, fp32 scores) ----
// Query rows and the values' accumulators are kept in the nibbles' order (to_nibble_order): bytes 0-15 of a
// chunk's low and high nibbles are its first 32 elements (its first scale), bytes 16-31 its last 32. The codes'
// +8 comes off once per key and group: 8 x the group's query sum in the scores, 8 x the group's weights in the
// values.

// Half h of a chunk (its first or last 32 elements) as fp32 codes, in the nibbles' order: its 16 even elements
// from `low`, then its 16 odd ones from `high`, 8 to a vector.
inline void int4_half_codes(__m256i low, __m256i high, int h, __m256 codes[4]) {
  const __m128i even = h ? _mm256_extracti128_si256(low, 1) : _mm256_castsi256_si128(low);
  const __m128i odd = h ? _mm256_extracti128_si256(high, 1) : _mm256_castsi256_si128(high);
  const __m128i parts[4] = {even, _mm_srli_si128(even, 8), odd, _mm_srli_si128(odd, 8)};
  for (int i = 0; i < 4; ++i) codes[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
}

// A chunk's 32 bytes split into its low and high nibbles.
inline void int4_nibbles(const uint8_t* bytes, __m256i& low, __m256i& high) {
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
  const __m256i mask = _mm256_set1_epi8(0x0F);
  low = _mm256_and_si256(packed, mask);
  high = _mm256_and_si256(_mm256_srli_epi16(packed, 4), mask);
}

// Scores of every query row of the group over int4 keys: each key widened once into 8-lane fp32 vectors (low
// nibbles of bytes 8k..8k+7 are elements 8k.., their high ones 32 + 8k..), then one dot product per query row.
template <int kHeadDim>
void scores_int4_keys(const float* qf, const kvq::Source& keys, const kvq::Source& values, const int64_t* table,
                      int64_t first_token, int64_t end_token, int64_t block_size, int64_t kv_head, int64_t group,
                      const std::vector<int64_t>& rows, float* scores, std::vector<float>& scratch) {
  using simd::Simd;
  constexpr int kVectors = kHeadDim / 8;
  const int64_t num_tokens = end_token - first_token;
  scratch.resize(group * (kHeadDim + 1));
  float* qs = scratch.data();
  float* bias = qs + group * kHeadDim;
  const __m256i nibble = _mm256_set1_epi32(0x0F);
  for_each_key_block(keys, values, table, first_token, end_token, block_size, kv_head, rows,
                     [&](const uint8_t* channel, int64_t t0, int64_t t1) {
    int4_key_block_queries<kHeadDim>(qf, channel, group, qs, bias);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* bytes = keys.data + rows[t] * (kHeadDim / 2);
      alignas(32) float key[kHeadDim];
      for (int c = 0; c < kHeadDim / 64; ++c)
        for (int k = 0; k < 4; ++k) {
          const __m256i packed = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + c * 32 + 8 * k)));
          _mm256_store_ps(key + c * 64 + 8 * k, _mm256_cvtepi32_ps(_mm256_and_si256(packed, nibble)));
          _mm256_store_ps(key + c * 64 + 32 + 8 * k, _mm256_cvtepi32_ps(_mm256_srli_epi32(packed, 4)));
        }
      for (int64_t g = 0; g < group; ++g) {
        const float* q = qs + g * kHeadDim;
        __m256 even = _mm256_mul_ps(_mm256_loadu_ps(q), _mm256_load_ps(key));
        __m256 odd = _mm256_mul_ps(_mm256_loadu_ps(q + 8), _mm256_load_ps(key + 8));
        for (int c = 2; c < kVectors; c += 2) {
          even = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c), _mm256_load_ps(key + 8 * c), even);
          odd = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * c + 8), _mm256_load_ps(key + 8 * c + 8), odd);
        }
        scores[g * num_tokens + t] = Simd::reduce_add(_mm256_add_ps(even, odd)) + bias[g];
      }
    }
  });
}

// Probability-weighted sums of int4 value rows, one query row and one 64-element chunk per walk over the
// context (8 accumulators), each group's scale folded into the probability; written in element order.
template <int kHeadDim>
void values_int4_avx2(const kvq::Source& values, const std::vector<int64_t>& rows, const float* probs, int64_t group,
                      float* acc) {
  constexpr int kGroups = kHeadDim / kvq::kInt4Group;
  const int64_t num_tokens = static_cast<int64_t>(rows.size());
  const uint16_t* value_scales = static_cast<const uint16_t*>(values.scales);
  for (int64_t g = 0; g < group; ++g) {
    for (int c = 0; c < kHeadDim / 64; ++c) {
      __m256 sum[8];
      for (int i = 0; i < 8; ++i) sum[i] = _mm256_setzero_ps();
      float weights[2] = {0.f, 0.f};
      for (int64_t t = 0; t < num_tokens; ++t) {
        const int64_t row = rows[t];
        __m256i low, high;
        int4_nibbles(values.data + row * (kHeadDim / 2) + c * 32, low, high);
        const __m128 p_scales = _mm_mul_ps(int4_chunk_scales(value_scales + row * kGroups + 2 * c),
                                           _mm_set1_ps(probs[g * num_tokens + t]));
        const __m128 chunk_weights[2] = {p_scales, _mm_movehdup_ps(p_scales)};
        for (int h = 0; h < 2; ++h) {
          __m256 codes[4];
          int4_half_codes(low, high, h, codes);
          const __m256 w = _mm256_broadcastss_ps(chunk_weights[h]);
          weights[h] += _mm_cvtss_f32(chunk_weights[h]);
          sum[2 * h] = _mm256_fmadd_ps(w, codes[0], sum[2 * h]);  // even elements
          sum[2 * h + 1] = _mm256_fmadd_ps(w, codes[1], sum[2 * h + 1]);
          sum[4 + 2 * h] = _mm256_fmadd_ps(w, codes[2], sum[4 + 2 * h]);  // odd ones
          sum[4 + 2 * h + 1] = _mm256_fmadd_ps(w, codes[3], sum[4 + 2 * h + 1]);
        }
      }
      // sum[0..3]: the chunk's even elements 0, 2, ..., 62; sum[4..7]: its odd ones.
      alignas(32) float permuted[64];
      for (int i = 0; i < 8; ++i) _mm256_store_ps(permuted + 8 * i, sum[i]);
      float* out = acc + g * kHeadDim + c * 64;
      for (int i = 0; i < 32; ++i) {
        const float offset = 8.f * weights[i / 16];
        out[2 * i] = permuted[i] - offset;
        out[2 * i + 1] = permuted[32 + i] - offset;
      }
    }
  }
}
#endif

template <typename scalar_t, typename ForEachToken>
void scores_generic(const float* qf, const scalar_t* k_cache, int64_t group, int64_t head_dim, int64_t num_tokens,
                    float* scores, float* row, ForEachToken&& for_each_token) {
  for_each_token([&](int64_t t, int64_t offset) {
    to_float(k_cache + offset, row, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf + g * head_dim;
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * row[d];
      scores[g * num_tokens + t] = dot;
    }
  });
}

template <typename scalar_t, typename ForEachToken>
void values_generic(const scalar_t* v_cache, const float* probs, int64_t group, int64_t head_dim,
                    int64_t num_tokens, float* acc, float* row, ForEachToken&& for_each_token) {
  for_each_token([&](int64_t t, int64_t offset) {
    to_float(v_cache + offset, row, head_dim);
    for (int64_t g = 0; g < group; ++g) {
      const float p = probs[g * num_tokens + t];
      float* a = acc + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
    }
  });
}

// scores <- e^(score - row max), in place; the row's max and sum are kept so partial results over parts of a
// context can be merged (normalising is the merge's job).
void exp_rows(float* scores, int64_t group, int64_t num_tokens, float* row_max, float* row_sum) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * num_tokens;
    float max_score = s[0];  // not -inf: the kernel is built with -ffast-math, which assumes finite values
    for (int64_t t = 1; t < num_tokens; ++t) max_score = std::max(max_score, s[t]);
    float total = 0.f;
    for (int64_t t = 0; t < num_tokens; ++t) {
      s[t] = std::exp(s[t] - max_score);
      total += s[t];
    }
    row_max[g] = max_score;
    row_sum[g] = total;
  }
}

#if defined(__AVX512BF16__)
// One sequence's own context (bf16 cache and queries) over all its KV heads in one unit: tiles of 16 tokens, the
// heads' query rows one after another over each tile, so a tile's K rows (every head's side by side) are read
// from one stretch of memory while it is in L1, then the same for V. A core doing this arithmetic keeps too few
// misses in flight by itself, so each tile asks for the rows kTilesAhead tiles on into L2, a head's rows at a
// time. Writes each head's partial as decode_task does, head h's at partial + h x head_stride.
constexpr int64_t kTilesAhead = 2;
// Asks for rows [begin, end) of a cache (offsets in elements), `row_elements` bf16 each.
inline void request_rows(const at::BFloat16* cache, const int64_t* offsets, int64_t begin, int64_t end,
                         int64_t row_elements) {
  for (int64_t t = begin; t < end; ++t)
    for (int64_t byte = 0; byte < row_elements * 2; byte += 64)
      _mm_prefetch(reinterpret_cast<const char*>(cache + offsets[t]) + byte, _MM_HINT_T1);
}

template <int kHeadDim>
void decode_sequence_bf16(const at::BFloat16* q, const at::BFloat16* k_cache, const at::BFloat16* v_cache,
                          const int64_t* table, int64_t first_token, int64_t end_token, int64_t block_size,
                          int64_t num_kv_heads, int64_t group, float scale, float* partial, int64_t head_stride,
                          std::vector<float>& scores, std::vector<int64_t>& offsets) {
  constexpr int kVectors = kHeadDim / 32, kChunks = kHeadDim / 16, kMaxGroup = RegisterPlan<kHeadDim>::kMaxGroup;
  const int64_t num_tokens = end_token - first_token, token_stride = num_kv_heads * kHeadDim;
  offsets.resize(num_tokens);
  for (int64_t pos = first_token; pos < end_token; ++pos)
    offsets[pos - first_token] = (table[pos / block_size] * block_size + pos % block_size) * token_stride;
  scores.resize(num_kv_heads * group * num_tokens);
  for (int64_t t0 = 0; t0 < num_tokens; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, num_tokens - t0);
    const int64_t ahead = t0 + kTilesAhead * 16, ahead_end = std::min(ahead + 16, num_tokens);
    for (int64_t r = 0; r < num_kv_heads * group; ++r) {
      const int64_t head = r / group;
      if (r % group == 0) request_rows(k_cache + head * kHeadDim, offsets.data(), ahead, ahead_end, kHeadDim);
      __m512bh qv[kVectors];
      for (int c = 0; c < kVectors; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + r * kHeadDim + c * 32);
      __m512 dots[16];
      for (int i = 0; i < 16; ++i) {
        const at::BFloat16* key = k_cache + offsets[t0 + std::min<int64_t>(i, count - 1)] + head * kHeadDim;
        __m512 dot = _mm512_setzero_ps();
        for (int c = 0; c < kVectors; ++c) dot = _mm512_dpbf16_ps(dot, qv[c], (__m512bh)_mm512_loadu_si512(key + c * 32));
        dots[i] = dot;
      }
      _mm512_mask_storeu_ps(scores.data() + r * num_tokens + t0, static_cast<__mmask16>((1u << count) - 1),
                            _mm512_mul_ps(horizontal_sums16(dots), _mm512_set1_ps(scale)));
    }
  }
  for (int64_t head = 0; head < num_kv_heads; ++head) {
    float* sums = partial + head * head_stride;
    exp_rows(scores.data() + head * group * num_tokens, group, num_tokens, sums + group * kHeadDim,
             sums + group * kHeadDim + group);
    std::fill(sums, sums + group * kHeadDim, 0.f);
  }
  for (int64_t t0 = 0; t0 < num_tokens; t0 += 16) {
    const int64_t count = std::min<int64_t>(16, num_tokens - t0);
    const int64_t ahead = t0 + kTilesAhead * 16, ahead_end = std::min(ahead + 16, num_tokens);
    for (int64_t head = 0; head < num_kv_heads; ++head) {
      request_rows(v_cache + head * kHeadDim, offsets.data(), ahead, ahead_end, kHeadDim);
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup) {
        const int64_t rows = std::min<int64_t>(kMaxGroup, group - g0);
        float* acc = partial + head * head_stride + g0 * kHeadDim;
        const float* probs = scores.data() + (head * group + g0) * num_tokens;
        __m512 sum[kMaxGroup][kChunks];
        for (int g = 0; g < kMaxGroup && g < rows; ++g)
          for (int c = 0; c < kChunks; ++c) sum[g][c] = _mm512_loadu_ps(acc + g * kHeadDim + c * 16);
        for (int64_t t = t0; t < t0 + count; ++t) {
          __m512 value[kChunks];
          for (int c = 0; c < kChunks; ++c) value[c] = Simd::load(v_cache + offsets[t] + head * kHeadDim + c * 16);
          for (int g = 0; g < kMaxGroup && g < rows; ++g) {
            const __m512 p = _mm512_set1_ps(probs[g * num_tokens + t]);
            for (int c = 0; c < kChunks; ++c) sum[g][c] = _mm512_fmadd_ps(p, value[c], sum[g][c]);
          }
        }
        for (int g = 0; g < kMaxGroup && g < rows; ++g)
          for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + g * kHeadDim + c * 16, sum[g][c]);
      }
    }
  }
}
#endif

// What a quantized cache read in place scales its elements by, for the kernels to apply outside the inner
// loops. int8: per-row scale bytes (kv_dequant.h), one per (slot, KV head), for K and for V, applied once per
// token: the keys' to the scores, the values' to the probabilities. fp8: V's per-layer scale, applied to the
// probabilities (K's is folded into the query's scale by the caller; both times simd.h's kWideningFactor). Null
// and 1 for a 16-bit or fp32 cache.
struct CacheScales {
  const uint8_t* key_rows = nullptr;
  const uint8_t* value_rows = nullptr;
  float values = 1.f;
};

// One KV head's GQA group over context tokens [first_token, end_token): writes the partial result
// [group x head_dim unnormalised sums | group row maxima | group row sums] (see merge_partials).
// kHeadDim > 0 fixes the head size at compile time so the inner loops unroll into whole SIMD registers;
// 0 takes it from `runtime_head_dim`.
// q_t is the query's dtype, scalar_t the cache's: an fp32 model may keep a 16-bit cache (half the bytes), and
// an int8 cache is read as its codes (scalar_t = int8_t) and an fp8 cache as its bytes, with `cache_scales`.
template <typename q_t, typename scalar_t, int kHeadDim>
void decode_task(const q_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                 int64_t end_token, int64_t first_token, int64_t block_size, int64_t num_kv_heads,
                 int64_t kv_head, int64_t group, int64_t runtime_head_dim, float scale, CacheScales cache_scales,
                 float* partial, std::vector<float>& scores, std::vector<float>& qf, std::vector<float>& row,
                 std::vector<int64_t>& offsets) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t num_tokens = end_token - first_token;
  float* acc = partial;
  float* row_max = partial + group * head_dim;
  float* row_sum = row_max + group;
  scores.assign(group * num_tokens, 0.f);
  std::fill(acc, acc + group * head_dim, 0.f);
  qf.resize(group * head_dim);
  row.resize(head_dim);
  to_float(q, qf.data(), group * head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] *= scale;
  const int64_t token_stride = num_kv_heads * head_dim;
  // Walk the context block by block: one table lookup per block, no division per token.
  const int64_t first_block = first_token / block_size;
  const int64_t last_block = (end_token - 1) / block_size;
  auto for_each_token = [&](auto&& visit) {
    for (int64_t b = first_block; b <= last_block; ++b) {
      const int64_t block_start = b * block_size;
      const int64_t begin = std::max(first_token, block_start);
      const int64_t end = std::min(end_token, block_start + block_size);
      const int64_t base = (table[b] * block_size - block_start) * token_stride + kv_head * head_dim;
      for (int64_t pos = begin; pos < end; ++pos) visit(pos - first_token, base + pos * token_stride);
    }
  };
  // Scores -> unnormalised probabilities, a quantized cache's scales applied around the exponentials: the keys'
  // to the scores, the values' to the probabilities (after the row sums, which they do not enter). A row's
  // offset in elements over head_dim is its (slot, KV head) index. Row scales are decoded into `row` first, so
  // the products are whole-vector loops.
  auto softmax = [&] {
    float* value_scales = nullptr;
    if (cache_scales.key_rows) {
      row.resize(std::max(head_dim, 2 * num_tokens));
      float* key_scales = row.data();
      value_scales = key_scales + num_tokens;
      for_each_token([&](int64_t t, int64_t offset) {
        key_scales[t] = kvq::byte_scale(cache_scales.key_rows[offset / head_dim]);
        value_scales[t] = kvq::byte_scale(cache_scales.value_rows[offset / head_dim]);
      });
      for (int64_t g = 0; g < group; ++g)
        for (int64_t t = 0; t < num_tokens; ++t) scores[g * num_tokens + t] *= key_scales[t];
    }
    exp_rows(scores.data(), group, num_tokens, row_max, row_sum);
    if (value_scales)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t t = 0; t < num_tokens; ++t) scores[g * num_tokens + t] *= value_scales[t];
    if (cache_scales.values != 1.f)
      for (int64_t i = 0; i < group * num_tokens; ++i) scores[i] *= cache_scales.values;
  };
#if defined(KVSERVE_SIMD) && !defined(__AVX512F__)
  if constexpr (kHeadDim > 0 && kHeadDim % 16 == 0 && !std::is_same_v<scalar_t, double>) {
    offsets.clear();
    for_each_token([&](int64_t, int64_t offset) { offsets.push_back(offset); });
    constexpr bool kFp8 = std::is_same_v<scalar_t, Fp8E4m3> || std::is_same_v<scalar_t, Fp8E5m2>;
    if constexpr (kFp8) {
      scores_avx2_tiled<scalar_t, kHeadDim>(qf.data(), k_cache, v_cache, offsets, group, scores.data());
      softmax();
      return values_avx2_tiled<scalar_t, kHeadDim>(v_cache, offsets, scores.data(), group, acc);
    }
    scores_avx2<scalar_t, kHeadDim>(qf.data(), k_cache, v_cache, offsets, group, scores.data());
    softmax();
    return values_avx2<scalar_t, kHeadDim>(v_cache, offsets, scores.data(), group, acc);
  }
#endif
#if defined(__AVX512F__)
  // Passes that keep query rows' accumulators in registers take the group kMaxGroup rows at a time.
  constexpr int kMaxGroup = RegisterPlan<kHeadDim>::kMaxGroup;
  constexpr bool kVectorised = kMaxGroup > 0 && !std::is_same_v<scalar_t, double>;
#else
  constexpr bool kVectorised = false;
#endif
  if constexpr (kVectorised) {
#if defined(__AVX512F__)
    {
      offsets.clear();
      for_each_token([&](int64_t, int64_t offset) { offsets.push_back(offset); });
      constexpr bool kBf16Query = std::is_same_v<q_t, at::BFloat16>;
      constexpr bool kBf16Scores =
#if defined(__AVX512BF16__)
          std::is_same_v<scalar_t, at::BFloat16> && kBf16Query && kHeadDim % 32 == 0;
#else
          false;
#endif
      constexpr bool kVnniScores =
#if defined(__AVX512VNNI__)
          std::is_same_v<scalar_t, int8_t> && kBf16Query && kHeadDim % 64 == 0;
#else
          false;
#endif
      if constexpr (kBf16Scores) {
        scores_bf16<kHeadDim>(q, k_cache, v_cache, offsets, group, scale, scores.data());
      } else if constexpr (kVnniScores) {
        scores_int8_vnni<kHeadDim>(qf.data(), k_cache, v_cache, offsets, group, scores.data());
      } else if constexpr (std::is_same_v<scalar_t, Fp8E4m3> || std::is_same_v<scalar_t, Fp8E5m2>) {
        scores_widened_tiles<scalar_t, kHeadDim>(qf.data(), k_cache, v_cache, offsets, group, scores.data());
      } else if constexpr (std::is_same_v<scalar_t, float>) {
        for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup)
          scores_avx512_in_registers<scalar_t, kHeadDim>(qf.data() + g0 * kHeadDim, k_cache,
                                                         std::min<int64_t>(kMaxGroup, group - g0), num_tokens,
                                                         scores.data() + g0 * num_tokens, for_each_token);
      } else {
        scores_avx512<scalar_t, kHeadDim>(qf.data(), k_cache, v_cache, offsets, group, scores.data());
      }
      softmax();
      auto for_each_prefetched = [&](auto&& visit) {
        for (int64_t t = 0; t < num_tokens; ++t) {
          if (t + kPrefetchDistance < num_tokens) prefetch_row(v_cache + offsets[t + kPrefetchDistance], kHeadDim);
          visit(t, offsets[t]);
        }
      };
      for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup)
        values_avx512<scalar_t, kHeadDim>(v_cache, scores.data() + g0 * num_tokens, std::min<int64_t>(kMaxGroup, group - g0),
                                          num_tokens, acc + g0 * kHeadDim, for_each_prefetched);
    }
#endif
  } else {
    scores_generic(qf.data(), k_cache, group, head_dim, num_tokens, scores.data(), row.data(), for_each_token);
    softmax();
    values_generic(v_cache, scores.data(), group, head_dim, num_tokens, acc, row.data(), for_each_token);
  }
}

// int4 is read in place on AVX-512 and AVX2 (fp32 products); other builds decode it into scratch
// (paged_decode_attention_quantized).
#if defined(KVSERVE_SIMD)
#define KVSERVE_INT4_IN_PLACE 1
// decode_task over an int4 cache read in place (head sizes 64 and 128): the same partial result.
template <typename q_t, int kHeadDim>
void decode_task_int4(const q_t* q, const kvq::Source& keys, const kvq::Source& values, const int64_t* table,
                      int64_t end_token, int64_t first_token, int64_t block_size, int64_t kv_head, int64_t group,
                      float scale, float* partial, std::vector<float>& scores, std::vector<float>& qf,
                      std::vector<int64_t>& rows, std::vector<float>& scratch) {
  const int64_t num_tokens = end_token - first_token;
  float* row_max = partial + group * kHeadDim;
  scores.resize(group * num_tokens);
  qf.resize(group * kHeadDim);
  to_float(q, qf.data(), group * kHeadDim);
  for (int64_t i = 0; i < group * kHeadDim; ++i) qf[i] *= scale;
  rows.clear();
  for (int64_t pos = first_token; pos < end_token; ++pos)
    rows.push_back((table[pos / block_size] * block_size + pos % block_size) * keys.num_kv_heads + kv_head);
  scores_int4_keys<kHeadDim>(qf.data(), keys, values, table, first_token, end_token, block_size, kv_head, group, rows,
                             scores.data(), scratch);
  exp_rows(scores.data(), group, num_tokens, row_max, row_max + group);
#if defined(__AVX512F__)
  // The values pass takes the group's query rows kMaxGroup at a time (their accumulators in registers).
  constexpr int kMaxGroup = RegisterPlan<kHeadDim>::kMaxGroup;
  for (int64_t g0 = 0; g0 < group; g0 += kMaxGroup)
    values_int4<kHeadDim>(values, rows, scores.data() + g0 * num_tokens, std::min<int64_t>(kMaxGroup, group - g0),
                          partial + g0 * kHeadDim);
#else
  values_int4_avx2<kHeadDim>(values, rows, scores.data(), group, partial);
#endif
}

// Whether this build reads an int4 cache in place for this head size.
inline bool int4_in_place(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }
#endif

// One part's partial result for one pair's query rows: their unnormalised sums [group x head_dim], row maxima
// and row sums. A shared-prefix part holds every member's rows; each member reads its own.
struct PartialRows {
  const float* sums;
  const float* maxima;
  const float* totals;
};

// Softmax-weighted sums over a whole context from its parts' partial results (flash-decoding's reduction):
// each part's sums and row sum are rescaled by e^(part max - overall max).
template <typename scalar_t>
void merge_partials(const PartialRows* parts, int64_t num_parts, int64_t group, int64_t head_dim, scalar_t* out,
                    std::vector<float>& weighted) {
  weighted.resize(head_dim);
  for (int64_t g = 0; g < group; ++g) {
    float overall_max = parts[0].maxima[g];
    for (int64_t i = 1; i < num_parts; ++i) overall_max = std::max(overall_max, parts[i].maxima[g]);
    float total = 0.f;
    std::fill(weighted.begin(), weighted.end(), 0.f);
    for (int64_t i = 0; i < num_parts; ++i) {
      const float weight = std::exp(parts[i].maxima[g] - overall_max);
      total += parts[i].totals[g] * weight;
      const float* sums = parts[i].sums + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) weighted[d] += sums[d] * weight;
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < head_dim; ++d) out[g * head_dim + d] = static_cast<scalar_t>(weighted[d] * inv);
  }
}

}  // namespace

namespace {

// Tasks are (sequence, KV head) pairs. With fewer pairs than threads to keep busy (a long single-user session),
// each context is split into parts of at least kMinPartTokens, merged afterwards as flash decoding does;
// `max_part_tokens` > 0 also caps a part's length (a quantized cache decodes each part into scratch that must
// stay in L2).
//
// Shared prefixes (cascade attention): decodes whose block tables begin with the same blocks (a long shared
// system prompt) form a group. Each of the group's KV heads reads those blocks once for every member's query
// rows together (a GQA group of members x group rows), in parts of its own; each member's own parts cover only
// the tokens after them, and the merge combines both.
//
// The threads take the parts a unit at a time (units differ in cost, so not in equal shares of the count): the
// shared parts first, one a unit, the largest; then each sequence's own parts over all its KV heads as one unit,
// one head after another on one thread, so a block's K/V rows (the heads side by side) are read as one stream
// rather than a head's rows at a time, every few hundred bytes, by different threads. A sequence whose own work
// is a large share of the step's (a long context beside short ones) stays one unit a part, to keep the threads even.
struct Part {
  int64_t seq, kv_head, first, end;
  int64_t shared_group = -1;  // >= 0: a shared-prefix part of that group, whose leader is `seq`
};

struct SharedPrefixes {
  const int64_t* lens = nullptr;     // [num_seqs] leading tokens read by the group's shared parts (0: no group)
  const int64_t* leaders = nullptr;  // [num_seqs] the group's first member (any member's table reads the same)
};

struct PartPlan {
  std::vector<Part> parts;           // every pair's own parts, in pair order, then the shared parts
  std::vector<int64_t> pair_start;   // own parts of pair p: [pair_start[p], pair_start[p + 1])
  int64_t num_own_parts = 0;
  std::vector<std::vector<int64_t>> groups;  // members of each shared-prefix group
  std::vector<int64_t> group_of, member_index;  // [num_seqs]: the sequence's group and place in it (-1: none)
  std::vector<int64_t> shared_start;  // shared parts of (group, KV head) i: [shared_start[i], shared_start[i + 1])
  std::vector<std::pair<int64_t, int64_t>> units;  // what a thread takes at once: parts [first, second), in order
};

constexpr int64_t kMaxUnitShare = 8;  // a sequence's own parts form one unit while under 1 / (this x threads)

// plan.units: every shared part alone (largest first), then each sequence's own parts as one unit while its
// tokens over all KV heads stay under the step's own tokens / (kMaxUnitShare x threads), else one unit a part.
void plan_units(PartPlan& plan, int64_t num_seqs, int64_t num_kv_heads, int64_t threads) {
  std::vector<int64_t> own_tokens(num_seqs, 0);
  for (int64_t i = 0; i < plan.num_own_parts; ++i)
    own_tokens[plan.parts[i].seq] += plan.parts[i].end - plan.parts[i].first;
  int64_t total = 0;
  for (const int64_t tokens : own_tokens) total += tokens;
  for (int64_t i = static_cast<int64_t>(plan.parts.size()) - 1; i >= plan.num_own_parts; --i)
    plan.units.emplace_back(i, i + 1);
  for (int64_t seq = num_seqs - 1; seq >= 0; --seq) {
    const int64_t first = plan.pair_start[seq * num_kv_heads], end = plan.pair_start[(seq + 1) * num_kv_heads];
    if (own_tokens[seq] * kMaxUnitShare * threads <= total) {
      plan.units.emplace_back(first, end);
    } else {
      for (int64_t i = end - 1; i >= first; --i) plan.units.emplace_back(i, i + 1);
    }
  }
}

// Parts of at least `min_tokens` (at most `max_part_tokens` when > 0) over [first, end), `wanted` if long enough.
void split_context(std::vector<Part>& parts, Part whole, int64_t wanted, int64_t min_tokens, int64_t max_part_tokens) {
  const int64_t length = whole.end - whole.first;
  int64_t count = std::clamp<int64_t>(length / min_tokens, 1, wanted);
  if (max_part_tokens > 0) count = std::max(count, (length + max_part_tokens - 1) / max_part_tokens);
  for (int64_t i = 0; i < count; ++i) {
    Part part = whole;
    part.first = whole.first + length * i / count;
    part.end = whole.first + length * (i + 1) / count;
    parts.push_back(part);
  }
}

PartPlan plan_parts(const int64_t* lens, int64_t num_seqs, int64_t num_kv_heads, int64_t sliding_window,
                    int64_t max_part_tokens, SharedPrefixes shared = {}) {
  const int64_t num_pairs = num_seqs * num_kv_heads, threads = at::get_num_threads();
  const int64_t wanted_parts = num_pairs >= 2 * threads ? 1 : (2 * threads + num_pairs - 1) / num_pairs;
  PartPlan plan;
  plan.group_of.assign(num_seqs, -1);
  plan.member_index.assign(num_seqs, -1);
  for (int64_t seq = 0; seq < num_seqs && shared.lens; ++seq) {
    if (shared.lens[seq] <= 0) continue;
    const int64_t leader = shared.leaders[seq];
    TORCH_CHECK(leader >= 0 && leader <= seq && shared.lens[leader] == shared.lens[seq],
                "a shared-prefix group's leader must be its first member, with the same shared length");
    TORCH_CHECK(shared.lens[seq] < lens[seq], "a shared prefix must leave each member its own tokens");
    TORCH_CHECK(sliding_window <= 0, "shared prefixes are not read under a sliding window");
    if (plan.group_of[leader] < 0) {
      plan.group_of[leader] = static_cast<int64_t>(plan.groups.size());
      plan.groups.emplace_back();
    }
    plan.group_of[seq] = plan.group_of[leader];
    plan.member_index[seq] = static_cast<int64_t>(plan.groups[plan.group_of[seq]].size());
    plan.groups[plan.group_of[seq]].push_back(seq);
  }
  plan.pair_start.assign(num_pairs + 1, 0);
  for (int64_t pair = 0; pair < num_pairs; ++pair) {
    const int64_t seq = pair / num_kv_heads, context_len = lens[seq];
    int64_t first = sliding_window > 0 ? std::max<int64_t>(0, context_len - sliding_window) : 0;
    if (plan.group_of[seq] >= 0) first = shared.lens[seq];
    split_context(plan.parts, {seq, pair % num_kv_heads, first, context_len}, wanted_parts, kMinPartTokens,
                  max_part_tokens);
    plan.pair_start[pair + 1] = static_cast<int64_t>(plan.parts.size());
  }
  plan.num_own_parts = static_cast<int64_t>(plan.parts.size());
  plan.shared_start.assign(plan.groups.size() * num_kv_heads + 1, plan.num_own_parts);
  // A shared part scores every member's rows, so it may be split finer than an own context, but only as far as
  // the threads need: each split pads another part to whole tiles and adds a partial to every member's merge.
  const int64_t shared_pairs = static_cast<int64_t>(plan.groups.size()) * num_kv_heads;
  const int64_t shared_wanted = shared_pairs == 0 ? 1 : (threads + shared_pairs - 1) / shared_pairs;
  for (size_t g = 0; g < plan.groups.size(); ++g) {
    const int64_t leader = plan.groups[g][0];
    for (int64_t head = 0; head < num_kv_heads; ++head) {
      const int64_t members = static_cast<int64_t>(plan.groups[g].size());
      split_context(plan.parts, {leader, head, 0, shared.lens[leader], static_cast<int64_t>(g)}, shared_wanted,
                    std::max<int64_t>(kMinPartTokens / members, 16), max_part_tokens);
      plan.shared_start[g * num_kv_heads + head + 1] = static_cast<int64_t>(plan.parts.size());
    }
  }
  plan_units(plan, num_seqs, num_kv_heads, threads);
  return plan;
}

SharedPrefixes shared_prefixes(const at::Tensor& shared_lens, const at::Tensor& shared_leaders,
                               int64_t num_seqs) {
  if (shared_lens.numel() == 0) return {};
  TORCH_CHECK(shared_lens.scalar_type() == at::kLong && shared_leaders.scalar_type() == at::kLong &&
              shared_lens.is_contiguous() && shared_leaders.is_contiguous() && shared_lens.numel() == num_seqs &&
              shared_leaders.numel() == num_seqs, "shared_lens and shared_leaders: int64 [num_seqs] (or empty)");
  return {shared_lens.data_ptr<int64_t>(), shared_leaders.data_ptr<int64_t>()};
}

struct NoUnitTask {
  template <typename... Args>
  bool operator()(Args&&...) const { return false; }
};

// Runs every part (task(part, its query rows, their count, partial, scratch...)) and merges each pair's parts into
// out [num_seqs, num_heads, head_dim]. A part's partial result holds its rows' [sums | maxima | totals].
// unit_task(first part, end part, the first's partial, scores, offsets) may take a whole unit at once (true) or
// leave its parts to `task` (false).
template <typename TaskFn, typename q_t, typename UnitFn = NoUnitTask>
void run_parts(const PartPlan& plan, int64_t num_seqs, int64_t num_kv_heads, int64_t group, int64_t head_dim,
               const q_t* q, q_t* out_ptr, TaskFn&& task, UnitFn&& unit_task = {}) {
  const int64_t num_heads = num_kv_heads * group, num_parts = static_cast<int64_t>(plan.parts.size());
  auto rows_of = [&](const Part& part) {
    return part.shared_group < 0 ? group : static_cast<int64_t>(plan.groups[part.shared_group].size()) * group;
  };
  std::vector<int64_t> partial_at(num_parts + 1, 0);
  for (int64_t i = 0; i < num_parts; ++i) partial_at[i + 1] = partial_at[i] + rows_of(plan.parts[i]) * (head_dim + 2);
  // Every task writes its whole partial: no zeroing (a step's partials are a few hundred KiB).
  const std::unique_ptr<float[]> partials(new float[partial_at.back()]);
  // The members' query rows under each (group, KV head), side by side as one GQA group.
  std::vector<int64_t> shared_q_at(plan.shared_start.size(), 0);
  for (size_t i = 0; i + 1 < plan.shared_start.size(); ++i)
    shared_q_at[i + 1] = shared_q_at[i] + static_cast<int64_t>(plan.groups[i / num_kv_heads].size()) * group * head_dim;
  std::vector<q_t> shared_q(shared_q_at.back());
  for (size_t i = 0; i + 1 < plan.shared_start.size(); ++i) {
    const auto& members = plan.groups[i / num_kv_heads];
    const int64_t head = static_cast<int64_t>(i) % num_kv_heads;
    for (size_t m = 0; m < members.size(); ++m)
      std::copy_n(q + (members[m] * num_heads + head * group) * head_dim, group * head_dim,
                  shared_q.data() + shared_q_at[i] + static_cast<int64_t>(m) * group * head_dim);
  }
  const int64_t num_units = static_cast<int64_t>(plan.units.size());
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, qf, row, k_rows, v_rows;
    std::vector<int64_t> offsets;
    for (int64_t next = taken++; next < num_units; next = taken++) {
      const auto [first, end] = plan.units[next];
      if (unit_task(first, end, partials.get() + partial_at[first], scores, offsets)) continue;
      for (int64_t i = first; i < end; ++i) {
        const Part& part = plan.parts[i];
        const q_t* rows = part.shared_group < 0
            ? q + (part.seq * num_heads + part.kv_head * group) * head_dim
            : shared_q.data() + shared_q_at[part.shared_group * num_kv_heads + part.kv_head];
        task(part, rows, rows_of(part), partials.get() + partial_at[i], scores, qf, row, offsets, k_rows, v_rows);
      }
    }
  });
  at::parallel_for(0, num_seqs * num_kv_heads, 16, [&](int64_t begin, int64_t end) {
    std::vector<PartialRows> views;
    std::vector<float> weighted;
    for (int64_t pair = begin; pair < end; ++pair) {
      views.clear();
      for (int64_t i = plan.pair_start[pair]; i < plan.pair_start[pair + 1]; ++i) {
        const float* partial = partials.get() + partial_at[i];
        views.push_back({partial, partial + group * head_dim, partial + group * head_dim + group});
      }
      const int64_t seq = pair / num_kv_heads, shared_group = plan.group_of[seq];
      if (shared_group >= 0) {
        const int64_t key = shared_group * num_kv_heads + pair % num_kv_heads;
        const int64_t rows = static_cast<int64_t>(plan.groups[shared_group].size()) * group;
        const int64_t row0 = plan.member_index[seq] * group;
        for (int64_t i = plan.shared_start[key]; i < plan.shared_start[key + 1]; ++i) {
          const float* partial = partials.get() + partial_at[i];
          views.push_back({partial + row0 * head_dim, partial + rows * head_dim + row0,
                           partial + rows * head_dim + rows + row0});
        }
      }
      merge_partials(views.data(), static_cast<int64_t>(views.size()), group, head_dim,
                     out_ptr + pair * group * head_dim, weighted);
    }
  });
}

#if defined(__AVX512BF16__)
// A unit of one sequence's own parts over all its KV heads (parts in pair order: head h's p-th at first + h x
// parts per head + p, every head's p-th over the same tokens) runs as decode_sequence_bf16 a part index at a time;
// false for any other unit.
bool decode_sequence_unit(const PartPlan& plan, int64_t first, int64_t end, const at::BFloat16* q,
                          const at::BFloat16* k_cache, const at::BFloat16* v_cache, const int64_t* tables,
                          int64_t max_blocks, int64_t block_size, int64_t num_kv_heads, int64_t group, int64_t head_dim,
                          float scale, float* partial, std::vector<float>& scores, std::vector<int64_t>& offsets) {
  const Part& lead = plan.parts[first];
  const int64_t count = end - first;
  if (lead.shared_group >= 0 || count % num_kv_heads != 0 || plan.parts[end - 1].seq != lead.seq ||
      (head_dim != 64 && head_dim != 128))
    return false;
  const int64_t per_head = count / num_kv_heads, partial_floats = group * (head_dim + 2);
  const auto kernel = head_dim == 64 ? decode_sequence_bf16<64> : decode_sequence_bf16<128>;
  for (int64_t p = 0; p < per_head; ++p) {
    const Part& part = plan.parts[first + p];
    kernel(q + lead.seq * num_kv_heads * group * head_dim, k_cache, v_cache, tables + lead.seq * max_blocks,
           part.first, part.end, block_size, num_kv_heads, group, scale, partial + p * partial_floats,
           per_head * partial_floats, scores, offsets);
  }
  return true;
}
#endif

template <typename q_t, typename cache_t>
using DecodeTaskFn = void (*)(const q_t*, const cache_t*, const cache_t*, const int64_t*, int64_t, int64_t, int64_t,
                              int64_t, int64_t, int64_t, int64_t, float, CacheScales, float*, std::vector<float>&,
                              std::vector<float>&, std::vector<float>&, std::vector<int64_t>&);

template <typename q_t, typename cache_t>
DecodeTaskFn<q_t, cache_t> decode_task_for(int64_t head_dim) {
  return head_dim == 64 ? decode_task<q_t, cache_t, 64>
         : head_dim == 128 ? decode_task<q_t, cache_t, 128> : decode_task<q_t, cache_t, 0>;
}

void check_decode_inputs(const at::Tensor& q, const at::Tensor& block_tables, const at::Tensor& context_lens,
                         int64_t num_kv_heads) {
  TORCH_CHECK(q.is_contiguous(), "q must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong, "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong, "context_lens: int64");
  TORCH_CHECK(q.size(1) % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
}

// Decode attention with every task reading the paged cache in place (a 16-bit or fp32 cache, or an int8 cache's
// codes with its row scales). caches: [num_blocks, block_size, num_kv_heads, head_dim] elements of cache_t.
template <typename q_t, typename cache_t>
at::Tensor decode_in_place(const at::Tensor& q, const cache_t* k_cache, const cache_t* v_cache,
                              int64_t block_size, int64_t num_kv_heads, const at::Tensor& block_tables,
                              const at::Tensor& context_lens, double scale, int64_t sliding_window,
                              CacheScales cache_scales, SharedPrefixes shared) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  auto out = at::empty_like(q);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  int64_t max_part_tokens = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<q_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>)
    max_part_tokens = tile_attention::kMaxPartTokens;  // what a part on tiles lays out must stay in L2
#endif
  const PartPlan plan = plan_parts(context_lens.data_ptr<int64_t>(), num_seqs, num_kv_heads, sliding_window,
                                   max_part_tokens, shared);
  const auto task_fn = decode_task_for<q_t, cache_t>(head_dim);
  run_parts(plan, num_seqs, num_kv_heads, group, head_dim, q.data_ptr<q_t>(), out.data_ptr<q_t>(),
            [&](const Part& part, const q_t* rows, int64_t num_rows, float* partial, auto& scores, auto& qf,
                auto& row, auto& offsets, auto&, auto&) {
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<q_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>) {
                if (tile_attention::applies(num_rows, head_dim))  // a shared prefix's many rows: pair products
                  return tile_attention::attend_rows(rows, num_rows, k_cache, v_cache, tables + part.seq * max_blocks,
                                                     block_size, num_kv_heads, part.kv_head, head_dim, part.first,
                                                     part.end, static_cast<float>(scale), partial);
              }
#endif
              task_fn(rows, k_cache, v_cache, tables + part.seq * max_blocks, part.end, part.first, block_size,
                      num_kv_heads, part.kv_head, num_rows, head_dim, static_cast<float>(scale), cache_scales, partial,
                      scores, qf, row, offsets);
            },
            [&](int64_t first, int64_t end, float* partial, auto& scores, auto& offsets) {
#if defined(__AVX512BF16__)
              if constexpr (std::is_same_v<q_t, at::BFloat16> && std::is_same_v<cache_t, at::BFloat16>)
                return decode_sequence_unit(plan, first, end, q.data_ptr<q_t>(), k_cache, v_cache, tables, max_blocks,
                                            block_size, num_kv_heads, group, head_dim, static_cast<float>(scale),
                                            partial, scores, offsets);
#endif
              return false;
            });
  return out;
}

}  // namespace

// q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int64; context_lens: [num_seqs] int64 (including the new token).
// sliding_window <= 0 means none. shared_lens / shared_leaders: [num_seqs] int64, or empty for none: sequences
// with the same leader (its first member) share their first shared_lens tokens' blocks, read once for all of
// them (0: not in a group). Returns [num_seqs, num_heads, head_dim].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                     at::Tensor block_tables, at::Tensor context_lens, double scale,
                                     int64_t sliding_window, at::Tensor shared_lens, at::Tensor shared_leaders) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "K and V caches must share a dtype");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() ||
              (q.scalar_type() == at::kFloat && (k_cache.scalar_type() == at::kBFloat16 ||
                                                   k_cache.scalar_type() == at::kHalf)),
              "the KV cache must be in the query's dtype, or bf16/fp16 under an fp32 query");
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  check_decode_inputs(q, block_tables, context_lens, num_kv_heads);
  const SharedPrefixes shared = shared_prefixes(shared_lens, shared_leaders, q.size(0));
  auto run = [&](const auto* k_ptr, const auto* v_ptr, auto q_tag) {
    using q_t = decltype(q_tag);
    return decode_in_place<q_t>(q, k_ptr, v_ptr, block_size, num_kv_heads, block_tables, context_lens, scale,
                                sliding_window, CacheScales{}, shared);
  };
  if (k_cache.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kFloat)
    return run(k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), float{});
  if (k_cache.scalar_type() == at::kHalf && q.scalar_type() == at::kFloat)
    return run(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>(), float{});
  return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    return run(k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(), scalar_t{});
  });
}

namespace {
constexpr int64_t kMaxDequantPartTokens = 256;  // 256 x 128 dims x 4 B x (K + V) = 256 KB of scratch at most
}

// The same over a quantized cache (kv_dequant.h). int8 and fp8 are read in place: their bytes are the cache's
// elements, int8's row scales apply once per token and fp8's tensor scales once per task (decode_task). int4 is
// read in place under bf16 queries where VNNI is and on AVX2 (decode_task_int4). Otherwise each part's K and
// V rows are decoded once into contiguous fp32 scratch, which the fp32-cache task then reads as a one-block context (one KV head, identity table).
// Either way the cache's bytes are read once, fewer of them than a 16-bit cache's.
// k_data/v_data: [num_blocks, block_size, num_kv_heads, data_dim] bytes; k_scales/v_scales: int8's scale bytes
// or int4's fp16 [..., groups] (empty for fp8); k_tensor_scale/v_tensor_scale: fp8's per-layer scales; format:
// kvq::Format.
at::Tensor paged_decode_attention_quantized(at::Tensor q, at::Tensor k_data, at::Tensor v_data,
                                               at::Tensor k_scales, at::Tensor v_scales, double k_tensor_scale,
                                               double v_tensor_scale, int64_t format, at::Tensor block_tables,
                                               at::Tensor context_lens, double scale, int64_t sliding_window,
                                               at::Tensor shared_lens, at::Tensor shared_leaders) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_data.size(1), num_kv_heads = k_data.size(2);
  check_decode_inputs(q, block_tables, context_lens, num_kv_heads);
  const SharedPrefixes shared = shared_prefixes(shared_lens, shared_leaders, num_seqs);
  const kvq::Source keys = kvq::make_source(k_data, k_scales, k_tensor_scale, format, head_dim, true);
  const kvq::Source values = kvq::make_source(v_data, v_scales, v_tensor_scale, format, head_dim, false);
  // int8 and fp8 are read in place: their bytes are the cache's elements, their scales applied outside.
  auto in_place = [&](const auto* k_elements, const auto* v_elements, double query_scale, CacheScales cache_scales) {
    return AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_in_place", [&] {
      return decode_in_place<scalar_t>(q, k_elements, v_elements, block_size, num_kv_heads, block_tables,
                                       context_lens, query_scale, sliding_window, cache_scales, shared);
    });
  };
  if (format == kvq::kInt8)
    return in_place(reinterpret_cast<const int8_t*>(keys.data), reinterpret_cast<const int8_t*>(values.data), scale,
                    CacheScales{static_cast<const uint8_t*>(keys.scales), static_cast<const uint8_t*>(values.scales)});
  auto fp8_in_place = [&](auto element) {
    using fp8_t = decltype(element);
    const float factor = fp8_t::kWideningFactor;  // what the kernels' loads leave out, folded into the scales
    return in_place(reinterpret_cast<const fp8_t*>(keys.data), reinterpret_cast<const fp8_t*>(values.data),
                    scale * keys.tensor_scale * factor, CacheScales{nullptr, nullptr, values.tensor_scale * factor});
  };
  if (format == kvq::kFp8E4m3) return fp8_in_place(Fp8E4m3{});
  if (format == kvq::kFp8E5m2) return fp8_in_place(Fp8E5m2{});
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto out = at::empty_like(q);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
#if defined(KVSERVE_INT4_IN_PLACE)
  if (format == kvq::kInt4 && int4_in_place(head_dim)) {
    const PartPlan plan = plan_parts(context_lens.data_ptr<int64_t>(), num_seqs, num_kv_heads, sliding_window, 0,
                                     shared);
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "decode_int4_in_place", [&] {
      const auto task_fn = head_dim == 64 ? decode_task_int4<scalar_t, 64> : decode_task_int4<scalar_t, 128>;
      run_parts(plan, num_seqs, num_kv_heads, group, head_dim, q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                [&](const Part& part, const scalar_t* q_rows, int64_t num_rows, float* partial, auto& scores,
                    auto& qf, auto& scratch, auto& rows, auto&, auto&) {
                  task_fn(q_rows, keys, values, tables + part.seq * max_blocks, part.end, part.first, block_size,
                          part.kv_head, num_rows, static_cast<float>(scale), partial, scores, qf, rows, scratch);
                });
    });
    return out;
  }
#endif
  const PartPlan plan = plan_parts(context_lens.data_ptr<int64_t>(), num_seqs, num_kv_heads, sliding_window,
                                   kMaxDequantPartTokens, shared);
  const int64_t one_block_table[1] = {0};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_quantized", [&] {
    const auto task_fn = decode_task_for<scalar_t, float>(head_dim);
    run_parts(plan, num_seqs, num_kv_heads, group, head_dim, q.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
              [&](const Part& part, const scalar_t* q_rows, int64_t num_rows, float* partial, auto& scores, auto& qf,
                  auto& row, auto& offsets, auto& k_rows, auto& v_rows) {
                const int64_t num_tokens = part.end - part.first;
                const int64_t* table = tables + part.seq * max_blocks;
                k_rows.resize(num_tokens * head_dim);
                v_rows.resize(num_tokens * head_dim);
                for (int64_t t = 0; t < num_tokens; ++t) {
                  const int64_t pos = part.first + t;
                  const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
                  if (t + 16 < num_tokens) {
                    const int64_t ahead = pos + 16;
                    const int64_t ahead_slot = table[ahead / block_size] * block_size + ahead % block_size;
                    keys.prefetch(ahead_slot, part.kv_head);
                    values.prefetch(ahead_slot, part.kv_head);
                  }
                  keys.decode(slot, part.kv_head, k_rows.data() + t * head_dim);
                  values.decode(slot, part.kv_head, v_rows.data() + t * head_dim);
                }
                task_fn(q_rows, k_rows.data(), v_rows.data(), one_block_table, num_tokens, 0, num_tokens, 1, 0, num_rows,
                        head_dim, static_cast<float>(scale), CacheScales{}, partial, scores, qf, row, offsets);
              });
  });
  return out;
}

// ---- fused elementwise ops --------------------------------------------------------------------------------
// Each replaces a chain of 5-10 torch ops (one Python dispatch and one memory pass each) and rounds at the same
// points as the reference implementation (results agree with the unfused torch code to fp32 rounding).

namespace {

template <typename scalar_t>
inline float round_to(float value) {
  return static_cast<float>(static_cast<scalar_t>(value));
}

template <typename scalar_t>
void rms_norm_row(const scalar_t* x, const scalar_t* weight, scalar_t* out, int64_t hidden, float eps) {
  float sum_sq = 0.f;
  for (int64_t i = 0; i < hidden; ++i) {
    const float v = static_cast<float>(x[i]);
    sum_sq += v * v;
  }
  const float inv = 1.f / std::sqrt(sum_sq / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    // Normalise in fp32, round to the model dtype, then multiply by the weight (rounded again).
    const float normed = round_to<scalar_t>(static_cast<float>(x[i]) * inv);
    out[i] = static_cast<scalar_t>(static_cast<float>(weight[i]) * normed);
  }
}

}  // namespace

// out = weight * rms_normalise(x) over the last dim.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && x.scalar_type() == weight.scalar_type());
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * hidden, wp, op + r * hidden, hidden, (float)eps);
    });
  });
  return out;
}

// residual += x (rounded in the model dtype, as `residual + x` would), then returns weight * rms_normalise(residual).
at::Tensor add_rms_norm_(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous());
  TORCH_CHECK(x.scalar_type() == residual.scalar_type() && x.scalar_type() == weight.scalar_type());
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  auto out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm_", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        scalar_t* row = rp + r * hidden;
        for (int64_t i = 0; i < hidden; ++i)
          row[i] = static_cast<scalar_t>(static_cast<float>(row[i]) + static_cast<float>(xp[r * hidden + i]));
        rms_norm_row(row, wp, op + r * hidden, hidden, (float)eps);
      }
    });
  });
  return out;
}

// Rotary embedding in place on the q and k parts of a fused qkv activation [tokens, (heads + 2 kv_heads) * dim]:
// x = x * cos + rotate_half(x) * sin, with cos/sin rounded to the model dtype and each product rounded,
// as the reference computes it. cos_sin: [max_positions, dim] fp32 caches of cos and sin.
void rotary_qk_(at::Tensor qkv, at::Tensor positions, at::Tensor cos_cache, at::Tensor sin_cache,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.is_contiguous() && positions.scalar_type() == at::kLong);
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat);
  const int64_t tokens = qkv.size(0), width = qkv.size(1), rotated_heads = num_heads + num_kv_heads;
  const int64_t half = head_dim / 2;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* cos_p = cos_cache.data_ptr<float>();
  const float* sin_p = sin_cache.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rotary_qk_", [&] {
    scalar_t* base = qkv.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 4, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* c = cos_p + pos[t] * head_dim;
        const float* s = sin_p + pos[t] * head_dim;
        for (int64_t h = 0; h < rotated_heads; ++h) {
          scalar_t* x = base + t * width + h * head_dim;
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            const float c1 = round_to<scalar_t>(c[i]), c2 = round_to<scalar_t>(c[i + half]);
            const float s1 = round_to<scalar_t>(s[i]), s2 = round_to<scalar_t>(s[i + half]);
            const float y1 = round_to<scalar_t>(x1 * c1) + round_to<scalar_t>(-x2 * s1);
            const float y2 = round_to<scalar_t>(x2 * c2) + round_to<scalar_t>(x1 * s2);
            x[i] = static_cast<scalar_t>(y1);
            x[i + half] = static_cast<scalar_t>(y2);
          }
        }
      }
    });
  });
}

// silu(gate) * up for gate_up = [tokens, 2 * inter] (gate first), rounding after silu as the reference does.
at::Tensor silu_and_mul(at::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous());
  const int64_t tokens = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({tokens, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const scalar_t* gate = in + t * 2 * inter;
        const scalar_t* up = gate + inter;
        for (int64_t i = 0; i < inter; ++i) {
          const float g = static_cast<float>(gate[i]);
          const float activated = round_to<scalar_t>(g / (1.f + std::exp(-g)));
          op[t * inter + i] = static_cast<scalar_t>(activated * static_cast<float>(up[i]));
        }
      }
    });
  });
  return out;
}
