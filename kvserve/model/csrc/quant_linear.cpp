// x @ W.T (+ bias) over a weight held as its GGUF file holds it: each row of W a run of ggml blocks (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0 in blocks of 32 values; Q4_K, Q5_K, Q6_K in super-blocks of 256), read in place for every
// batch size, so the weights cost their file's bytes and no dequantized copy exists (layers.QuantWeight).
//
// - Few rows (a decode step of one or a few streams): every weight byte is used for M multiply-adds, so the
//   matmul is a walk over the blocks at memory speed: x quantized to int8 per 32 values, each group of 32
//   weights unpacked in registers and multiplied by integer dot products, as llama.cpp does.
// - More rows (batched decode, prefill): chunks of weight rows decoded into x's dtype, a cache's worth at a
//   time, and multiplied by torch's matmul: the same arithmetic as a dequantized weight's matmul, without ever
//   holding the whole weight dequantized. On CPUs with AMX, bf16 x takes AMX's tile products instead: 9 to 48
//   rows (a batched decode step) multiply 16 weight rows at a time, decoded into a tile in L1; more rows
//   (prefill) multiply panels of 32 weight rows decoded once per call into L2. Elsewhere int8 panels take
//   some of these batches (see "int8 panels"): x rounded to int8 per 32 values and multiplied by integer dot
//   products over panels of 8 or 16 weight rows decoded once per call: K-quants with fp32 x on CPUs without bf16
//   dot products, the 32-value types with bf16 x on CPUs with them but without AMX.
//
// A 16-bit or fp32 weight (ggml's F16, BF16, F32: a checkpoint's plain rows) is held once and read here too: up
// to 8 rows by small_batch_linear's walk, 9 to 48 rows of bf16 x on AMX tiles as above, more rows by torch's
// matmul on the rows in place, or, when x's dtype is not the weight's (fp32 x on a CPU without bf16 dot
// products, weights kept 16-bit), slices widened as blocks are decoded.
//
// Values are decoded as ggml (and gguf.quants) define them. Accumulation is fp32, the result rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <type_traits>
#include <unistd.h>
#include <vector>

#include "amx.h"
#include "bf16_pairs.h"
#include "simd.h"

namespace {

// ggml's ids of the types read here (gguf.GGMLQuantizationType).
enum GgmlType : int64_t {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14,
  kBF16 = 30,
};

// Plain rows of values (a block of one value, for the checks below); DenseValue is their C++ type.
template <int64_t Type>
constexpr bool kDense = Type == kF32 || Type == kF16 || Type == kBF16;
template <int64_t Type>
using DenseValue = std::conditional_t<Type == kF32, float, std::conditional_t<Type == kF16, at::Half, at::BFloat16>>;

struct Layout {
  int64_t values;  // per block
  int64_t bytes;   // per block
};

bool known_type(int64_t type) {
  switch (type) {
    case kF32: case kF16: case kBF16:
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    default: return false;
  }
}

Layout layout_of(int64_t type) {
  switch (type) {
    case kF32: return {1, 4};
    case kF16: case kBF16: return {1, 2};
    case kQ4_0: return {32, 18};
    case kQ4_1: return {32, 20};
    case kQ5_0: return {32, 22};
    case kQ5_1: return {32, 24};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "quant_linear does not read ggml type ", type);
  }
}

constexpr int64_t kChunk = 256;  // values decoded at a time: one super-block, or eight blocks of 32
constexpr int64_t kMaxWalkRows = 8;
constexpr int64_t kWalkChunkBytes = 64 * 1024;  // weight bytes a walking thread claims at a time  // up to this many rows of x, the walk over the blocks

inline float fp16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return simd::half_to_float(bits);
}

// ---------------------------------------------------------------------------------------------- blocks -> fp32

// The 6-bit scale and minimum of sub-block j of a Q4_K / Q5_K super-block, packed in 12 bytes as ggml packs them.
inline void scale_min_k4(int j, const uint8_t* q, int& scale, int& min) {
  if (j < 4) {
    scale = q[j] & 63;
    min = q[j + 4] & 63;
  } else {
    scale = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    min = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Blocks are decoded a vector of kLanes values at a time, as GCC/Clang vector types: one definition for every
// family (the compiler emits vpmovzxbd, vpand, vpsrld, vcvtdq2ps, vfmadd at AVX-512's or AVX2's width, and
// plain code on the generic family).
#if defined(KVSERVE_SIMD)
using simd::Simd;
constexpr int kLanes = Simd::kLanes;
#else
constexpr int kLanes = 8;
#endif
typedef int32_t IV __attribute__((vector_size(4 * kLanes)));
typedef float FV __attribute__((vector_size(4 * kLanes)));
typedef uint8_t U8 __attribute__((vector_size(kLanes)));
typedef int8_t I8 __attribute__((vector_size(kLanes)));

inline IV bytes_u8(const uint8_t* p) {
  U8 b;
  std::memcpy(&b, p, kLanes);
  return __builtin_convertvector(b, IV);
}
inline IV bytes_i8(const uint8_t* p) {
  I8 b;
  std::memcpy(&b, p, kLanes);
  return __builtin_convertvector(b, IV);
}
inline FV to_float(IV a) { return __builtin_convertvector(a, FV); }

// d * q + m, the values of blocks with a scale and a minimum (or offset folded into m).
inline FV affine(IV q, float d, float m) { return to_float(q) * d + m; }

// The portable decoder (the generic family's walk and slices): `f(i, v)` gets values [i, i + kLanes) of the
// block as fp32 lanes.
// Q4_0 / Q4_1: d (and m), 16 bytes: element i in the low nibble of byte i, element i + 16 in the high one.
// Q5_0 / Q5_1: the same, and the fifth bit of element j is bit j of a 32-bit qh.
// Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and minimums, (Q5_K: 32 bytes of fifth bits), 128 bytes of
// nibbles; eight sub-blocks of 32, sub-block 2i in the low nibbles of 32 bytes and 2i + 1 in their high ones.
// Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales (one per 16 values), then d.
template <int64_t Type, typename F>
inline void decode_vectors(const uint8_t* b, F&& f) {
  if constexpr (Type == kQ4_0 || Type == kQ4_1) {
    const float d = fp16_at(b), m = Type == kQ4_1 ? fp16_at(b + 2) : -8.f * d;
    const uint8_t* qs = b + (Type == kQ4_1 ? 4 : 2);
    for (int i = 0; i < 16; i += kLanes) {
      const IV q = bytes_u8(qs + i);
      f(i, affine(q & 0xF, d, m));
      f(i + 16, affine(q >> 4, d, m));
    }
  } else if constexpr (Type == kQ5_0 || Type == kQ5_1) {
    const bool has_min = Type == kQ5_1;
    const float d = fp16_at(b), m = has_min ? fp16_at(b + 2) : -16.f * d;
    const uint8_t* p = b + (has_min ? 4 : 2);
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const uint8_t* qs = p + 4;
    for (int i = 0; i < 16; i += kLanes) {
      const IV q = bytes_u8(qs + i);
      IV lo = q & 0xF, hi = q >> 4;
      for (int l = 0; l < kLanes; ++l) {
        lo[l] |= ((qh >> (i + l)) & 1) << 4;
        hi[l] |= ((qh >> (i + l + 16)) & 1) << 4;
      }
      f(i, affine(lo, d, m));
      f(i + 16, affine(hi, d, m));
    }
  } else if constexpr (Type == kQ8_0) {
    const float d = fp16_at(b);
    for (int i = 0; i < 32; i += kLanes) f(i, to_float(bytes_i8(b + 2 + i)) * d);
  } else if constexpr (Type == kQ4_K || Type == kQ5_K) {
    constexpr bool kFifth = Type == kQ5_K;
    const float d = fp16_at(b), dmin = fp16_at(b + 2);
    const uint8_t* scales = b + 4;
    const uint8_t* qh = b + 16;
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    for (int j = 0; j < 4; ++j) {
      int sc0, m0, sc1, m1;
      scale_min_k4(2 * j, scales, sc0, m0);
      scale_min_k4(2 * j + 1, scales, sc1, m1);
      const float d0 = d * sc0, min0 = -(dmin * m0), d1 = d * sc1, min1 = -(dmin * m1);
      for (int l = 0; l < 32; l += kLanes) {
        const IV q = bytes_u8(qs + 32 * j + l);
        IV lo = q & 0xF, hi = q >> 4;
        if constexpr (kFifth) {
          const IV h = bytes_u8(qh + l);
          lo |= ((h >> (2 * j)) & 1) << 4;
          hi |= ((h >> (2 * j + 1)) & 1) << 4;
        }
        f(64 * j + l, affine(lo, d0, min0));
        f(64 * j + 32 + l, affine(hi, d1, min1));
      }
    }
  } else {  // Q6_K
    const float d = fp16_at(b + 208);
    const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
    for (int half = 0; half < 2; ++half) {
      const uint8_t* ql = b + 64 * half;
      const uint8_t* qh = b + 128 + 32 * half;
      const int8_t* s = sc + 8 * half;
      for (int l = 0; l < 32; l += kLanes) {
        const int is = l / 16;
        const IV low = bytes_u8(ql + l), high = bytes_u8(ql + l + 32), h = bytes_u8(qh + l);
        const IV q1 = ((low & 0xF) | ((h & 3) << 4)) - 32;
        const IV q2 = ((high & 0xF) | (((h >> 2) & 3) << 4)) - 32;
        const IV q3 = ((low >> 4) | (((h >> 4) & 3) << 4)) - 32;
        const IV q4 = ((high >> 4) | ((h >> 6) << 4)) - 32;
        f(128 * half + l, to_float(q1) * (d * s[is]));
        f(128 * half + l + 32, to_float(q2) * (d * s[is + 2]));
        f(128 * half + l + 64, to_float(q3) * (d * s[is + 4]));
        f(128 * half + l + 96, to_float(q4) * (d * s[is + 6]));
      }
    }
  }
}

template <int64_t Type>
constexpr Layout kLayoutOf = kDense<Type> ? Layout{1, sizeof(DenseValue<Type>)} : Type == kQ4_0 ? Layout{32, 18} : Type == kQ4_1 ? Layout{32, 20}
                           : Type == kQ5_0 ? Layout{32, 22} : Type == kQ5_1 ? Layout{32, 24}
                           : Type == kQ8_0 ? Layout{32, 34} : Type == kQ4_K ? Layout{256, 144}
                           : Type == kQ5_K ? Layout{256, 176} : Layout{256, 210};

// Values [k0, k0 + count) of one weight row (k0 and count whole blocks) -> fp32.
template <int64_t Type>
inline void decode_values(const uint8_t* row, int64_t k0, int64_t count, float* y) {
  constexpr Layout kLayout = kLayoutOf<Type>;
  const uint8_t* block = row + k0 / kLayout.values * kLayout.bytes;
  for (int64_t i = 0; i < count; i += kLayout.values, block += kLayout.bytes) {
    float* out = y + i;
    decode_vectors<Type>(block, [out](int j, FV v) { std::memcpy(out + j, &v, sizeof(v)); });
  }
}

// ---------------------------------------------------------------------------------------------- few rows: a walk

struct Problem {
  const uint8_t* w;  // [N, row_bytes]
  int64_t row_bytes, K, N;
  const float* bias;  // [N] or nullptr
  int64_t M;
  int64_t out_stride, out_col;  // out[m * out_stride + out_col + n]
};

template <typename out_t>
inline void store(out_t* out, const Problem& p, int64_t m, int64_t n, float value) {
  out[m * p.out_stride + p.out_col + n] = static_cast<out_t>(value + (p.bias ? p.bias[n] : 0.f));
}

// Calls f(std::integral_constant<int, M>) for the batch's 1 to kMaxWalkRows rows, so the walk's accumulators
// are sized at compile time.
template <typename F>
void with_rows(int64_t M, F&& f) {
  static_assert(kMaxWalkRows == 8, "one case per row count");
  switch (M) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

#if defined(__AVX2__)
// A decode step reads each weight byte for M multiply-adds, so the walk must keep up with memory: as llama.cpp
// does, x is quantized to int8 (one scale per 32 values for the 32-value block types, per 256 for the
// K-quants), each group of 32 weights is unpacked to unsigned bytes in registers and multiplied with x's bytes
// by integer dot products (vpmaddubsw; vpdpbusd with AVX512-VNNI). Every block type is, per 16 values, value = a * u + c with u
// unsigned, so sum(value * x) = a * dot(u, qx) * dx + c * sum(qx) * dx; a K-quant's sub-block scales are
// integers, so a super-block's products add up in int32 and meet fp32 once.
struct QuantizedX {
  std::vector<int8_t> q;       // [M, K]
  std::vector<float> d;        // [M, K / group]
  std::vector<int16_t> sums;   // [M, K / 16] each 16 values' sum of q
  std::vector<float> sums_d;   // [M, K / group] each group's sum of q times its d
};

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline int hsum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 1)));
}

