// Quantized KV rows -> fp32, for the kernels that read a quantized cache (kvserve/cache/storage/kv_quant.py is the
// format's definition; this is its decoder, and the two are tested against each other).
//
// A row is one (slot, KV head) vector of `head_dim` elements:
//   fp8_e4m3 / fp8_e5m2: one byte per element, times the layer's tensor scale (widened as simd.h's element
//     types, through fp16 bits, so the hardware's fp16 conversion does the work).
//   int8: one signed byte per element times the row's scale byte: (e + 20) << 3 | m means 2^e x (1 + m/8).
//   int4 values: two codes per byte (low nibble first), code - 8 times the fp16 scale of each group of 32
//     elements.
//   int4 keys: byte i of each 64-element chunk holds element i (low nibble) and i + 32 (high; a shorter last
//     chunk of n: i and i + n/2); an element is (code + z) x step, with its channel's step byte and int8 zero
//     point z from its block's channel bytes [num_blocks, num_kv_heads, 2, head_dim] (steps, then zero points).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace kvq {

enum Format : int64_t { kFp8E4m3 = 1, kFp8E5m2 = 2, kInt8 = 3, kInt4 = 4 };
constexpr int64_t kInt4Group = 32;

using simd::half_to_float;

// An int8 row's scale byte as fp32: the byte's exponent and mantissa become fp32's.
inline float byte_scale(uint32_t code) {
  const uint32_t bits = ((code >> 3) - 20 + 127) << 23 | (code & 7) << 20;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return scale;
}

#if defined(KVSERVE_SIMD)
// Eight scale bytes (one per int32 lane) as fp32, as byte_scale does one.
inline __m256 byte_scales8(__m256i code) {
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_srli_epi32(code, 3), _mm256_set1_epi32(107)), 23);
  const __m256i mantissa = _mm256_slli_epi32(_mm256_and_si256(code, _mm256_set1_epi32(7)), 20);
  return _mm256_castsi256_ps(_mm256_or_si256(exponent, mantissa));
}
#endif

// One int4 key row -> fp32 (the format above). channel: the row's block and head's [2, head_dim] bytes.
inline void decode_int4_key(const uint8_t* row, const uint8_t* channel, int64_t head_dim, float* dst) {
  const uint8_t* steps = channel;
  const int8_t* zeros = reinterpret_cast<const int8_t*>(channel + head_dim);
  for (int64_t start = 0; start < head_dim; start += 64) {
    const int64_t half = std::min<int64_t>(64, head_dim - start) / 2;
    const uint8_t* bytes = row + start / 2;
    int64_t j = 0;
#if defined(KVSERVE_SIMD)
    for (; j + 8 <= half; j += 8) {
      const __m256i packed = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes + j)));
      const __m256i nibble = _mm256_set1_epi32(0x0F);
      const __m256i codes[2] = {_mm256_and_si256(packed, nibble), _mm256_srli_epi32(packed, 4)};
      for (int h = 0; h < 2; ++h) {
        const int64_t e = start + h * half + j;
        const __m256 step = byte_scales8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(steps + e))));
        const __m256 zero = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + e))));
        _mm256_storeu_ps(dst + e, _mm256_mul_ps(_mm256_add_ps(_mm256_cvtepi32_ps(codes[h]), zero), step));
      }
    }
#endif
    for (; j < half; ++j) {
      const int64_t e = start + j;
      dst[e] = (static_cast<float>(bytes[j] & 0x0F) + zeros[e]) * byte_scale(steps[e]);
      dst[e + half] = (static_cast<float>(bytes[j] >> 4) + zeros[e + half]) * byte_scale(steps[e + half]);
    }
  }
}

// One of K or V of one layer, as the kernels receive it.
struct Source {
  const uint8_t* data;     // [slots, num_kv_heads, data_dim] bytes (int8 read as signed)
  // [slots, num_kv_heads, groups]: int8's scale bytes, int4 values' fp16 bits; int4 keys: the channel bytes
  // [num_blocks, num_kv_heads, 2, head_dim]; null for fp8
  const void* scales;
  float tensor_scale;      // fp8's per-layer scale (1 for the others)
  int64_t format, head_dim, num_kv_heads;
  int64_t block_size = 0;  // > 0: int4 keys (scales are per block and channel)

  bool channel_keys() const { return block_size > 0; }
  const uint8_t* block_channels(int64_t block, int64_t head) const {
    return static_cast<const uint8_t*>(scales) + (block * num_kv_heads + head) * 2 * head_dim;
  }

  int64_t data_dim() const { return format == kInt4 ? head_dim / 2 : head_dim; }
  int64_t groups() const { return format == kInt4 ? (head_dim + kInt4Group - 1) / kInt4Group : 1; }
  const uint8_t* row_data(int64_t slot, int64_t head) const { return data + (slot * num_kv_heads + head) * data_dim(); }
  const uint16_t* row_fp16_scales(int64_t slot, int64_t head) const {
    return static_cast<const uint16_t*>(scales) + (slot * num_kv_heads + head) * groups();
  }
  float row_byte_scale(int64_t slot, int64_t head) const {
    return byte_scale(static_cast<const uint8_t*>(scales)[slot * num_kv_heads + head]);
  }
  // Asks for a row's bytes ahead of use, into L2 (strided rows: hardware prefetchers follow them poorly;
  // paged_attention.cpp says why L2).
  void prefetch(int64_t slot, int64_t head) const {
#if defined(KVSERVE_SIMD)
    const char* p = reinterpret_cast<const char*>(row_data(slot, head));
    for (int64_t byte = 0; byte < data_dim(); byte += 64) _mm_prefetch(p + byte, _MM_HINT_T1);
#endif
  }

