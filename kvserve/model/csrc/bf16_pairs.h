// bf16 rows laid out as the operands of pair products (vdpbf16ps, AMX's tdpbf16ps), which multiply bf16 values
// two at a time: keys as [dim pair][16 keys] tiles (a transpose of 32-bit pairs), values as [key pair][dims][2
// keys] (two rows interleaved). AVX-512 only; callers pass whole rows and say how many of 16 are real.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace bf16_pairs {

// r[i] lane j -> r[j] lane i, for 16 vectors of 16 32-bit lanes.
inline void transpose16(__m512i r[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4i + k], 128-bit lane L: column 4L + k of rows 4i .. 4i + 3
  for (int i = 0; i < 16; i += 4) {
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    const __m512i even_lanes = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x88), odd_lanes = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xDD);
    const __m512i even_high = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x88), odd_high = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xDD);
    r[k] = _mm512_shuffle_i32x4(even_lanes, even_high, 0x88);
    r[8 + k] = _mm512_shuffle_i32x4(even_lanes, even_high, 0xDD);
    r[4 + k] = _mm512_shuffle_i32x4(odd_lanes, odd_high, 0x88);
    r[12 + k] = _mm512_shuffle_i32x4(odd_lanes, odd_high, 0xDD);
  }
}

// 16 keys' rows (`count` real ones, the rest zero) -> tile[dim pair][16 keys] of 32-bit pairs, dim pairs
// [0, head_dim / 2) at `row_stride` 32-bit words apart (16 for one packed tile).
inline void key_tile(const uint16_t* const* rows, int64_t count, int64_t head_dim, uint32_t* tile, int64_t row_stride) {
  for (int64_t p0 = 0; p0 < head_dim / 2; p0 += 16) {
    __m512i r[16];
    for (int64_t j = 0; j < 16; ++j)
      r[j] = j < count ? _mm512_loadu_si512(rows[j] + 2 * p0) : _mm512_setzero_si512();
    transpose16(r);
    for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(tile + (p0 + i) * row_stride, r[i]);
  }
}

// Dims [d, d + 16) of two rows as 16 pairs (a[d + i], b[d + i]); b null: zeros.
inline __m512i value_pairs(const uint16_t* a, const uint16_t* b, int64_t d) {
  const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + d)));
  if (b == nullptr) return low;
  const __m512i high = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + d)));
  return _mm512_or_si512(low, _mm512_slli_epi32(high, 16));
}

}  // namespace bf16_pairs
#endif
