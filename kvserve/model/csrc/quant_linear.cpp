// x @ W.T (+ bias) over a weight held as its GGUF file holds it: each row of W a run of ggml blocks (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0 in blocks of 32 values; Q4_K, Q5_K, Q6_K in super-blocks of 256), read in place for every
// batch size, so the weights cost their file's bytes and no dequantized copy exists (layers.QuantWeight).
//
// - Few rows (a decode step of one or a few streams): every weight byte is used for M multiply-adds, so the
//   matmul is a walk over the blocks. Each block is decoded a vector at a time in registers and multiplied
//   against the M rows of x (fp32) right away.
// - More rows (batched decode, prefill): per task, a tile of kTile output rows is decoded ONCE, for the whole
//   K, into a small buffer laid out for the micro-kernel (bf16 pairs interleaved for AVX512-BF16 dot products
//   where the compute dtype is bf16; fp32 otherwise), then a register-blocked micro-kernel runs every row of x
//   over it. The decode is paid once per weight per call, against M multiply-adds per weight.
//
// Values are decoded as ggml (and gguf.quants) define them, in fp32; under bf16 compute the tile rounds them to
// bf16 as the loader's dequantized weights were, and x is bf16 as it was: the same arithmetic as oneDNN's bf16
// matmul over dequantized weights, up to summation order. Accumulation is fp32, the result rounded once.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"

namespace {

// ggml's ids of the types read here (gguf.GGMLQuantizationType).
enum GgmlType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct Layout {
  int64_t values;  // per block
  int64_t bytes;   // per block
};

bool known_type(int64_t type) {
  switch (type) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K: case kQ6_K: return true;
    default: return false;
  }
}