template <typename in_t>
inline __m256 load8(const in_t* x) {
  if constexpr (std::is_same_v<in_t, float>) return _mm256_loadu_ps(x);
  else return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16));
}

inline float hmax(__m256 v) {
  const __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}

// One group of x (a multiple of 16 values): d = amax / 127, q = round(x * 127 / amax) to nearest even, and each
// 16 values' sum of q; their total times d into `sum_d` unless it is null.
template <typename in_t>
inline void quantize_group(const in_t* x, int64_t group, int8_t* q, float* d, int16_t* sums, float* sum_d) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 most = _mm256_setzero_ps();
  for (int64_t i = 0; i < group; i += 8) most = _mm256_max_ps(most, _mm256_and_ps(load8(x + i), magnitude));
  const float amax = hmax(most);
  const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  *d = amax / 127.f;
  int total = 0;
  for (int64_t i = 0; i < group; i += 16) {
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + i), inv));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + i + 8), inv));
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i),
                     _mm_packs_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
    sums[i / 16] = static_cast<int16_t>(hsum(_mm256_add_epi32(lo, hi)));
    total += sums[i / 16];
  }
  if (sum_d != nullptr) *sum_d = *d * static_cast<float>(total);
}

// Walk-sized inputs (a few rows) stay on the calling thread: forking for them costs more than it saves.
constexpr int64_t kQuantizeGrainValues = int64_t{1} << 17;

// `with_sums_d`: the int8 panels and the walk over 32-value blocks read each group's sums_d.
template <typename in_t>
QuantizedX quantize_x(const in_t* x, int64_t M, int64_t K, int64_t group, bool with_sums_d) {
  const int64_t groups = M * K / group;
  QuantizedX qx{std::vector<int8_t>(M * K), std::vector<float>(groups), std::vector<int16_t>(M * K / 16),
                std::vector<float>(with_sums_d ? groups : 0)};
  at::parallel_for(0, groups, kQuantizeGrainValues / group, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      quantize_group(x + g * group, group, qx.q.data() + g * group, qx.d.data() + g, qx.sums.data() + g * group / 16,
                     with_sums_d ? qx.sums_d.data() + g : nullptr);
  });
  return qx;
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibbles -> 32 values: the low nibbles (elements 0-15), then the high ones (16-31).
inline __m256i nibbles(const uint8_t* qs) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

// 0x10 in byte j where bit j of `bits` is set (Q5_0 / Q5_1 fifth bits).
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

// 0x10 in each byte of `bytes` whose bit `shift` is set (Q5_K fifth bits).
inline __m256i bit_as_0x10(__m256i bytes, int shift) {
  const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << shift));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit), _mm256_set1_epi8(0x10));
}

// Eight int32 lanes, lane i the sum of u * s over bytes 4i..4i+3 (u unsigned, s signed).
inline __m256i dot_u8_i8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// acc + eight int32 lanes of u * s summed by pairs of bytes, each pair times its int16 lane of `scale` (one
// instruction for the multiply-add of pairs and the sum where AVX512-VNNI has it).
inline __m256i add_scaled_dot(__m256i acc, __m256i u, __m256i s, __m256i scale) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), scale);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), scale));
#endif
}

template <int64_t Type>
constexpr bool kSuperBlocks = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K;
// Q8_0's values are signed (no offset); the walk multiplies |w| by x with w's sign.
template <int64_t Type>
constexpr bool kSigned = Type == kQ8_0;

// `f(g, u, a0, a1, c0, c1)` gets group g of the block (32 values) as bytes u: value = a0 * u + c0 for the
// first 16, a1 * u + c1 for the last 16 (Q8_0: u the signed values, c zero). The GEMM's decode reads every
// type through it; the walk reads the 32-value types through it.
template <int64_t Type, typename F>
__attribute__((always_inline)) inline void groups_of(const uint8_t* b, F&& f);

// The 12 bytes of a Q4_K / Q5_K super-block's 6-bit scales and mins as 16 bytes: 8 scales, then 8 mins (the low
// six bits of bytes 0-3 and 4-7 are scales and mins 0-3; scales and mins 4-7 take their low four bits from bytes
// 8-11 and their top two from the top bits of bytes 0-3 and 4-7). Worked in two 64-bit words, scales and mins side
// by side, as this sits on the walk's path from a block's bytes to its first product.
inline __m128i scales_mins_k4(const uint8_t* q) {
  uint64_t first;
  uint32_t last;
  std::memcpy(&first, q, 8);
  std::memcpy(&last, q + 8, 4);
  const uint64_t low_bits = last | (static_cast<uint64_t>(last >> 4) << 32);
  const uint64_t high = (low_bits & 0x0f0f0f0f0f0f0f0full) | (((first >> 6) & 0x0303030303030303ull) << 4);
  return _mm_unpacklo_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(first & 0x3f3f3f3f3f3f3f3full)),
                            _mm_cvtsi64_si128(static_cast<int64_t>(high)));
}

// int16 lane `lane` of each 128-bit half of v in all of that half's lanes (one shuffle: v holds what each half
// needs in both).
inline __m256i broadcast_lane(__m256i v, int lane) {
  return _mm256_shuffle_epi8(v, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * lane)));
}

// A Q4_K / Q5_K super-block's head: its two fp16 scales, its mins per 16 values (int16 lanes) and, returned, its
// eight sub-block scales (int16).
inline __m128i k4_head(const uint8_t* b, float& d_scale, float& d_min, __m256i& mins) {
  d_scale = fp16_at(b);
  d_min = fp16_at(b + 2);
  const __m128i packed = scales_mins_k4(b + 4);  // bytes 0-7 the scales, 8-15 the mins
  mins = _mm256_cvtepu8_epi16(_mm_unpackhi_epi8(packed, packed));
  return _mm_cvtepu8_epi16(packed);
}

// A Q6_K super-block's head: d, 32 times its scales as mins per 16 values (the values' offset of -32), and,
// returned, the even scales (each group's first 16 values) in the low half and the odd ones in the high half.
inline __m256i q6k_head(const uint8_t* b, float& d, __m256i& mins) {
  d = fp16_at(b + 208);
  const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
  mins = _mm256_slli_epi16(_mm256_cvtepi8_epi16(scales), 5);
  return _mm256_cvtepi8_epi16(
      _mm_shuffle_epi8(scales, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15)));
}

// One super-block of a K-quant: `f(g, u, scale)` gets group g (32 values) as bytes u and its integer scale per
// pair of values (int16 lanes); then `low(mins, d_scale, d_min)`: the block's value = d_scale * scale * u -
// d_min * min, with its mins per 16 values (int16 lanes, Q6_K: 32 times its scales).
template <int64_t Type, typename F>
__attribute__((always_inline)) inline void super_block(const uint8_t* b, F&& f, float& d_scale, float& d_min, __m256i& mins) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  if constexpr (Type == kQ4_K || Type == kQ5_K) {
    constexpr bool kFifth = Type == kQ5_K;
    const __m256i scales = _mm256_broadcastsi128_si256(k4_head(b, d_scale, d_min, mins));
    const __m256i high = kFifth ? load256(b + 16) : _mm256_setzero_si256();
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = load256(qs + 32 * j);
      __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low4);
      if constexpr (kFifth) {
        lo = _mm256_or_si256(lo, bit_as_0x10(high, 2 * j));
        hi = _mm256_or_si256(hi, bit_as_0x10(high, 2 * j + 1));
      }
      f(2 * j, lo, broadcast_lane(scales, 2 * j));
      f(2 * j + 1, hi, broadcast_lane(scales, 2 * j + 1));
    }
  } else {  // Q6_K: 6-bit values minus 32, a signed scale per 16
    const __m256i scales = q6k_head(b, d_scale, mins);
    d_min = d_scale;
    for (int half = 0; half < 2; ++half) {
      const __m256i lo = load256(b + 64 * half), lo2 = load256(b + 64 * half + 32), h = load256(b + 128 + 32 * half);
      const __m256i q[4] = {
          _mm256_or_si256(_mm256_and_si256(lo, low4), _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x03)), 4)),
          _mm256_or_si256(_mm256_and_si256(lo2, low4), _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x0C)), 2)),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo, 4), low4), _mm256_and_si256(h, _mm256_set1_epi8(0x30))),
          _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo2, 4), low4),
                          _mm256_srli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(static_cast<char>(0xC0))), 2))};
      for (int i = 0; i < 4; ++i) f(4 * half + i, q[i], broadcast_lane(scales, 4 * half + i));
    }
  }
}

template <int64_t Type, typename F>
__attribute__((always_inline)) inline void groups_of(const uint8_t* b, F&& f) {
  if constexpr (Type == kQ4_0) {
    const float d = fp16_at(b);
    f(0, nibbles(b + 2), d, d, -8.f * d, -8.f * d);
  } else if constexpr (Type == kQ4_1) {
    const float d = fp16_at(b), m = fp16_at(b + 2);
    f(0, nibbles(b + 4), d, d, m, m);
  } else if constexpr (Type == kQ5_0 || Type == kQ5_1) {
    constexpr bool kMin = Type == kQ5_1;
    const float d = fp16_at(b), m = kMin ? fp16_at(b + 2) : -16.f * d;
    uint32_t qh;
    std::memcpy(&qh, b + (kMin ? 4 : 2), 4);
    f(0, _mm256_or_si256(nibbles(b + (kMin ? 8 : 6)), fifth_bits(qh)), d, d, m, m);
  } else if constexpr (Type == kQ8_0) {
    const float d = fp16_at(b);
    f(0, load256(b + 2), d, d, 0.f, 0.f);
  } else {
    float d_scale, d_min;
    __m256i mins;
    alignas(32) int16_t scales[8][16];
    __m256i u[8];
    super_block<Type>(b, [&](int g, __m256i bytes, __m256i scale) {
      u[g] = bytes;
      _mm256_store_si256(reinterpret_cast<__m256i*>(scales[g]), scale);
    }, d_scale, d_min, mins);
    alignas(32) int16_t mn[16];
    _mm256_store_si256(reinterpret_cast<__m256i*>(mn), mins);
    for (int g = 0; g < 8; ++g) {
      const float a0 = d_scale * scales[g][0], a1 = d_scale * scales[g][15];
      const float c0 = -d_min * mn[2 * g], c1 = -d_min * mn[2 * g + 1];
      f(g, u[g], a0, a1, c0, c1);
    }
  }
}

// A super-block's integer sum (group `group` of x) into fp32: d_scale * dx * sum - d_min * dx * (mins . x's
// sums per 16), kept in vectors (a horizontal sum per block would be the walk's longest chain).
inline void fold_super_block(const QuantizedX& qx, int64_t group, __m256i sum, __m256i mins, float d_scale,
                             float d_min, __m256& acc) {
  const float dx = qx.d[group];
  const __m256i sums = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx.sums.data() + group * 16));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d_scale * dx), acc);
  acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sums, mins)), _mm256_set1_ps(d_min * dx), acc);
}

