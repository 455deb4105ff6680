// One fp32 vector type per ISA family the kernels are built for, so a kernel is written once over `Simd`
// and compiled per family (kvserve/model/cpu_isa.py picks the compiler flags):
//   AVX-512F: __m512, 16 lanes, 32 registers;  AVX2 + FMA + F16C: __m256, 8 lanes, 16 registers.
// KVSERVE_SIMD is defined when either is; without it the kernels' scalar paths run.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Half.h>

#include <cstdint>

namespace simd {
// An fp8 cache's bytes as element types, so a kernel written over its cache's element type reads fp8 in place
// (Simd::load and to_float below widen them). Both go through fp16 bits: e5m2 is the top byte of an fp16, and
// e4m3's exponent and mantissa shift into an fp16 whose value is 2^-8 of e4m3's, subnormals included. That
// 2^-8 is left in (a multiply a vector saved in kernels that convert every element they read): callers fold
// kWideningFactor into the scales they apply anyway.
struct Fp8E4m3 {
  uint8_t bits;
  static constexpr float kWideningFactor = 256.f;  // value = widened x this
};
struct Fp8E5m2 {
  uint8_t bits;
  static constexpr float kWideningFactor = 1.f;
};
}  // namespace simd

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define KVSERVE_SIMD 1
#include <immintrin.h>

namespace simd {

#if defined(__AVX512F__)
struct Simd {
  using V = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kRegisters = 32;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::BFloat16* p) {  // bf16 -> fp32 is a 16-bit shift
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
  }
  static V load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V load(const int8_t* p) {  // an int8 cache's codes (its scales are applied per row, outside)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }
  static V load(const Fp8E5m2* p) { return _mm512_cvtph_ps(_mm256_slli_epi16(load_bytes(p), 8)); }
  static V load(const Fp8E4m3* p) {  // sign-extended << 7: the sign in bits 15 and 14, then bit 14 cleared
    const __m256i bits = _mm256_slli_epi16(load_bytes(p), 7);
    return _mm512_cvtph_ps(_mm256_and_si256(bits, _mm256_set1_epi16(0xBFFF)));
  }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  static V round(V v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V scale_by_pow2(V p, V n) { return _mm512_scalef_ps(p, n); }  // p * 2^n, n integral
  static V keep_where_greater(V x, V v, V threshold) {  // x where v > threshold, else 0
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(v, threshold, _CMP_GT_OQ), x);
  }

 private:
  static __m256i load_bytes(const void* p) {  // 16 bytes, sign-extended into 16-bit lanes
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
};
#else
struct Simd {
  using V = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kRegisters = 16;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::BFloat16* p) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
  static V load(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static V load(const int8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }
  static V load(const Fp8E5m2* p) { return _mm256_cvtph_ps(_mm_slli_epi16(load_bytes(p), 8)); }
  static V load(const Fp8E4m3* p) {
    return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(load_bytes(p), 7), _mm_set1_epi16(0xBFFF)));
  }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float reduce_add(V v) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  static float reduce_max(V v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static V round(V v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static V scale_by_pow2(V p, V n) {  // p * 2^n for integral n in [-126, 127]: n goes into the exponent bits
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  }
  static V keep_where_greater(V x, V v, V threshold) { return _mm256_and_ps(x, _mm256_cmp_ps(v, threshold, _CMP_GT_OQ)); }

 private:
  static __m128i load_bytes(const void* p) {  // 8 bytes, sign-extended into 16-bit lanes
    return _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  }
};
#endif

// e^x for x <= 0 (softmax arguments): 2^(x log2 e) split into an integer power and a degree-6 polynomial of
// the fraction; relative error ~2e-7.
inline Simd::V exp_nonpositive(Simd::V x) {
  x = Simd::max(x, Simd::set1(-87.f));
  const Simd::V t = Simd::mul(x, Simd::set1(1.44269504088896341f));
  const Simd::V n = Simd::round(t);
  const Simd::V f = Simd::mul(Simd::sub(t, n), Simd::set1(0.6931471805599453f));
  Simd::V p = Simd::set1(1.f / 720.f);
  p = Simd::fmadd(p, f, Simd::set1(1.f / 120.f));
  p = Simd::fmadd(p, f, Simd::set1(1.f / 24.f));
  p = Simd::fmadd(p, f, Simd::set1(1.f / 6.f));
  p = Simd::fmadd(p, f, Simd::set1(0.5f));
  p = Simd::fmadd(p, f, Simd::set1(1.f));
  p = Simd::fmadd(p, f, Simd::set1(1.f));
  return Simd::scale_by_pow2(p, n);
}

}  // namespace simd

#endif

namespace simd {
inline float half_to_float(uint16_t bits) {
#if defined(KVSERVE_SIMD)
  return _cvtsh_ss(bits);  // F16C: one instruction
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

inline float to_float(Fp8E5m2 x) { return half_to_float(static_cast<uint16_t>(x.bits << 8)); }
inline float to_float(Fp8E4m3 x) {  // 2^-8 of the value, as Simd::load
  return half_to_float(static_cast<uint16_t>(((x.bits & 0x80) << 8) | ((x.bits & 0x7f) << 7)));
}
}  // namespace simd

namespace simd {
// Walks that stream weights from memory (a decode step's matmuls) ask for the bytes kPrefetchBytes ahead of
// the ones they read. The walks do enough arithmetic per cache line that an Intel core (Sapphire Rapids) keeps
// too few misses in flight by itself and reads at under half the memory's speed; benchmarks/RESULTS.md has the
// measurement. `bytes` is what the caller reads at `p`: every cache line of it is requested, ahead.
constexpr int64_t kPrefetchBytes = 2048;

inline void prefetch_ahead(const void* p, int64_t bytes) {
#if defined(KVSERVE_SIMD)
  const char* ahead = static_cast<const char*>(p) + kPrefetchBytes;
  for (int64_t offset = 0; offset < bytes; offset += 64) _mm_prefetch(ahead + offset, _MM_HINT_T0);
#else
  (void)p, (void)bytes;
#endif
}

// Slice `step` of `steps` of [region, region + bytes): every cache line starting in it asked for (a region the
// caller reads next, requested a slice per step of the work before it).
inline void prefetch_slice(const void* region, int64_t bytes, int64_t step, int64_t steps) {
#if defined(KVSERVE_SIMD)
  for (int64_t offset = step * bytes / steps / 64 * 64; offset < (step + 1) * bytes / steps; offset += 64)
    _mm_prefetch(static_cast<const char*>(region) + offset, _MM_HINT_T0);
#else
  (void)region, (void)bytes, (void)step, (void)steps;
#endif
}
}  // namespace simd