Layout layout_of(int64_t type) {
  switch (type) {
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
constexpr int64_t kTile = 32;    // output rows decoded together for the many-rows kernel
constexpr int64_t kMaxWalkRows = 4;  // up to this many rows of x, the walk over the blocks

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

// `f(i, v)` gets values [i, i + kLanes) of the block as fp32 lanes, never written to memory by the walk (it
// multiplies them into its accumulators right away).
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
constexpr Layout kLayoutOf = Type == kQ4_0 ? Layout{32, 18} : Type == kQ4_1 ? Layout{32, 20}
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

#if defined(KVSERVE_SIMD)
// Each block decoded a vector at a time in registers and multiplied into M accumulators.
template <int64_t Type, int M, typename out_t>
void walk_rows(const float* x, const Problem& p, int64_t n0, int64_t n1, out_t* out) {
  constexpr Layout kLayout = kLayoutOf<Type>;
  const int64_t blocks = p.K / kLayout.values;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* block = p.w + n * p.row_bytes;
    Simd::V acc[M];
    for (int m = 0; m < M; ++m) acc[m] = Simd::zero();
    for (int64_t b = 0; b < blocks; ++b, block += kLayout.bytes) {
      const float* xb = x + b * kLayout.values;
      decode_vectors<Type>(block, [&](int i, FV v) {
        for (int m = 0; m < M; ++m) acc[m] = Simd::fmadd((Simd::V)v, Simd::load(xb + m * p.K + i), acc[m]);
      });
    }
    for (int m = 0; m < M; ++m) store(out, p, m, n, Simd::reduce_add(acc[m]));
  }
}
#else
template <int64_t Type, int M, typename out_t>
void walk_rows(const float* x, const Problem& p, int64_t n0, int64_t n1, out_t* out) {
  float y[kChunk];
  for (int64_t n = n0; n < n1; ++n) {
    float sums[M] = {};
    for (int64_t k = 0; k < p.K; k += kChunk) {
      const int64_t count = std::min(kChunk, p.K - k);
      decode_values<Type>(p.w + n * p.row_bytes, k, count, y);
      for (int m = 0; m < M; ++m)
        for (int64_t i = 0; i < count; ++i) sums[m] += y[i] * x[m * p.K + k + i];
    }
    for (int m = 0; m < M; ++m) store(out, p, m, n, sums[m]);
  }
}
#endif

template <int64_t Type, typename out_t>
void walk(const float* x, const Problem& p, out_t* out) {
  at::parallel_for(0, p.N, 16, [&](int64_t n0, int64_t n1) {
    switch (p.M) {
      case 1: walk_rows<Type, 1>(x, p, n0, n1, out); break;
      case 2: walk_rows<Type, 2>(x, p, n0, n1, out); break;
      case 3: walk_rows<Type, 3>(x, p, n0, n1, out); break;
      default: walk_rows<Type, 4>(x, p, n0, n1, out); break;
    }
  });
}

// ---------------------------------------------------------------------------------------------- many rows: tiles

// Decodes output rows [n0, n0 + kTile) (zeros past N) for the whole K and hands each row's values, kChunk at a
// time, to `put(tile_row, k, values, count)`.
template <int64_t Type, typename Put>
void decode_tile(const Problem& p, int64_t n0, Put&& put) {
  alignas(64) float y[kChunk];
  for (int64_t j = 0; j < kTile; ++j) {
    const bool inside = n0 + j < p.N;
    for (int64_t k = 0; k < p.K; k += kChunk) {
      const int64_t count = std::min(kChunk, p.K - k);
      if (inside) decode_values<Type>(p.w + (n0 + j) * p.row_bytes, k, count, y);
      else std::fill_n(y, count, 0.f);
      put(j, k, y, count);
    }
  }
}

template <typename out_t>
inline void store_tile_row(const float* acc, const Problem& p, int64_t m, int64_t n0, out_t* out) {
  const int64_t valid = std::min(kTile, p.N - n0);
  for (int64_t j = 0; j < valid; ++j) store(out, p, m, n0 + j, acc[j]);
}

#if defined(__AVX512BF16__)
constexpr int kRowsBf16 = 8;  // x rows per micro-kernel call: 8 x 2 accumulators of 16 outputs

// acc rows [MR][kTile] = x rows [m0, m0 + MR) . tile, the tile as [K / 2][kTile] pairs of bf16.
template <int MR, typename out_t>
void micro_bf16(const at::BFloat16* x, const uint32_t* tile, const Problem& p, int64_t m0, int64_t n0, out_t* out) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t pairs = p.K / 2;
  const uint32_t* xp[MR];
  for (int m = 0; m < MR; ++m) xp[m] = reinterpret_cast<const uint32_t*>(x + (m0 + m) * p.K);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(tile + kp * kTile);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(tile + kp * kTile + 16);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[m][kp]));
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xb);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xb);
    }
  }
  alignas(64) float row[kTile];
  for (int m = 0; m < MR; ++m) {
    _mm512_store_ps(row, acc[m][0]);
    _mm512_store_ps(row + 16, acc[m][1]);
    store_tile_row(row, p, m0 + m, n0, out);
  }
}

template <int64_t Type, typename out_t>
void tiles_bf16(const at::BFloat16* x, const Problem& p, out_t* out) {
  const int64_t tiles = (p.N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint32_t> tile(p.K / 2 * kTile);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile;
      decode_tile<Type>(p, n0, [&](int64_t j, int64_t k, const float* y, int64_t count) {
        // Rounded to bf16 (to nearest even, as torch's .to(bfloat16)) 32 at a time, then each pair to its row
        // of the tile.
        alignas(64) uint32_t pairs[kChunk / 2];
        for (int64_t i = 0; i < count; i += 32)
          _mm512_store_si512(pairs + i / 2, (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(y + i + 16),
                                                                         _mm512_loadu_ps(y + i)));
        uint32_t* dst = tile.data() + k / 2 * kTile + j;
        for (int64_t i = 0; i < count / 2; ++i) dst[i * kTile] = pairs[i];
      });
      int64_t m0 = 0;
      for (; m0 + kRowsBf16 <= p.M; m0 += kRowsBf16) micro_bf16<kRowsBf16>(x, tile.data(), p, m0, n0, out);
      for (; m0 < p.M; ++m0) micro_bf16<1>(x, tile.data(), p, m0, n0, out);
    }
  });
}
#endif