// One block of a 32-value type (block b of the row): a float scale per block, so each group's dot product meets
// fp32 right away.
template <int64_t Type, int M>
__attribute__((always_inline)) inline void add_block(const uint8_t* block, int64_t b, const QuantizedX& qx,
                                                     const Problem& p, __m256* acc, float* offset) {
  const int64_t blocks = p.K / 32;
  groups_of<Type>(block, [&](int, __m256i u, float a, float, float c, float) __attribute__((always_inline)) {
    const __m256i w = kSigned<Type> ? _mm256_sign_epi8(u, u) : u;
    for (int m = 0; m < M; ++m) {
      __m256i x = load256(reinterpret_cast<const uint8_t*>(qx.q.data() + m * p.K + b * 32));
      if constexpr (kSigned<Type>) x = _mm256_sign_epi8(x, u);
      const float dx = qx.d[m * blocks + b];
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8_i8(w, x)), _mm256_set1_ps(a * dx), acc[m]);
      if constexpr (!kSigned<Type>) offset[m] += c * qx.sums_d[m * blocks + b];  // c * sum(x)
    }
  });
}

#if defined(__AVX512BW__)
// The walk over K-quants on 512-bit registers: two groups of 32 values at a time, half the instructions of the
// 256-bit form. Q4_K / Q5_K pair groups g and g + 2, whose codes share 64 bytes of nibbles, so the walk's x holds
// each super-block's groups in the order 0, 2, 1, 3, 4, 6, 5, 7 (`kPairedX`); Q6_K pairs g and g + 1.
template <int64_t Type>
constexpr bool kPairedX = Type == kQ4_K || Type == kQ5_K;

// A 512-bit register of a 256-bit value for its low half and another for its high half.
inline __m512i halves(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }

// int16 lane `a` of each 128-bit quarter of v in all the lanes of the low two quarters, lane `b` in the high two.
inline __m512i pick_lanes(__m512i v, int a, int b) {
  return _mm512_shuffle_epi8(v, halves(_mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * a)),
                                       _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * b))));
}

// One super-block of a K-quant as super_block reads it, a pair of groups at a time: `f(k, u, scale)` gets pair k
// (the walk's x bytes [64k, 64k + 64) of the super-block) as bytes u and their integer scales per pair of values.
template <int64_t Type, typename F>
__attribute__((always_inline)) inline void super_block_pairs(const uint8_t* b, F&& f, float& d_scale, float& d_min,
                                                             __m256i& mins) {
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  if constexpr (Type == kQ4_K || Type == kQ5_K) {
    constexpr bool kFifth = Type == kQ5_K;
    const __m512i scales = _mm512_broadcast_i32x4(k4_head(b, d_scale, d_min, mins));
    const __m512i high = kFifth ? _mm512_broadcast_i64x4(load256(b + 16)) : _mm512_setzero_si512();
    const uint8_t* qs = b + (kFifth ? 48 : 16);
    for (int j = 0; j < 2; ++j) {  // groups 4j, 4j + 2 in the low nibbles of 64 bytes, 4j + 1, 4j + 3 in the high
      const __m512i bytes = _mm512_loadu_si512(qs + 64 * j);
      __m512i lo = _mm512_and_si512(bytes, low4), hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low4);
      if constexpr (kFifth) {  // group g's fifth bits are bit g of `high`'s bytes
        const auto bit = [](int g) { return _mm256_set1_epi8(static_cast<char>(1 << g)); };
        const __m512i sixteen = _mm512_set1_epi8(0x10);
        lo = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(high, halves(bit(4 * j), bit(4 * j + 2))), lo, sixteen);
        hi = _mm512_mask_add_epi8(hi, _mm512_test_epi8_mask(high, halves(bit(4 * j + 1), bit(4 * j + 3))), hi, sixteen);
      }
      f(2 * j, lo, pick_lanes(scales, 4 * j, 4 * j + 2));
      f(2 * j + 1, hi, pick_lanes(scales, 4 * j + 1, 4 * j + 3));
    }
  } else {  // Q6_K: 6-bit values minus 32, a signed scale per 16
    const __m512i scales = _mm512_broadcast_i64x4(q6k_head(b, d_scale, mins));  // even, odd, even, odd
    d_min = d_scale;
    const auto per_half = [](int low, int high) { return halves(_mm256_set1_epi8(static_cast<char>(low)),
                                                                _mm256_set1_epi8(static_cast<char>(high))); };
    const auto words = [](int16_t low, int16_t high) { return halves(_mm256_set1_epi16(low), _mm256_set1_epi16(high)); };
    for (int half = 0; half < 2; ++half) {  // 128 values: groups 4h, 4h + 1 (low nibbles), 4h + 2, 4h + 3 (high)
      const __m512i ql = _mm512_loadu_si512(b + 64 * half);
      const __m512i qh = _mm512_broadcast_i64x4(load256(b + 128 + 32 * half));
      const __m512i first = _mm512_or_si512(_mm512_and_si512(ql, low4),
                                            _mm512_sllv_epi16(_mm512_and_si512(qh, per_half(0x03, 0x0C)), words(4, 2)));
      const __m512i second = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4),
                                             _mm512_srlv_epi16(_mm512_and_si512(qh, per_half(0x30, 0xC0)), words(0, 2)));
      f(2 * half, first, pick_lanes(scales, 4 * half, 4 * half + 1));
      f(2 * half + 1, second, pick_lanes(scales, 4 * half + 2, 4 * half + 3));
    }
  }
}

// x's groups of each super-block in the order super_block_pairs reads Q4_K / Q5_K (swaps groups 1, 2 and 5, 6).
inline void pair_groups(int8_t* q, int64_t values) {
  for (int64_t i = 0; i < values; i += 256)
    for (int64_t g : {1, 5}) std::swap_ranges(q + i + 32 * g, q + i + 32 * (g + 1), q + i + 32 * (g + 1));
}

template <int64_t Type, int M>
__attribute__((always_inline)) inline void add_super_block(const uint8_t* block, int64_t b, const QuantizedX& qx,
                                                           const Problem& p, __m256* acc) {
  const int64_t blocks = p.K / 256;
  __m512i isum[2][M];  // two chains of sums, so a super-block's products do not wait on each other
  for (int m = 0; m < M; ++m) isum[0][m] = isum[1][m] = _mm512_setzero_si512();
  float d_scale, d_min;
  __m256i mins;
  super_block_pairs<Type>(block, [&](int k, __m512i u, __m512i scale) __attribute__((always_inline)) {
    for (int m = 0; m < M; ++m) {
      const __m512i x = _mm512_loadu_si512(qx.q.data() + m * p.K + b * 256 + k * 64);
      __m512i& sum = isum[k & 1][m];
#if defined(__AVX512VNNI__)
      sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(u, x), scale);
#else
      sum = _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), scale));
#endif
    }
  }, d_scale, d_min, mins);
  for (int m = 0; m < M; ++m) {
    const __m512i both = _mm512_add_epi32(isum[0][m], isum[1][m]);
    const __m256i sum = _mm256_add_epi32(_mm512_castsi512_si256(both), _mm512_extracti64x4_epi64(both, 1));
    fold_super_block(qx, m * blocks + b, sum, mins, d_scale, d_min, acc[m]);
  }
}
#else
template <int64_t Type>
constexpr bool kPairedX = false;
inline void pair_groups(int8_t*, int64_t) {}

// One K-quant super-block (block b of the row): integer sums of u * x * scale, and of the mins times x's sums
// per 16, meeting fp32 once.
template <int64_t Type, int M>
__attribute__((always_inline)) inline void add_super_block(const uint8_t* block, int64_t b, const QuantizedX& qx,
                                                           const Problem& p, __m256* acc) {
  const int64_t blocks = p.K / 256;
  __m256i isum[M];
  for (int m = 0; m < M; ++m) isum[m] = _mm256_setzero_si256();
  float d_scale, d_min;
  __m256i mins;
  super_block<Type>(block, [&](int g, __m256i u, __m256i scale) __attribute__((always_inline)) {
    for (int m = 0; m < M; ++m) {
      const __m256i x = load256(reinterpret_cast<const uint8_t*>(qx.q.data() + m * p.K + b * 256 + g * 32));
      isum[m] = add_scaled_dot(isum[m], u, x, scale);
    }
  }, d_scale, d_min, mins);
  for (int m = 0; m < M; ++m) fold_super_block(qx, m * blocks + b, isum[m], mins, d_scale, d_min, acc[m]);
}
#endif

template <int64_t Type, int M, typename out_t>
void walk_rows(const QuantizedX& qx, const Problem& p, int64_t n0, int64_t n1, out_t* out) {
  constexpr Layout kLayout = kLayoutOf<Type>;
  const int64_t blocks = p.K / kLayout.values;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* block = p.w + n * p.row_bytes;
    __m256 acc[M];
    float offset[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), offset[m] = 0.f;
    for (int64_t b = 0; b < blocks; ++b, block += kLayout.bytes) {
      simd::prefetch_ahead(block, kLayout.bytes);
      if constexpr (kSuperBlocks<Type>) add_super_block<Type, M>(block, b, qx, p, acc);
      else add_block<Type, M>(block, b, qx, p, acc, offset);
    }
    for (int m = 0; m < M; ++m) store(out, p, m, n, hsum(acc[m]) + offset[m]);
  }
}

template <int64_t Type, typename in_t, typename out_t>
void walk(const in_t* x, const Problem& p, out_t* out) {
  QuantizedX qx = quantize_x(x, p.M, p.K, kSuperBlocks<Type> ? 256 : 32, !kSuperBlocks<Type>);
  if constexpr (kPairedX<Type>) pair_groups(qx.q.data(), p.M * p.K);
  at::parallel_for(0, p.N, 16, [&](int64_t n0, int64_t n1) {
    with_rows(p.M, [&](auto rows) { walk_rows<Type, decltype(rows)::value>(qx, p, n0, n1, out); });
  });
}
#else
// Without AVX2: each block decoded to fp32, a chunk at a time, and multiplied in fp32.
template <int64_t Type, int M, typename in_t, typename out_t>
void walk_rows(const in_t* x, const Problem& p, int64_t n0, int64_t n1, out_t* out) {
  float y[kChunk];
  for (int64_t n = n0; n < n1; ++n) {
    float sums[M] = {};
    for (int64_t k = 0; k < p.K; k += kChunk) {
      const int64_t count = std::min(kChunk, p.K - k);
      decode_values<Type>(p.w + n * p.row_bytes, k, count, y);
      for (int m = 0; m < M; ++m)
        for (int64_t i = 0; i < count; ++i) sums[m] += y[i] * static_cast<float>(x[m * p.K + k + i]);
    }
    for (int m = 0; m < M; ++m) store(out, p, m, n, sums[m]);
  }
}

template <int64_t Type, typename in_t, typename out_t>
void walk(const in_t* x, const Problem& p, out_t* out) {
  at::parallel_for(0, p.N, 16, [&](int64_t n0, int64_t n1) {
    with_rows(p.M, [&](auto rows) { walk_rows<Type, decltype(rows)::value>(x, p, n0, n1, out); });
  });
}
#endif

// ---------------------------------------------------------------------------------------------- many rows: GEMM

// Batched decode and prefill: the weight's rows are decoded into x's dtype a slice at a time (a few MiB, so the
// slice is still in the last-level cache when it is read), by all threads, and each slice is multiplied by
// torch's matmul (oneDNN / BLAS, itself parallel), so prefill runs at the GEMM library's speed and no
// dequantized copy of the whole weight exists. The decode is paid on every call, against M multiply-adds per
// weight: small for prefill, half the time at M = 32. The slice's buffer is kept for the next call (one per
// calling thread).
#if defined(__AVX2__)
// bf16 of 8 floats, rounded to nearest even as torch rounds (no NaNs among decoded weights).
inline __m256i to_bf16_bits(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
}