  void decode(int64_t slot, int64_t head, float* dst) const {
    const uint8_t* row = row_data(slot, head);
    if (format == kInt8) return decode_int8(reinterpret_cast<const int8_t*>(row), row_byte_scale(slot, head), dst);
    if (channel_keys()) return decode_int4_key(row, block_channels(slot / block_size, head), head_dim, dst);
    if (format == kInt4) return decode_int4(row, row_fp16_scales(slot, head), dst);
    decode_fp8(row, dst);
  }

 private:
  // Explicit vectors: int8_t is a char type, which may alias dst as far as the compiler knows, so the plain loop
  // is not vectorised.
  void decode_int8(const int8_t* row, float scale, float* dst) const {
    int64_t d = 0;
#if defined(__AVX512F__)
    const __m512 vscale = _mm512_set1_ps(scale);
    for (; d + 16 <= head_dim; d += 16) {
      const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d)));
      _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_cvtepi32_ps(wide), vscale));
    }
#elif defined(KVSERVE_SIMD)
    const __m256 vscale = _mm256_set1_ps(scale);
    for (; d + 8 <= head_dim; d += 8) {
      const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + d)));
      _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), vscale));
    }
#endif
    for (; d < head_dim; ++d) dst[d] = static_cast<float>(row[d]) * scale;
  }

  void decode_fp8(const uint8_t* row, float* dst) const {
    if (format == kFp8E4m3) return decode_fp8_as(reinterpret_cast<const simd::Fp8E4m3*>(row), dst);
    decode_fp8_as(reinterpret_cast<const simd::Fp8E5m2*>(row), dst);
  }

  template <typename fp8_t>
  void decode_fp8_as(const fp8_t* row, float* dst) const {
    const float scale = tensor_scale * fp8_t::kWideningFactor;
    int64_t d = 0;
#if defined(KVSERVE_SIMD)
    using simd::Simd;
    const Simd::V vscale = Simd::set1(scale);
    for (; d + Simd::kLanes <= head_dim; d += Simd::kLanes) Simd::store(dst + d, Simd::mul(Simd::load(row + d), vscale));
#endif
    for (; d < head_dim; ++d) dst[d] = simd::to_float(row[d]) * scale;
  }

  void decode_int4(const uint8_t* row, const uint16_t* scales, float* dst) const {
    int64_t d = 0;
#if defined(KVSERVE_SIMD)
    for (; d + kInt4Group <= head_dim; d += kInt4Group) {
      // 16 bytes = 32 codes: split the nibbles and interleave them back into element order.
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d / 2));
      const __m128i mask = _mm_set1_epi8(0x0F);
      const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
      const __m128i first = _mm_unpacklo_epi8(low, high), second = _mm_unpackhi_epi8(low, high);
      const float scale = half_to_float(scales[d / kInt4Group]);
#if defined(__AVX512F__)
      const __m512 vscale = _mm512_set1_ps(scale), offset = _mm512_set1_ps(8.f);
      _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(first)), offset), vscale));
      _mm512_storeu_ps(dst + d + 16, _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(second)), offset), vscale));
#else
      const __m256 vscale = _mm256_set1_ps(scale), offset = _mm256_set1_ps(8.f);
      const __m128i parts[4] = {first, _mm_srli_si128(first, 8), second, _mm_srli_si128(second, 8)};
      for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(dst + d + 8 * i,
                         _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), offset), vscale));
#endif
    }
#endif
    for (; d < head_dim; ++d) {
      const uint8_t byte = row[d / 2];
      const int code = (d % 2 ? byte >> 4 : byte & 0x0F) - 8;
      dst[d] = static_cast<float>(code) * half_to_float(scales[d / kInt4Group]);
    }
  }
};

// Builds a Source from the tensors kvserve/cache/storage/kv_storage.py keeps (scales may be an empty tensor for fp8).
// keys: this is K (int4 keys have their own layout).
inline Source make_source(const at::Tensor& data, const at::Tensor& scales, double tensor_scale,
                          int64_t format, int64_t head_dim, bool keys) {
  TORCH_CHECK(format >= kFp8E4m3 && format <= kInt4, "unknown quantized KV format ", format);
  TORCH_CHECK(data.is_contiguous() && data.element_size() == 1 && data.dim() == 4,
              "quantized KV data: contiguous bytes [blocks, block_size, kv_heads, data_dim]");
  const bool channel_keys = keys && format == kInt4;
  TORCH_CHECK(format != kInt8 || (scales.is_contiguous() && scales.scalar_type() == at::kByte),
              "int8 KV scales: contiguous uint8");
  TORCH_CHECK(format != kInt4 || channel_keys || (scales.is_contiguous() && scales.scalar_type() == at::kHalf),
              "int4 value scales: contiguous fp16");
  TORCH_CHECK(!channel_keys || (scales.is_contiguous() && scales.scalar_type() == at::kByte && scales.dim() == 4 &&
                                scales.size(0) == data.size(0) && scales.size(2) == 2 && scales.size(3) == head_dim),
              "int4 key channel bytes: contiguous uint8 [blocks, kv_heads, 2, head_dim]");
  const bool scaled = format == kInt8 || format == kInt4;
  return Source{static_cast<const uint8_t*>(data.data_ptr()), scaled ? scales.data_ptr() : nullptr,
                static_cast<float>(tensor_scale), format, head_dim, data.size(2), channel_keys ? data.size(1) : 0};
}

}  // namespace kvq