#if defined(KVSERVE_SIMD)
// fp32 tiles: [K][kTile] values; kVectors vectors of outputs by kRowsFp32 rows of accumulators (AVX-512: 8 x 2
// of 32 registers; AVX2: 3 x 4 of 16).
constexpr int kVectors = kTile / simd::Simd::kLanes;
constexpr int kRowsFp32 = simd::Simd::kRegisters == 32 ? 8 : 3;

template <int MR, typename out_t>
void micro_fp32(const float* x, const float* tile, const Problem& p, int64_t m0, int64_t n0, out_t* out) {
  using simd::Simd;
  Simd::V acc[MR][kVectors];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < kVectors; ++v) acc[m][v] = Simd::zero();
  for (int64_t k = 0; k < p.K; ++k) {
    // x broadcast first, then one vector of weights at a time: MR x kVectors accumulators + MR + 1 registers
    Simd::V xv[MR];
    for (int m = 0; m < MR; ++m) xv[m] = Simd::set1(x[(m0 + m) * p.K + k]);
    for (int v = 0; v < kVectors; ++v) {
      const Simd::V w = Simd::load(tile + k * kTile + v * Simd::kLanes);
      for (int m = 0; m < MR; ++m) acc[m][v] = Simd::fmadd(w, xv[m], acc[m][v]);
    }
  }
  alignas(64) float row[kTile];
  for (int m = 0; m < MR; ++m) {
    for (int v = 0; v < kVectors; ++v) Simd::store(row + v * Simd::kLanes, acc[m][v]);
    store_tile_row(row, p, m0 + m, n0, out);
  }
}
#else
constexpr int kRowsFp32 = 1;

template <int MR, typename out_t>
void micro_fp32(const float* x, const float* tile, const Problem& p, int64_t m0, int64_t n0, out_t* out) {
  float row[kTile] = {};
  for (int64_t k = 0; k < p.K; ++k)
    for (int64_t j = 0; j < kTile; ++j) row[j] += tile[k * kTile + j] * x[m0 * p.K + k];
  store_tile_row(row, p, m0, n0, out);
}
#endif

template <int64_t Type, typename out_t>
void tiles_fp32(const float* x, const Problem& p, out_t* out) {
  const int64_t tiles = (p.N + kTile - 1) / kTile;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> tile(p.K * kTile);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTile;
      decode_tile<Type>(p, n0, [&](int64_t j, int64_t k, const float* y, int64_t count) {
        float* dst = tile.data() + k * kTile + j;
        for (int64_t i = 0; i < count; ++i) dst[i * kTile] = y[i];
      });
      int64_t m0 = 0;
      for (; m0 + kRowsFp32 <= p.M; m0 += kRowsFp32) micro_fp32<kRowsFp32>(x, tile.data(), p, m0, n0, out);
      for (; m0 < p.M; ++m0) micro_fp32<1>(x, tile.data(), p, m0, n0, out);
    }
  });
}

// ---------------------------------------------------------------------------------------------- dispatch

template <int64_t Type>
void run_type(const torch::Tensor& x, const Problem& p, const torch::Tensor& out) {
  const bool bf16_out = out.scalar_type() == torch::kBFloat16;
#if defined(__AVX512BF16__)
  if (x.scalar_type() == torch::kBFloat16 && p.M > kMaxWalkRows) {
    const auto* xb = x.data_ptr<at::BFloat16>();
    if (bf16_out) tiles_bf16<Type>(xb, p, out.data_ptr<at::BFloat16>());
    else tiles_bf16<Type>(xb, p, out.data_ptr<float>());
    return;
  }
#endif
  // fp32 compute, or bf16 x widened once (M x K, read once per tile or row of weights), without a torch op:
  // its dispatch would cost as much as a small weight's whole walk.
  std::vector<float> widened;
  const float* xf = x.scalar_type() == torch::kFloat ? x.data_ptr<float>() : nullptr;
  if (xf == nullptr) {
    const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
    widened.resize(x.numel());
    for (int64_t i = 0; i < x.numel(); ++i) widened[i] = static_cast<float>(xb[i]);
    xf = widened.data();
  }
  auto go = [&](auto* y) {
    if (p.M <= kMaxWalkRows) walk<Type>(xf, p, y);
    else tiles_fp32<Type>(xf, p, y);
  };
  if (bf16_out) go(out.data_ptr<at::BFloat16>());
  else go(out.data_ptr<float>());
}