// 16 values a * u + c from 16 bytes u, stored in the GEMM's dtype.
template <bool Signed, typename out_t>
inline void decode16(__m128i bytes, float a, float c, out_t* y) {
#if defined(__AVX512F__)
  const __m512i q = Signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  const __m512 v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), _mm512_set1_ps(a), _mm512_set1_ps(c));
  if constexpr (std::is_same_v<out_t, float>) {
    _mm512_storeu_ps(y, v);
  } else {
#if defined(__AVX512BF16__)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
#else
    const __m256i lo = to_bf16_bits(_mm512_castps512_ps256(v));
    const __m256i hi = to_bf16_bits(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8));
#endif
  }
#else
  __m256 v[2];
  for (int half = 0; half < 2; ++half, bytes = _mm_srli_si128(bytes, 8)) {
    const __m256i q = Signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    v[half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(a), _mm256_set1_ps(c));
  }
  if constexpr (std::is_same_v<out_t, float>) {
    _mm256_storeu_ps(y, v[0]);
    _mm256_storeu_ps(y + 8, v[1]);
  } else {
    const __m256i packed = _mm256_packus_epi32(to_bf16_bits(v[0]), to_bf16_bits(v[1]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), _mm256_permute4x64_epi64(packed, 0xD8));
  }
#endif
}

// A K-quant super-block's value = a * u + c for each 16 of its values, the 16 pairs computed together (the
// walk's groups_of works them out a group at a time, from integer lanes, which made the decode twice as slow).
template <int64_t Type>
__attribute__((always_inline)) inline void super_block_affine(const uint8_t* b, float* a, float* c) {
  alignas(32) float v[16];
  if constexpr (Type == kQ6_K) {  // d * scale * (u - 32), a signed scale per 16
    const float d = fp16_at(b + 208);
    const __m128i scales = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
    for (int h = 0; h < 2; ++h) {
      const __m256 s = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(scales, 8) : scales)),
                                     _mm256_set1_ps(d));
      _mm256_store_ps(a + 8 * h, s);
      _mm256_store_ps(c + 8 * h, _mm256_mul_ps(s, _mm256_set1_ps(-32.f)));
    }
  } else {  // d * scale * u - dmin * min, a scale and a min per 32
    const __m128i packed = scales_mins_k4(b + 4);  // bytes 0-7 the scales, 8-15 the mins
    _mm256_store_ps(v, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)), _mm256_set1_ps(fp16_at(b))));
    _mm256_store_ps(v + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8))),
                                         _mm256_set1_ps(-fp16_at(b + 2))));
    for (int g = 0; g < 8; ++g) a[2 * g] = a[2 * g + 1] = v[g], c[2 * g] = c[2 * g + 1] = v[8 + g];
  }
}

#if defined(__AVX512BF16__)
// The first `count` (at most 16) of 16 lanes.
inline __mmask16 mask16(int64_t count) {
  return count >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << count) - 1);
}

// out[m, n + j] = v[j] (+ bias) for j < count (at most 16), rounded as store() rounds.
template <typename out_t>
inline void store16(out_t* out, const Problem& p, int64_t m, int64_t n, __m512 v, int64_t count) {
  const __mmask16 mask = mask16(count);
  if (p.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, p.bias + n));
  out_t* dst = out + m * p.out_stride + p.out_col + n;
  if constexpr (std::is_same_v<out_t, float>) _mm512_mask_storeu_ps(dst, mask, v);
  else _mm256_mask_storeu_epi16(dst, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// Lane i holds i * stride (gather offsets of 16 rows `stride` apart).
inline __m512i lane_offsets(int64_t stride) {
  return _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                            _mm512_set1_epi32(static_cast<int>(stride)));
}

// Blocks of 32 codes of at most 5 bits under one scale and offset (Q4_0, Q4_1, Q5_0, Q5_1): decoded into bf16 by
// a lookup (vpermw) in a table of the block's 32 possible values, each computed and rounded as decode16 does,
// in a third of decode16's instructions.
template <int64_t Type>
constexpr bool kLookupDecode = Type == kQ4_0 || Type == kQ4_1 || Type == kQ5_0 || Type == kQ5_1;
// Q4_K and Q5_K: codes of at most 5 bits under a scale and offset per 32 values, decoded by the same lookup.
template <int64_t Type>
constexpr bool kLookupSuperBlocks = Type == kQ4_K || Type == kQ5_K;

inline void decode_by_lookup(__m256i codes, float a, float c, at::BFloat16* y) {
  const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 high = _mm512_add_ps(low, _mm512_set1_ps(16.f));
  const __m512 scale = _mm512_set1_ps(a), offset = _mm512_set1_ps(c);
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmadd_ps(high, scale, offset),
                                                       _mm512_fmadd_ps(low, scale, offset));
  _mm512_storeu_si512(y, _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(codes), table));
}

// One block of each of `rows` (at most 16) weight rows, `row_bytes` apart, into y[row][0, 32): the tile path's
// decode, decode_by_lookup's values bit for bit in fewer shuffles (the port that bounds it). The rows' scales
// are gathered and widened 16 at a time and each row's read back as a broadcast from memory; Q4 codes index a
// table repeated in both halves, so their words need no mask.
template <int64_t Type>
inline void decode_rows_by_lookup(const uint8_t* block, int64_t row_bytes, int64_t rows, at::BFloat16 (*y)[32]) {
  constexpr bool kFive = Type == kQ5_0 || Type == kQ5_1, kMin = Type == kQ4_1 || Type == kQ5_1;
  // Each row's first dword: its fp16 d in the low half (and Q4_1 / Q5_1's m in the high one).
  const __m512i words = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), mask16(rows), lane_offsets(row_bytes),
                                                    block, 1);
  alignas(64) float a[16], c[16];
  const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
  _mm512_store_ps(a, d);
  if constexpr (kMin) _mm512_store_ps(c, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16))));
  else _mm512_store_ps(c, _mm512_mul_ps(d, _mm512_set1_ps(kFive ? -16.f : -8.f)));
  asm volatile("" ::: "memory");  // rows read a and c back as broadcasts from memory, not lane shuffles
  const __m512 low = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i nibble_shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* b = block + r * row_bytes;
    const __m512 scale = _mm512_set1_ps(a[r]), offset = _mm512_set1_ps(c[r]);
    const __m512 values = _mm512_fmadd_ps(low, scale, offset);
    if constexpr (kFive) {
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(
          _mm512_fmadd_ps(_mm512_add_ps(low, _mm512_set1_ps(16.f)), scale, offset), values);
      groups_of<Type>(b, [&](int, __m256i u, float, float, float, float) __attribute__((always_inline)) {
        _mm512_storeu_si512(y[r], _mm512_permutexvar_epi16(_mm512_cvtepu8_epi16(u), table));
      });
    } else {
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(values, values);
      // The 16 code bytes in both halves, as words: the high halves' shifted down to their high nibbles.
      const __m256i twice = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + (kMin ? 4 : 2))));
      const __m512i codes = _mm512_srlv_epi16(_mm512_cvtepu8_epi16(twice), nibble_shifts);
      _mm512_storeu_si512(y[r], _mm512_permutexvar_epi16(codes, table));
    }
  }
}
#endif

// One block decoded into the GEMM's dtype: y[0, values of the block).
template <int64_t Type, typename out_t>
__attribute__((always_inline)) inline void decode_block(const uint8_t* block, out_t* y) {
  if constexpr (kSuperBlocks<Type>) {
    alignas(32) float a[16], c[16];
    super_block_affine<Type>(block, a, c);
    float d_scale, d_min;  // the walk's integer form, unused here
    __m256i mins;
    super_block<Type>(block, [&](int g, __m256i u, __m256i) __attribute__((always_inline)) {
#if defined(__AVX512BF16__)
      if constexpr (kLookupSuperBlocks<Type> && std::is_same_v<out_t, at::BFloat16>)
        return decode_by_lookup(u, a[2 * g], c[2 * g], y + 32 * g);  // one scale and offset per 32 values
#endif
      decode16<false>(_mm256_castsi256_si128(u), a[2 * g], c[2 * g], y + 32 * g);
      decode16<false>(_mm256_extracti128_si256(u, 1), a[2 * g + 1], c[2 * g + 1], y + 32 * g + 16);
    }, d_scale, d_min, mins);
  } else {
    groups_of<Type>(block, [&](int g, __m256i u, float a0, float a1, float c0, float c1) __attribute__((always_inline)) {
#if defined(__AVX512BF16__)
      if constexpr (kLookupDecode<Type> && std::is_same_v<out_t, at::BFloat16>)
        return decode_by_lookup(u, a0, c0, y + 32 * g);  // g is 0: one group of 32 a block
#endif
      decode16<kSigned<Type>>(_mm256_castsi256_si128(u), a0, c0, y + 32 * g);
      decode16<kSigned<Type>>(_mm256_extracti128_si256(u, 1), a1, c1, y + 32 * g + 16);
    });
  }
}

// One weight row of blocks decoded into the GEMM's dtype.
template <int64_t Type, typename out_t>
void decode_blocks_row(const uint8_t* row, int64_t K, out_t* y) {
  constexpr Layout kLayout = kLayoutOf<Type>;
  for (int64_t k = 0; k < K; k += kLayout.values, row += kLayout.bytes) decode_block<Type>(row, y + k);
}
#else
template <int64_t Type, typename out_t>
void decode_blocks_row(const uint8_t* row, int64_t K, out_t* y) {
  float values[kChunk];
  for (int64_t k = 0; k < K; k += kChunk) {
    const int64_t count = std::min(kChunk, K - k);
    decode_values<Type>(row, k, count, values);
    for (int64_t i = 0; i < count; ++i) y[k + i] = static_cast<out_t>(values[i]);
  }
}
#endif

// n plain values converted to the GEMM's dtype (bf16 -> fp32 is exact; into bf16, rounded to nearest even).
template <typename value_t, typename out_t>
void convert_values(const value_t* v, int64_t n, out_t* y) {
  int64_t i = 0;
  if constexpr (std::is_same_v<value_t, out_t>) {
    std::memcpy(y, v, n * sizeof(out_t));
    return;
  }
#if defined(KVSERVE_SIMD)
  if constexpr (std::is_same_v<out_t, float>)
    for (; i + Simd::kLanes <= n; i += Simd::kLanes) Simd::store(y + i, Simd::load(v + i));
#endif
  for (; i < n; ++i) y[i] = static_cast<out_t>(static_cast<float>(v[i]));
}

// One weight row decoded into the GEMM's dtype, whatever its encoding.
template <int64_t Type, typename out_t>
void decode_row(const uint8_t* row, int64_t K, out_t* y) {
  if constexpr (kDense<Type>) convert_values(reinterpret_cast<const DenseValue<Type>*>(row), K, y);
  else decode_blocks_row<Type>(row, K, y);
}

constexpr int64_t kSliceBytes = 8 << 20;
constexpr int64_t kSliceMinRows = 256;  // fewer output columns would leave the matmul below its speed

template <int64_t Type>
void gemm_slices(const at::Tensor& x, const Problem& p, const at::Tensor& out) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t rows = std::min(std::max(kSliceMinRows, kSliceBytes / (p.K * x.element_size()) / 16 * 16), p.N);
  thread_local at::Tensor buffer;
  if (!buffer.defined() || buffer.scalar_type() != x.scalar_type() || buffer.numel() < rows * p.K)
    buffer = at::empty({rows * p.K}, x.options());
  const at::Tensor bias = p.bias ? at::from_blob(const_cast<float*>(p.bias), {p.N}) : at::Tensor();
  for (int64_t n0 = 0; n0 < p.N; n0 += rows) {
    const int64_t count = std::min(rows, p.N - n0);
    const at::Tensor w = buffer.narrow(0, 0, count * p.K).view({count, p.K});
    at::parallel_for(0, count, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        const uint8_t* row = p.w + (n0 + r) * p.row_bytes;
        if (bf16) decode_row<Type>(row, p.K, w.data_ptr<at::BFloat16>() + r * p.K);
        else decode_row<Type>(row, p.K, w.data_ptr<float>() + r * p.K);
      }
    });
    at::Tensor part = at::mm(x, w.t());
    if (bias.defined()) part.add_(bias.narrow(0, n0, count));
    out.narrow(1, p.out_col + n0, count).copy_(part);
  }
}