template <typename Fn>
void with_type(int64_t type, Fn&& fn) {
  switch (type) {
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
int64_t row_values(const torch::Tensor& blocks, int64_t type) {
  TORCH_CHECK(known_type(type), "quant_linear does not read ggml type ", type);
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
              "blocks must be contiguous uint8 [N, row bytes]");
  const Layout layout = layout_of(type);
  TORCH_CHECK(blocks.size(1) % layout.bytes == 0, "rows of ", blocks.size(1), " bytes are not whole blocks of ",
              layout.bytes);
  return blocks.size(1) / layout.bytes * layout.values;
}

}  // namespace

bool quant_linear_reads(int64_t type) { return known_type(type); }

// out[:, col : col + N] = x @ W.T (+ bias), W's rows [N, row bytes] of ggml blocks of `type`.
// x [M, K] fp32 or bf16; out [M, >= col + N] contiguous, fp32 or bf16; bias [N] or empty.
void quant_linear_out(torch::Tensor x, torch::Tensor blocks, int64_t type, torch::Tensor bias, torch::Tensor out,
                      int64_t col) {
  const int64_t K = row_values(blocks, type), N = blocks.size(0);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "x must be [M, ", K, "]");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == x.size(0) && col >= 0 &&
              col + N <= out.size(1), "out must be contiguous [M, >= col + N]");
  TORCH_CHECK(out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16, "out: fp32 or bf16");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "bias must have one value per output");
  if (x.size(0) == 0 || N == 0) return;
  x = x.contiguous();
  const torch::Tensor bias32 = bias.numel() ? bias.to(torch::kFloat).contiguous() : bias;
  const Problem p{blocks.data_ptr<uint8_t>(), blocks.size(1), K, N,
                  bias.numel() ? bias32.data_ptr<float>() : nullptr, x.size(0), out.size(1), col};
  with_type(type, [&](auto t) { run_type<decltype(t)::value>(x, p, out); });
}

// out[i] = row ids[i] of W decoded (an embedding lookup over a weight held as blocks); out [len(ids), K]
// contiguous fp32 or bf16.
void quant_rows_out(torch::Tensor blocks, int64_t type, torch::Tensor ids, torch::Tensor out) {
  const int64_t K = row_values(blocks, type), N = blocks.size(0);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == torch::kLong, "ids must be int64 [n]");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.size(0) == ids.size(0) && out.size(1) == K,
              "out must be contiguous [len(ids), K]");
  TORCH_CHECK(out.scalar_type() == torch::kFloat || out.scalar_type() == torch::kBFloat16, "out: fp32 or bf16");
  ids = ids.contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < ids.size(0); ++i) TORCH_CHECK(id[i] >= 0 && id[i] < N, "row id ", id[i], " out of range");
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = blocks.size(1);
  with_type(type, [&](auto t) {
    constexpr int64_t Type = decltype(t)::value;
    at::parallel_for(0, ids.size(0), 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> y(K);
      for (int64_t i = i0; i < i1; ++i) {
        decode_values<Type>(w + id[i] * row_bytes, 0, K, y.data());
        if (out.scalar_type() == torch::kFloat) std::copy_n(y.data(), K, out.data_ptr<float>() + i * K);
        else std::copy_n(y.data(), K, out.data_ptr<at::BFloat16>() + i * K);
      }
    });
  });
}