// ---------------------------------------------------------------------------------------------- int8 panels
#if defined(__AVX2__)
// More than 8 rows (a batched decode step, prefill; over the 32-value types with bf16 dot products, from 5: see
// kFewestPanelRows) over weights in blocks, wherever AMX does not take them: the
// slices' matmul is bound by the FMA units (fp32, or bf16 dot products at half the integer rate) and pays for
// writing the decoded weights out. For the K-quants: x is quantized to int8 with one scale dx per 32 values
// (the walk's rounding; per 256, as llama.cpp rounds for K-quants, cost perplexity where activations have
// outliers: RESULTS.md, section 27), and the products are taken by vpmaddubsw (32 multiply-adds a cycle where
// fp32 FMAs take 16). Weight rows are decoded once per call, 8 at a time, into panels whose lanes are weight
// rows: quad q (4 codes) of each of the 8 rows side by side in 32 bytes, so one broadcast of 4 of x's bytes
// multiplies 8 rows and each int32 lane sums one output (no horizontal sums). A row's value is
// d * scale * u - dmin * min per 16 values (Q6_K: u its 6-bit code, min 32 * scale, dmin = d), so per 32 values
// j of a super-block
//   out[m, n] += d * dx_j * sum_j(scale * u * qx) - dmin * min_j * dx_j * sum_j(qx),
// the first sum exact in int32, meeting x's scale per 32 values and d once per super-block. A thread decodes a
// group of panels that stays in L2, then takes x 8 rows at a time across the whole group.
constexpr int64_t kInt8PanelRows = 8;                  // lanes of int32 in a register
constexpr int kInt8TileRows = kMaxWalkRows;             // rows of x per pass over a panel (with_rows)

struct alignas(32) Int8Block {  // one super-block of a panel's 8 rows
  static constexpr int64_t kValues = 256, kRows = kInt8PanelRows;
  uint8_t codes[64][kInt8PanelRows][4];   // [quad of values][row][4 codes]
  int16_t scales[16][kInt8PanelRows][2];  // [16 values][row][its scale, twice]
  int16_t mins[8][kInt8PanelRows][2];     // Q6_K: [32 values][row][its two 16s' mins]
  float neg_mins[8][kInt8PanelRows];      // Q4_K, Q5_K: [32 values][row] -dmin * min
  float d[kInt8PanelRows];
};

// Decoded panels a thread keeps at a time: half of its L2 (x's rows take the other half).
inline int64_t half_l2_bytes() {
  static const int64_t bytes = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<int64_t>(l2) / 2 : int64_t{256} << 10;
  }();
  return bytes;
}

// The registers of the 32-value types' panels: 16 weight rows with AVX-512 (so each broadcast of x's bytes and
// each step of the fold serve twice the rows they serve in an AVX2 register), 8 with AVX2.
#if defined(__AVX512F__)
struct PanelLanes {
  using I = __m512i;
  using F = __m512;
  static constexpr int64_t kRows = 16;
  static I load(const void* p) { return _mm512_load_si512(p); }
  static I quad(int32_t q) { return _mm512_set1_epi32(q); }
  static I zero() { return _mm512_setzero_si512(); }
  static F load_ps(const float* p) { return _mm512_load_ps(p); }
  static F set1_ps(float v) { return _mm512_set1_ps(v); }
  static F zero_ps() { return _mm512_setzero_ps(); }
  static F to_float(I v) { return _mm512_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static I add_quad_products(I sum, I u, I x4) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(sum, u, x4);
#else
    return _mm512_add_epi32(sum, _mm512_madd_epi16(_mm512_maddubs_epi16(u, x4), _mm512_set1_epi16(1)));
#endif
  }
  // The same with x's quad read from memory as the product's broadcast operand (compilers emit a separate
  // broadcast for the intrinsic: one more instruction per product).
  static I add_quad_products(I sum, I u, const int32_t* x) {
#if defined(__AVX512VNNI__)
    asm("vpdpbusd %[x]%{1to16%}, %[u], %[sum]" : [sum] "+v"(sum) : [u] "v"(u), [x] "m"(*x));
    return sum;
#else
    return add_quad_products(sum, u, quad(*x));
#endif
  }
};
#else
struct PanelLanes {
  using I = __m256i;
  using F = __m256;
  static constexpr int64_t kRows = 8;
  static I load(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }
  static I quad(int32_t q) { return _mm256_set1_epi32(q); }
  static I zero() { return _mm256_setzero_si256(); }
  static F load_ps(const float* p) { return _mm256_load_ps(p); }
  static F set1_ps(float v) { return _mm256_set1_ps(v); }
  static F zero_ps() { return _mm256_setzero_ps(); }
  static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static I add_quad_products(I sum, I u, I x4) {
    return _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x4), _mm256_set1_epi16(1)));
  }
  static I add_quad_products(I sum, I u, const int32_t* x) { return add_quad_products(sum, u, quad(*x)); }
};
#endif

// out[m, n + j] = v[j] (+ bias) for a panel's lanes j < count, rounded as store() rounds: a vector store per row
// of x (stored a value at a time, the results cost the panels more than their fold).
template <typename out_t>
inline void store_lanes(out_t* out, const Problem& p, int64_t m, int64_t n, __m256 v, int64_t count) {
  if (count < 8) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, v);
    for (int64_t l = 0; l < count; ++l) store(out, p, m, n + l, lanes[l]);
    return;
  }
  if (p.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(p.bias + n));
  out_t* dst = out + m * p.out_stride + p.out_col + n;
  if constexpr (std::is_same_v<out_t, float>) {
    _mm256_storeu_ps(dst, v);
  } else {
    const __m256i bits = to_bf16_bits(v);
    const __m256i words = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), _mm256_castsi256_si128(words));
  }
}

#if defined(__AVX512F__)
template <typename out_t>
inline void store_lanes(out_t* out, const Problem& p, int64_t m, int64_t n, __m512 v, int64_t count) {
#if defined(__AVX512BF16__)
  store16(out, p, m, n, v, count);
#else
  store_lanes(out, p, m, n, _mm512_castps512_ps256(v), std::min<int64_t>(count, 8));
  if (count > 8)
    store_lanes(out, p, m, n + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), count - 8);
#endif
}
#endif

// The 32-value block types take panels of their own, one block of 32 values at a time: each row's value is
// d * u + c (u unsigned: Q8_0's codes shifted by 128, c = -128 d), so per block
//   out[m, n] += d * dx * sum(u * qx) + c * dx * sum(qx),
// the first sum exact in int32 (vpdpbusd where there is VNNI). Q8_0 needs VNNI: vpmaddubsw's int16 pairs of
// 255 * 127 would saturate. Their panels are as wide as a register's int32 lanes (PanelLanes).
struct alignas(64) Int8Block32 {  // one block of 32 values of a panel's rows
  static constexpr int64_t kValues = 32, kRows = PanelLanes::kRows;
  uint8_t codes[8][PanelLanes::kRows][4];  // [quad of values][row][4 codes]
  float d[PanelLanes::kRows];
  float c[PanelLanes::kRows];
};

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kHasVnni = true;
#else
constexpr bool kHasVnni = false;
#endif

template <int64_t Type>
constexpr bool kInt8Panels = Type == kQ4_K || Type == kQ5_K || Type == kQ6_K || Type == kQ4_0 || Type == kQ4_1 ||
                             Type == kQ5_0 || Type == kQ5_1 || (Type == kQ8_0 && kHasVnni);
// Q4_K and Q5_K also read as blocks of 32 values: sub-block j of a super-block is (d * scale_j) * u - dmin * min_j,
// a 32-value block's d * u + c (d * scale_j exact in fp32). They take those panels over bf16 x (see
// uses_int8_panels), the super-block panels over fp32 x.
template <int64_t Type>
constexpr bool kReadsAsBlocks32 = !kSuperBlocks<Type> || Type == kQ4_K || Type == kQ5_K;
// Quads of products summed in int16 before meeting the scale: each vpmaddubsw lane is at most 2 * 127 * the
// largest code (15, 31, 63), so eight sums fit in int16 for Q4_K (whose scale covers 32 values), four for Q5_K
// and two for Q6_K.
template <int64_t Type>
constexpr int kQuadsInt16 = Type == kQ4_K ? 8 : Type == kQ5_K ? 4 : 2;

// 8 vectors of 8 int32 lanes transposed in registers: v[i] lane r <- v[r] lane i.
inline void transpose_8x8_epi32(__m256i v[8]) {
  __m256i t[8], q[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(v[i], v[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(v[i], v[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    q[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    q[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    q[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    q[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_permute2x128_si256(q[i], q[i + 4], 0x20);
    v[i + 4] = _mm256_permute2x128_si256(q[i], q[i + 4], 0x31);
  }
}

// Weight rows [n0, n0 + kRows) as a panel: panel[b] their values [32 b, 32 b + 32) (rows past N: zeros). Each
// row's 32 codes are its 8 quads: the panel's quad i is lane i of every row, so each 8 rows' codes transpose as
// 8 x 8 int32. A K-quant's super-block gives 8 blocks of 32. The next panel's rows (one stretch of memory) are
// asked for a slice per block meanwhile: read row by row, each row's first block waited on memory.
template <int64_t Type>
void decode_int8_panel(const Problem& p, int64_t n0, Int8Block32* panel) {
  constexpr int kGroups = kLayoutOf<Type>.values / 32;
  const int64_t rows = std::min(PanelLanes::kRows, p.N - n0), blocks = p.K / kLayoutOf<Type>.values;
  const int64_t next = std::min(n0 + PanelLanes::kRows, p.N);
  const int64_t next_bytes = (std::min(next + PanelLanes::kRows, p.N) - next) * p.row_bytes;
  for (int64_t b = 0; b < blocks; ++b) {
    simd::prefetch_slice(p.w + next * p.row_bytes, next_bytes, b, blocks);
    Int8Block32* out = panel + kGroups * b;
    for (int64_t r0 = 0; r0 < PanelLanes::kRows; r0 += 8) {
      __m256i u[kGroups][8];
      for (int64_t r = r0; r < r0 + 8; ++r) {
        if (r >= rows) {
          for (int g = 0; g < kGroups; ++g) u[g][r - r0] = _mm256_setzero_si256(), out[g].d[r] = out[g].c[r] = 0.f;
          continue;
        }
        const uint8_t* block = p.w + (n0 + r) * p.row_bytes + b * kLayoutOf<Type>.bytes;
        groups_of<Type>(block, [&](int g, __m256i codes, float d, float, float c, float) __attribute__((always_inline)) {
          if constexpr (kSigned<Type>) codes = _mm256_xor_si256(codes, _mm256_set1_epi8(static_cast<char>(0x80))), c = -128.f * d;
          u[g][r - r0] = codes, out[g].d[r] = d, out[g].c[r] = c;
        });
      }
      for (int g = 0; g < kGroups; ++g) {
        transpose_8x8_epi32(u[g]);
        for (int i = 0; i < 8; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out[g].codes[i][r0]), u[g][i]);
      }
    }
  }
}

template <int64_t Type>
void decode_int8_panel(const Problem& p, int64_t n0, Int8Block* panel) {
  if (n0 + kInt8PanelRows > p.N) std::memset(static_cast<void*>(panel), 0, p.K / 256 * sizeof(Int8Block));
  for (int64_t r = 0; r < std::min(kInt8PanelRows, p.N - n0); ++r) {
    const uint8_t* block = p.w + (n0 + r) * p.row_bytes;
    for (int64_t b = 0; b < p.K / 256; ++b, block += kLayoutOf<Type>.bytes) {
      simd::prefetch_ahead(block, kLayoutOf<Type>.bytes);
      Int8Block& out = panel[b];
      alignas(32) uint32_t quads[8];
      alignas(32) int16_t lanes[16];
      float d_scale, d_min;
      __m256i mins;
      super_block<Type>(block, [&](int g, __m256i u, __m256i scale) __attribute__((always_inline)) {
        _mm256_store_si256(reinterpret_cast<__m256i*>(quads), u);
        for (int i = 0; i < 8; ++i) std::memcpy(out.codes[8 * g + i][r], &quads[i], 4);
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), scale);  // lanes 0-7: the first 16 values' scale
        for (int h = 0; h < 2; ++h) out.scales[2 * g + h][r][0] = out.scales[2 * g + h][r][1] = lanes[8 * h];
      }, d_scale, d_min, mins);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), mins);
      for (int j = 0; j < 8; ++j) {
        out.mins[j][r][0] = lanes[2 * j], out.mins[j][r][1] = lanes[2 * j + 1];
        out.neg_mins[j][r] = -d_min * lanes[2 * j];
      }
      out.d[r] = d_scale;
    }
  }
}

inline __m256i load_block(const void* p) { return _mm256_load_si256(static_cast<const __m256i*>(p)); }

inline __m256i broadcast_quad(const void* p) {
  int32_t quad;
  std::memcpy(&quad, p, 4);
  return _mm256_set1_epi32(quad);
}

// x's rows as the panels of 32-value blocks take them: each tile of up to kInt8TileRows rows (r of them) block by
// block, as [8 quads][r] codes and [d | sums_d][r] scales, so every product takes its quad of x as a broadcast
// operand at a fixed offset from one pointer (rows read where quantize_x would leave them held a register each
// for their pointers, more than a core has beside the sums). Quantized straight into that layout, tiles shared
// among the threads: the calling thread alone took a tenth of a prefill's matmuls laying out a copy.
struct PanelX {
  int64_t blocks;
  std::unique_ptr<int32_t[]> quads;  // the tile at row m0 from quads[m0 * blocks * 8]; every slot written
  std::unique_ptr<float[]> scales;   // and from scales[m0 * blocks * 2]

  template <typename in_t>
  PanelX(const in_t* x, int64_t M, int64_t K)
      : blocks(K / 32), quads(new int32_t[M * K / 4]), scales(new float[M * K / 16]) {
    const int64_t tiles = (M + kInt8TileRows - 1) / kInt8TileRows;
    const int64_t grain = std::max<int64_t>(1, kQuantizeGrainValues / (kInt8TileRows * K));
    at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t m0 = t0 * kInt8TileRows; m0 < std::min(M, t1 * kInt8TileRows); m0 += kInt8TileRows) {
        const int64_t r = std::min<int64_t>(kInt8TileRows, M - m0);
        int32_t* q = quads.get() + m0 * blocks * 8;
        float* s = scales.get() + m0 * blocks * 2;
        for (int64_t b = 0; b < blocks; ++b, q += 8 * r, s += 2 * r)
          for (int64_t m = 0; m < r; ++m) {
            alignas(32) int32_t block[8];
            int16_t unused_sums[2];
            quantize_group(x + (m0 + m) * K + 32 * b, 32, reinterpret_cast<int8_t*>(block), s + m, unused_sums,
                           s + r + m);
            for (int i = 0; i < 8; ++i) q[i * r + m] = block[i];
          }
      }
    });
  }
};

// out[m0 + i, n0 + l] for i < MR, l < kRows over a panel of 32-value blocks: per block its 8 quads stay in
// registers while each row of x takes them.
template <int64_t Type, int MR, typename out_t>
__attribute__((noinline)) void int8_panel_rows(const Problem& p, const PanelX& x, int64_t m0,
                                              const Int8Block32* panel, int64_t n0, out_t* out) {
  using V = PanelLanes;
  const int32_t* xq = x.quads.get() + m0 * x.blocks * 8;
  const float* xs = x.scales.get() + m0 * x.blocks * 2;
  V::F acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = V::zero_ps();
  for (int64_t b = 0; b < x.blocks; ++b, xq += 8 * MR, xs += 2 * MR) {
    const Int8Block32& w = panel[b];
    // Quad-major, so each row of x has its own chain of sums (one chain would wait on vpdpbusd's latency).
    V::I sum[MR];
    for (int m = 0; m < MR; ++m) sum[m] = V::zero();
    for (int i = 0; i < 8; ++i) {
      const V::I u = V::load(w.codes[i]);
      for (int m = 0; m < MR; ++m) sum[m] = V::add_quad_products(sum[m], u, xq + i * MR + m);
    }
    const V::F d = V::load_ps(w.d), c = V::load_ps(w.c);
    for (int m = 0; m < MR; ++m) {
      acc[m] = V::fmadd(V::to_float(sum[m]), V::mul(d, V::set1_ps(xs[m])), acc[m]);
      acc[m] = V::fmadd(c, V::set1_ps(xs[MR + m]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) store_lanes(out, p, m0 + m, n0, acc[m], std::min(V::kRows, p.N - n0));
}

// out[m0 + i, n0 + l] for i < MR, l < 8: MR rows of x times a panel. Per 32 values the panel's 8 quads stay in
// registers while each row of x takes them; each 32 values' int32 sums are set aside, and a super-block's meet
// x's scales and the block's d together after it.
template <int64_t Type, int MR, typename out_t>
__attribute__((noinline)) void int8_panel_rows(const Problem& p, const QuantizedX& qx, int64_t m0,
                                              const Int8Block* panel, int64_t n0, out_t* out) {
  const int64_t x_groups = p.K / 32;
  alignas(32) float acc[MR][kInt8PanelRows] = {};
  alignas(32) int32_t block_sums[8][MR][kInt8PanelRows];  // [32 values][row of x][weight row]
  for (int64_t b = 0; b < p.K / 256; ++b) {
    const Int8Block& w = panel[b];
    for (int j = 0; j < 8; ++j) {  // sub-blocks of 32 values (8 quads), a group of x each
      __m256i u[8];
      for (int i = 0; i < 8; ++i) u[i] = load_block(w.codes[8 * j + i]);
      for (int m = 0; m < MR; ++m) {
        const int8_t* xj = qx.q.data() + (m0 + m) * p.K + 256 * b + 32 * j;
        __m256i sum = _mm256_setzero_si256(), t = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) {
          t = _mm256_add_epi16(t, _mm256_maddubs_epi16(u[i], broadcast_quad(xj + 4 * i)));
          if (i % kQuadsInt16<Type> == kQuadsInt16<Type> - 1) {  // int16 sums as far as they cannot overflow
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(t, load_block(w.scales[2 * j + i / 4])));
            t = _mm256_setzero_si256();
          }
        }
        _mm256_store_si256(reinterpret_cast<__m256i*>(block_sums[j][m]), sum);
      }
    }
    const __m256 d = _mm256_load_ps(w.d);
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * x_groups + 8 * b;
      __m256 scaled = _mm256_setzero_ps(), a = _mm256_load_ps(acc[m]);
      for (int j = 0; j < 8; ++j) {
        __m256i s = load_block(block_sums[j][m]);
        if constexpr (Type == kQ6_K)  // its offset is under d too: met in int32
          s = _mm256_sub_epi32(s, _mm256_madd_epi16(load_block(w.mins[j]), broadcast_quad(qx.sums.data() + 2 * (at + j))));
        else
          a = _mm256_fmadd_ps(_mm256_load_ps(w.neg_mins[j]), _mm256_set1_ps(qx.sums_d[at + j]), a);
        scaled = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(qx.d[at + j]), scaled);
      }
      _mm256_store_ps(acc[m], _mm256_fmadd_ps(scaled, d, a));
    }
  }
  for (int m = 0; m < MR; ++m)
    store_lanes(out, p, m0 + m, n0, _mm256_load_ps(acc[m]), std::min(kInt8PanelRows, p.N - n0));
}

// The fewest rows that take panels: past the walk's, and with bf16 dot products (16-row panels on vpdpbusd)
// from 5 over the 32-value types, whose walk panels beat from there (RESULTS.md, section 31).
template <int64_t Type>
#if defined(__AVX512BF16__)
constexpr int64_t kFewestPanelRows = kSuperBlocks<Type> ? kMaxWalkRows + 1 : 5;
#else
constexpr int64_t kFewestPanelRows = kMaxWalkRows + 1;
#endif

// Which batches take panels, as measured: K-quants with fp32 x on families without bf16 dot products (fp32 is
// their compute dtype), the 32-value types with bf16 x where AMX does not take it (with fp32 x their rounding
// moved a real model's logits past its K-quants'), and Q4_K and Q5_K with bf16 x on the family with bf16 and
// VNNI dot products where AMX does not take it, as blocks of 32 (Q6_K's scale per 16 values would fold twice as
// often; over bf16 x the super-block panels ran slower than the bf16 slices). fp32 asked for on a family with
// bf16 dot products keeps the slices' fp32 arithmetic. RESULTS.md, sections 28 and 29.
template <int64_t Type>
bool uses_int8_panels(const at::Tensor& x, const Problem& p) {
  if (!kInt8Panels<Type> || p.M < kFewestPanelRows<Type>) return false;
#if defined(KVSERVE_AMX)
  const bool bf16_x = x.scalar_type() == at::kBFloat16 && !amx::ready();
#else
  const bool bf16_x = x.scalar_type() == at::kBFloat16;
#endif
  if constexpr (kSuperBlocks<Type>) {
#if defined(__AVX512BF16__)
    return kReadsAsBlocks32<Type> && bf16_x;
#else
    return x.scalar_type() == at::kFloat;
#endif
  } else {
    return bf16_x;
  }
}

template <int64_t Type, typename Block, typename X, typename out_t>
void int8_panel_gemm(const X& x, const Problem& p, out_t* out) {
  constexpr int64_t kRows = Block::kRows;
  const int64_t blocks = p.K / Block::kValues, num_panels = (p.N + kRows - 1) / kRows;
  const int64_t panel_bytes = blocks * static_cast<int64_t>(sizeof(Block));
  // Groups of at most half of L2, as many as a multiple of the threads, so each takes the same share.
  const int64_t threads = at::get_num_threads(), most = std::max<int64_t>(1, half_l2_bytes() / panel_bytes);
  const int64_t groups = ((num_panels + most - 1) / most + threads - 1) / threads * threads;
  const int64_t per_group = (num_panels + groups - 1) / groups;
  at::parallel_for(0, (num_panels + per_group - 1) / per_group, 1, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<Block> panels;  // kept for the next call: every panel is written whole before use
    if (panels.size() < static_cast<size_t>(per_group * blocks)) panels.resize(per_group * blocks);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * per_group, count = std::min(per_group, num_panels - first);
      for (int64_t i = 0; i < count; ++i)
        decode_int8_panel<Type>(p, (first + i) * kRows, panels.data() + i * blocks);
      for (int64_t m0 = 0; m0 < p.M; m0 += kInt8TileRows)
        with_rows(std::min<int64_t>(kInt8TileRows, p.M - m0), [&](auto rows) {
          for (int64_t i = 0; i < count; ++i)
            int8_panel_rows<Type, decltype(rows)::value>(p, x, m0, panels.data() + i * blocks,
                                                         (first + i) * kRows, out);
        });
    }
  });
}

template <typename Block>
struct BlockKind {
  using type = Block;
};

// Panels of blocks of 32 over bf16 x, of K-quant super-blocks over fp32 x (uses_int8_panels says which).
template <int64_t Type>
void int8_panel_gemm(const at::Tensor& x, const Problem& p, const at::Tensor& out) {
  auto go = [&](auto block, const auto* xp) {
    using Block = typename decltype(block)::type;
    auto run = [&](const auto& x) {
      if (out.scalar_type() == at::kBFloat16) int8_panel_gemm<Type, Block>(x, p, out.data_ptr<at::BFloat16>());
      else int8_panel_gemm<Type, Block>(x, p, out.data_ptr<float>());
    };
    if constexpr (std::is_same_v<Block, Int8Block32>) run(PanelX(xp, p.M, p.K));
    else run(quantize_x(xp, p.M, p.K, 32, true));
  };
  if constexpr (kSuperBlocks<Type>) {
    if (x.scalar_type() == at::kFloat) return go(BlockKind<Int8Block>{}, x.data_ptr<float>());
  }
  if constexpr (kReadsAsBlocks32<Type>) {
    if (x.scalar_type() == at::kBFloat16) return go(BlockKind<Int8Block32>{}, x.data_ptr<at::BFloat16>());
  }
  TORCH_CHECK(false, "quant_linear: no int8 panels for ggml type ", Type, " over ", x.scalar_type(), " x");
}
#else
template <int64_t Type>
bool uses_int8_panels(const at::Tensor&, const Problem&) { return false; }
template <int64_t Type>
void int8_panel_gemm(const at::Tensor&, const Problem&, const at::Tensor&) {}
#endif

// ---------------------------------------------------------------------------------------------- AMX: batched decode
#if defined(KVSERVE_AMX)
// A batched decode step (9 to kAmxMaxRows rows of bf16 x) on CPUs with AMX. The slices above pay for writing
// the decoded weights out and for oneDNN reordering them; here each block of 16 weight rows is decoded into a
// tile in L1 and multiplied there by AMX's bf16 tile product, so the weights are read once, from their blocks,
// and never leave L1 decoded. The weights are the product's left tile (16 of their rows, 32 values each, as
// decoded: no reordering) and x its right one (x's rows as bf16 pairs, laid out once per call), so each result
// tile is 16 weight rows by 16 rows of x, transposed on its way out. The arithmetic is the slices': weights
// rounded to bf16, products summed in fp32, the result rounded once.
constexpr int64_t kAmxMaxRows = 48;  // three result tiles: with two weight and three x registers, all eight
constexpr int64_t kAmxTileRows = amx::kTileRows;
constexpr int64_t kAmxTileValues = amx::kTileValues;
using amx::TileConfig;

// x [M, K] bf16 as tiles' right operand: pair p of row m (values 2p, 2p + 1) at [p][m], rows padded with zeros to
// a whole tile (Mp, a multiple of 16). A transpose of 32-bit pairs, gathered 16 rows at a time (it runs before
// the threads start).
std::vector<uint32_t> x_as_pairs(const at::BFloat16* x, int64_t M, int64_t K, int64_t Mp) {
  const int64_t num_pairs = K / 2;
  std::vector<uint32_t> pairs(num_pairs * Mp);
  const int* rows = reinterpret_cast<const int*>(x);
  const __m512i offsets = lane_offsets(num_pairs);
  for (int64_t m0 = 0; m0 < Mp; m0 += kAmxTileRows) {
    const __mmask16 real = mask16(std::max<int64_t>(0, M - m0));  // rows past M: zeros
    for (int64_t p = 0; p < num_pairs; ++p)
      _mm512_storeu_si512(&pairs[p * Mp + m0],
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, offsets, rows + m0 * num_pairs + p, 4));
  }
  return pairs;
}

// What the tile loop decodes at a time: a block, or 32 plain values (one tile row) of a dense weight.
template <int64_t Type>
constexpr Layout kTileStep = kDense<Type> ? Layout{kAmxTileValues, kAmxTileValues * kLayoutOf<Type>.bytes}
                                          : kLayoutOf<Type>;

template <int64_t Type>
__attribute__((always_inline)) inline void decode_step(const uint8_t* block, at::BFloat16* y) {
  if constexpr (kDense<Type>) convert_values(reinterpret_cast<const DenseValue<Type>*>(block), kAmxTileValues, y);
  else decode_block<Type>(block, y);
}

// Tile registers: 0 and 7 the weights (alternating), 1, 5 and 6 x's row tiles 0-2, 2-4 their results.
template <int64_t Type, typename out_t>
__attribute__((target("amx-tile,amx-bf16"))) __attribute__((noinline))
void amx_weight_tiles(const Problem& p, const uint32_t* pairs, int64_t Mp, int64_t t0, int64_t t1, out_t* out) {
  constexpr Layout kLayout = kTileStep<Type>;
  const TileConfig config(8);
  _tile_loadconfig(&config);
  // Two buffers: block b + 1 is decoded while block b's tiles are multiplied, so a tile load never waits for
  // the stores that just wrote it.
  alignas(64) at::BFloat16 weights[2][kAmxTileRows][kLayout.values];
  alignas(64) float result[kAmxTileRows][kAmxTileRows];
  const int64_t x_tiles = Mp / kAmxTileRows, pair_stride = Mp * 4, blocks = p.K / kLayout.values;
  const __m512i column = lane_offsets(kAmxTileRows);
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kAmxTileRows, rows = std::min(kAmxTileRows, p.N - n0);
    if (rows < kAmxTileRows) std::memset(weights, 0, sizeof(weights));
    auto decode = [&](int64_t b) {
      if constexpr (kLookupDecode<Type>)
        return decode_rows_by_lookup<Type>(p.w + n0 * p.row_bytes + b * kLayout.bytes, p.row_bytes, rows,
                                           weights[b & 1]);
      for (int64_t r = 0; r < rows; ++r) {
        decode_step<Type>(p.w + (n0 + r) * p.row_bytes + b * kLayout.bytes, weights[b & 1][r]);
      }
    };
    // The weight rows are read a tile's 16 rows at a time, a run of memory, too slowly for the hardware to
    // stream them ahead by itself: the next tile's bytes are asked for a slice per block of this one.
    const int64_t next_rows = t + 1 < t1 ? std::min(kAmxTileRows, p.N - n0 - kAmxTileRows) : 0;
    const uint8_t* next_tile = p.w + (n0 + kAmxTileRows) * p.row_bytes;
    const int64_t next_tile_bytes = next_rows * p.row_bytes;
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    decode(0);
    int64_t step = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      simd::prefetch_slice(next_tile, next_tile_bytes, b, blocks);
      if (b + 1 < blocks) decode(b + 1);
      const int64_t k = b * kLayout.values;
      for (int64_t j = 0; j < kLayout.values; j += kAmxTileValues) {
        // Each operand alternates between registers, so a load never waits for the products still reading the
        // previous one (tiles are not renamed).
        const uint32_t* x_pairs = pairs + (k + j) / 2 * Mp;
        // The products of one weight tile (register W, a constant: tile registers are named in the instruction).
#define KVSERVE_AMX_PRODUCTS(W)                                     \
  _tile_loadd(W, &weights[b & 1][0][j], kLayout.values * 2);        \
  _tile_loadd(1, x_pairs, pair_stride);                             \
  _tile_dpbf16ps(2, W, 1);                                          \
  if (x_tiles > 1) {                                                \
    _tile_loadd(5, x_pairs + 16, pair_stride);                      \
    _tile_dpbf16ps(3, W, 5);                                        \
  }                                                                 \
  if (x_tiles > 2) {                                                \
    _tile_loadd(6, x_pairs + 32, pair_stride);                      \
    _tile_dpbf16ps(4, W, 6);                                        \
  }
        if (step++ % 2 == 0) {
          KVSERVE_AMX_PRODUCTS(0)
        } else {
          KVSERVE_AMX_PRODUCTS(7)
        }
#undef KVSERVE_AMX_PRODUCTS
      }
    }
    for (int64_t xt = 0; xt < x_tiles; ++xt) {
      switch (xt) {  // tile registers are named by constants
        case 0: _tile_stored(2, result, 64); break;
        case 1: _tile_stored(3, result, 64); break;
        default: _tile_stored(4, result, 64); break;
      }
      // The tile is [weight rows][x rows]: each x row's column gathered, then stored as a run of out's row.
      const int64_t m1 = std::min(p.M, (xt + 1) * kAmxTileRows);
      for (int64_t m = xt * kAmxTileRows; m < m1; ++m)
        store16(out, p, m, n0, _mm512_i32gather_ps(column, &result[0][m - xt * kAmxTileRows], 4), rows);
    }
  }
  _tile_release();
}

template <int64_t Type>
void amx_gemm(const at::Tensor& x, const Problem& p, const at::Tensor& out) {
  const int64_t Mp = (p.M + kAmxTileRows - 1) / kAmxTileRows * kAmxTileRows;
  const std::vector<uint32_t> pairs = x_as_pairs(x.data_ptr<at::BFloat16>(), p.M, p.K, Mp);
  at::parallel_for(0, (p.N + kAmxTileRows - 1) / kAmxTileRows, 1, [&](int64_t t0, int64_t t1) {
    if (out.scalar_type() == at::kBFloat16) amx_weight_tiles<Type>(p, pairs.data(), Mp, t0, t1, out.data_ptr<at::BFloat16>());
    else amx_weight_tiles<Type>(p, pairs.data(), Mp, t0, t1, out.data_ptr<float>());
  });
}

// Prefill-sized batches (more than kAmxMaxRows rows of bf16 x) on AMX: weight rows are decoded once per call,
// 32 at a time, into panels laid out as the tile product's right operand ([value pairs][16 weight rows], a
// transpose of 32-bit pairs); a thread decodes a group of panels that stays in L2, then takes x 32 rows at a
// time, read in place as the left operand, across the whole group. Results come out [x rows][weight rows], in
// out's order. The arithmetic is the slices' (weights rounded to bf16, fp32 sums, one rounding).
constexpr int64_t kPanelRows = 32;              // weight rows per panel: two right tiles, four products per step
constexpr int64_t kPanelGroupBytes = 1 << 20;   // decoded panels a thread keeps at a time (L2 holds 2 MiB)

// Weight rows [n0, n0 + rows) (rows <= 32; the rest zero) as a panel: panel[step][half] is a tile of value pairs
// [2 x 16 values of step][16 weight rows of half].
template <int64_t Type>
void decode_panel(const Problem& p, int64_t n0, int64_t rows, std::vector<at::BFloat16>& decoded, uint32_t* panel) {
  decoded.resize(kPanelRows * p.K);
  for (int64_t r = 0; r < rows; ++r) decode_row<Type>(p.w + (n0 + r) * p.row_bytes, p.K, decoded.data() + r * p.K);
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(decoded.data());
  for (int64_t s = 0; s < p.K / kAmxTileValues; ++s)
    for (int64_t half = 0; half < 2; ++half) {
      const uint16_t* tile_rows[16];
      const int64_t real = std::clamp<int64_t>(rows - 16 * half, 0, 16);
      for (int64_t j = 0; j < real; ++j) tile_rows[j] = bits + (16 * half + j) * p.K + s * kAmxTileValues;
      bf16_pairs::key_tile(tile_rows, real, kAmxTileValues, panel + (s * 2 + half) * 256, 16);
    }
}

template <typename out_t>
inline void store16(out_t* out, const Problem& p, int64_t m, int64_t n, const float* values, int64_t count) {
  store16(out, p, m, n, _mm512_maskz_loadu_ps(mask16(count), values), count);
}

// Every 32 rows of x times panels [0, num_panels) (the first at weight row n0). Tiles: 0-3 results (x tile a,
// weight half b at 2a + b), 4 and 5 x's rows, 6 and 7 the panel's halves.
template <typename out_t>
__attribute__((target("amx-tile,amx-bf16"))) __attribute__((noinline)) void amx_panel_products(
    const Problem& p, const at::BFloat16* x, const std::vector<at::BFloat16>& x_tail, const uint32_t* panels,
    int64_t num_panels, int64_t n0, out_t* out) {
  const amx::TileConfig config(8);
  _tile_loadconfig(&config);
  alignas(64) float result[kAmxTileRows][kAmxTileRows];
  const int64_t steps = p.K / kAmxTileValues, full_tiles = p.M / kAmxTileRows;
  const int64_t x_tiles = (p.M + kAmxTileRows - 1) / kAmxTileRows;
  // x tile t's rows: x in place, or the last tile's few rows copied into x_tail (padded with zeros).
  auto x_rows = [&](int64_t t) { return t < full_tiles ? x + t * kAmxTileRows * p.K : x_tail.data(); };
  for (int64_t t = 0; t < x_tiles; t += 2) {
    const bool pair = t + 1 < x_tiles;
    const at::BFloat16* a0 = x_rows(t);
    const at::BFloat16* a1 = pair ? x_rows(t + 1) : nullptr;
    for (int64_t g = 0; g < num_panels; ++g) {
      const uint32_t* panel = panels + g * steps * 512;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t s = 0; s < steps; ++s) {
        _tile_loadd(6, panel + s * 512, 64);
        _tile_loadd(7, panel + s * 512 + 256, 64);
        _tile_loadd(4, a0 + s * kAmxTileValues, p.K * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (pair) {
          _tile_loadd(5, a1 + s * kAmxTileValues, p.K * 2);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      const int64_t panel_n0 = n0 + g * kPanelRows;
      for (int64_t c = 0; c < (pair ? 4 : 2); ++c) {
        switch (c) {  // tile registers are named by constants
          case 0: _tile_stored(0, result, 64); break;
          case 1: _tile_stored(1, result, 64); break;
          case 2: _tile_stored(2, result, 64); break;
          default: _tile_stored(3, result, 64); break;
        }
        const int64_t m0 = (t + c / 2) * kAmxTileRows, n = panel_n0 + (c % 2) * kAmxTileRows;
        const int64_t count = std::min<int64_t>(kAmxTileRows, p.N - n);
        for (int64_t i = 0; i < std::min(kAmxTileRows, p.M - m0) && count > 0; ++i)
          store16(out, p, m0 + i, n, result[i], count);
      }
    }
  }
  _tile_release();
}

template <int64_t Type>
void amx_panel_gemm(const at::Tensor& x, const Problem& p, const at::Tensor& out) {
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  std::vector<at::BFloat16> x_tail(kAmxTileRows * p.K, at::BFloat16(0.f));
  const int64_t tail_rows = p.M % kAmxTileRows;
  std::copy_n(xp + (p.M - tail_rows) * p.K, tail_rows * p.K, x_tail.data());
  const int64_t panel_words = p.K / kAmxTileValues * 512, num_panels = (p.N + kPanelRows - 1) / kPanelRows;
  // Groups of at most kPanelGroupBytes, as many as a multiple of the threads, so each takes the same share.
  const int64_t threads = at::get_num_threads(), most = std::max<int64_t>(1, kPanelGroupBytes / (panel_words * 4));
  const int64_t groups = ((num_panels + most - 1) / most + threads - 1) / threads * threads;
  const int64_t per_group = (num_panels + groups - 1) / groups;
  at::parallel_for(0, (num_panels + per_group - 1) / per_group, 1, [&](int64_t g0, int64_t g1) {
    std::vector<at::BFloat16> decoded;
    std::vector<uint32_t> panels(per_group * panel_words);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t first = g * per_group, count = std::min(per_group, num_panels - first);
      for (int64_t i = 0; i < count; ++i) {
        const int64_t n0 = (first + i) * kPanelRows;
        decode_panel<Type>(p, n0, std::min(kPanelRows, p.N - n0), decoded, panels.data() + i * panel_words);
      }
      if (out.scalar_type() == at::kBFloat16)
        amx_panel_products(p, xp, x_tail, panels.data(), count, first * kPanelRows, out.data_ptr<at::BFloat16>());
      else
        amx_panel_products(p, xp, x_tail, panels.data(), count, first * kPanelRows, out.data_ptr<float>());
    }
  });
}
#endif

}  // namespace

at::Tensor small_batch_linear(at::Tensor x, at::Tensor weight, at::Tensor bias);
bool small_batch_linear_reads(at::ScalarType x, at::ScalarType weight);
int64_t small_batch_linear_max_rows();

namespace {

// Past the walk (blocks) or small_batch_linear (dense rows), bf16 x of up to kAmxMaxRows rows goes to AMX tiles.
template <int64_t Type>
bool uses_amx(const at::Tensor& x, const Problem& p) {
#if defined(KVSERVE_AMX)
  const int64_t fewer_rows = kDense<Type> ? small_batch_linear_max_rows() : kMaxWalkRows;
  return p.M > fewer_rows && p.M <= kAmxMaxRows && x.scalar_type() == at::kBFloat16 &&
         p.K % kTileStep<Type>.values == 0 && amx::ready();
#else
  (void)x, (void)p;
  return false;
#endif
}

// ---------------------------------------------------------------------------------------------- dispatch

template <int64_t Type>
void run_type(const at::Tensor& x, const Problem& p, const at::Tensor& out) {
#if defined(KVSERVE_AMX)
  if (uses_amx<Type>(x, p)) return amx_gemm<Type>(x, p, out);
  if (p.M > kAmxMaxRows && x.scalar_type() == at::kBFloat16 && p.K % kAmxTileValues == 0 && amx::ready())
    return amx_panel_gemm<Type>(x, p, out);
#endif
  if (uses_int8_panels<Type>(x, p)) return int8_panel_gemm<Type>(x, p, out);
  if (p.M > kMaxWalkRows) return gemm_slices<Type>(x, p, out);
  auto go = [&](const auto* xp) {
    if (out.scalar_type() == at::kBFloat16) walk<Type>(xp, p, out.data_ptr<at::BFloat16>());
    else walk<Type>(xp, p, out.data_ptr<float>());
  };
  if (x.scalar_type() == at::kBFloat16) go(x.data_ptr<at::BFloat16>());
  else go(x.data_ptr<float>());
}

// A dense weight's rows `w` [N, K] (a view of its bytes), in place.
template <int64_t Type>
void run_dense(const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, const Problem& p,
               const at::Tensor& out) {
  const at::Tensor columns = out.narrow(1, p.out_col, p.N);
  if (p.M <= small_batch_linear_max_rows() && small_batch_linear_reads(x.scalar_type(), w.scalar_type()))
    return void(columns.copy_(small_batch_linear(x, w, bias)));
#if defined(KVSERVE_AMX)
  if (uses_amx<Type>(x, p)) return amx_gemm<Type>(x, p, out);
#endif
  if (x.scalar_type() == w.scalar_type())  // torch's matmul (oneDNN) on the rows as they are
    return void(columns.copy_(at::linear(x, w, bias.numel() ? bias.to(x.scalar_type()) : at::Tensor())));
  gemm_slices<Type>(x, p, out);
}

template <typename Fn>
void with_type(int64_t type, Fn&& fn) {
  switch (type) {
    case kF32: fn(std::integral_constant<int64_t, kF32>{}); break;
    case kF16: fn(std::integral_constant<int64_t, kF16>{}); break;
    case kBF16: fn(std::integral_constant<int64_t, kBF16>{}); break;
    case kQ4_0: fn(std::integral_constant<int64_t, kQ4_0>{}); break;
    case kQ4_1: fn(std::integral_constant<int64_t, kQ4_1>{}); break;
    case kQ5_0: fn(std::integral_constant<int64_t, kQ5_0>{}); break;
    case kQ5_1: fn(std::integral_constant<int64_t, kQ5_1>{}); break;
    case kQ8_0: fn(std::integral_constant<int64_t, kQ8_0>{}); break;
    case kQ4_K: fn(std::integral_constant<int64_t, kQ4_K>{}); break;
    case kQ5_K: fn(std::integral_constant<int64_t, kQ5_K>{}); break;
    case kQ6_K: fn(std::integral_constant<int64_t, kQ6_K>{}); break;
    default: TORCH_CHECK(false, "quant_linear does not read ggml type ", type);
  }
}

// K of rows of `blocks` in `type`, checked.
int64_t row_values(const at::Tensor& blocks, int64_t type) {
  TORCH_CHECK(known_type(type), "quant_linear does not read ggml type ", type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "blocks must be contiguous uint8 [N, row bytes]");
  const Layout layout = layout_of(type);
  TORCH_CHECK(blocks.size(1) % layout.bytes == 0, "rows of ", blocks.size(1), " bytes are not whole blocks of ",
              layout.bytes);
  return blocks.size(1) / layout.bytes * layout.values;
}

}  // namespace

bool quant_linear_reads(int64_t type) { return known_type(type); }

// Whether more than 8 rows of x (bf16 or fp32) over blocks of `type` are quantized to int8 here (int8 panels).
bool quant_linear_int8_batches(int64_t type, bool bf16_x) {
  TORCH_CHECK(known_type(type), "quant_linear does not read ggml type ", type);
  bool panels = false;
  with_type(type, [&](auto t) {
    constexpr int64_t Type = decltype(t)::value;
    if constexpr (!kDense<Type>) {
      const Problem p{nullptr, 0, 0, 0, nullptr, kMaxWalkRows + 1, 0, 0};
      panels = uses_int8_panels<Type>(at::empty({0}, bf16_x ? at::kBFloat16 : at::kFloat), p);
    }
  });
  return panels;
}

// Whether batched decode (9 to 48 rows of bf16 x) runs on AMX tiles here.
bool quant_linear_uses_amx() {
#if defined(KVSERVE_AMX)
  return amx::ready();
#else
  return false;
#endif
}

// out[:, col : col + N] = x @ W.T (+ bias), W's rows [N, row bytes] of ggml blocks of `type`.
// x [M, K] fp32 or bf16; out [M, >= col + N] contiguous, fp32 or bf16; bias [N] or empty.
void quant_linear_out(at::Tensor x, at::Tensor blocks, int64_t type, at::Tensor bias, at::Tensor out,
                      int64_t col) {
  const int64_t K = row_values(blocks, type), N = blocks.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && col >= 0 &&
              col + N <= out.size(1), "out must be contiguous [M, >= col + N]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: fp32 or bf16");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "bias must have one value per output");
  if (x.size(0) == 0 || N == 0) return;
  x = x.contiguous();
  const at::Tensor bias32 = bias.numel() ? bias.to(at::kFloat).contiguous() : bias;
  const Problem p{blocks.data_ptr<uint8_t>(), blocks.size(1), K, N,
                  bias.numel() ? bias32.data_ptr<float>() : nullptr, x.size(0), out.size(1), col};
  with_type(type, [&](auto t) {
    constexpr int64_t Type = decltype(t)::value;
    if constexpr (kDense<Type>) run_dense<Type>(x, blocks.view(c10::CppTypeToScalarType<DenseValue<Type>>::value), bias, p, out);
    else run_type<Type>(x, p, out);
  });
}

// out[i] = row ids[i] of W decoded (an embedding lookup over a weight held as blocks); out [len(ids), K]
// contiguous fp32 or bf16.
void quant_rows_out(at::Tensor blocks, int64_t type, at::Tensor ids, at::Tensor out) {
  const int64_t K = row_values(blocks, type), N = blocks.size(0);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong, "ids must be int64 [n]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0) && out.size(1) == K,
              "out must be contiguous [len(ids), K]");
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16, "out: fp32 or bf16");
  ids = ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row id ", id[i], " out of range");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  with_type(type, [&](auto t) {
    constexpr int64_t Type = decltype(t)::value;
    at::parallel_for(0, ids.size(0), 1, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        if (out.scalar_type() == at::kFloat) decode_row<Type>(w + id[i] * row_bytes, K, out.data_ptr<float>() + i * K);
        else decode_row<Type>(w + id[i] * row_bytes, K, out.data_ptr<at::BFloat16>() + i * K);
      }
    });
  });
}
