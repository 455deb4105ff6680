// x @ weight.T (+ bias) for one or two rows of x, reading the weight in ggml's blocks of 32 values, as a GGUF
// file quantizes it (Q4_0, Q4_1, Q8_0), instead of the bf16 weights the loader dequantized (CPU).
//
// A single stream's decode step reads every weight once for one or two multiply-adds each, so its matmuls take
// as long as the weights' bytes take to arrive. A Q4_1 file's blocks are 0.625 bytes a weight against bf16's
// 2. Each block is decoded in registers and multiplied in fp32, so the products use the exact values the file
// encodes (bf16 rounds them to 8 bits).
//
// The loader splits each block into its parts (layers.BlockQuantWeight): values [N, K / 2] (4-bit, two per
// byte, element i of a block in the low nibble of its byte i, element i + 16 in the high one, as ggml) or
// [N, K] (int8); scales d [N, K / 32] fp16; and for 4-bit values the minimums m [N, K / 32] fp16 (Q4_0 is
// Q4_1 with m = -8d). Kept apart, a row's scales widen 16 at a time instead of one per block.
// Per block: sum_i x_i (d q_i + m) = d * sum_i x_i q_i + m * sum_i x_i, with each block's sum of x computed
// once per call. Accumulation is in fp32, the result rounded once to x's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kMaxRows = 2;
constexpr int64_t kBlock = 32;
constexpr int64_t kRowsPerTask = 16;

enum Values : int64_t { kNibbles = 4, kInt8 = 8 };  // each named by its bits a value

struct WeightBlocks {
  const uint8_t* qs;
  const at::Half* scales;
  const at::Half* mins;  // nullptr for int8 values
};

// The block's 32 values (without d and m) times 32 values of x, summed: q . x.
template <int64_t Type>
inline float block_dot_scalar(const uint8_t* qs, const float* x) {
  float sum = 0.f;
  for (int i = 0; i < 16; ++i) {
    if constexpr (Type == kInt8) {
      sum += static_cast<int8_t>(qs[i]) * x[i] + static_cast<int8_t>(qs[i + 16]) * x[i + 16];
    } else {
      sum += (qs[i] & 0xF) * x[i] + (qs[i] >> 4) * x[i + 16];
    }
  }
  return sum;
}

#if defined(KVSERVE_SIMD)
using simd::Simd;

// q . x for one block as a vector of partial sums (reduced once per output row).
template <int64_t Type>
inline Simd::V block_dot(const uint8_t* qs, const float* x) {
#if defined(__AVX512F__)
  __m512 lo, hi;
  if constexpr (Type == kInt8) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16))));
  } else {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
  }
  return _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
#else
  __m256 v[4];  // elements 0-7, 8-15, 16-23, 24-31
  if constexpr (Type == kInt8) {
    for (int j = 0; j < 4; ++j)
      v[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * j))));
  } else {
    for (int j = 0; j < 2; ++j) {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(qs + 8 * j)));
      v[j] = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)));
      v[j + 2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
  }
  __m256 sum = _mm256_mul_ps(v[0], _mm256_loadu_ps(x));
  for (int j = 1; j < 4; ++j) sum = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + 8 * j), sum);
  return sum;
#endif
}
#endif

// Dot products of one row of values against the M rows of a vector, over `blocks` values: the scales of a row
// (fp16 in memory) as fp32 for per-block broadcasts.
inline float fp16_dot(const at::Half* a, const float* b, int64_t n) {
  float sum = 0.f;
  int64_t i = 0;
#if defined(KVSERVE_SIMD)
  Simd::V acc = Simd::zero();
  for (; i + Simd::kLanes <= n; i += Simd::kLanes) acc = Simd::fmadd(Simd::load(a + i), Simd::load(b + i), acc);
  sum = Simd::reduce_add(acc);
#endif
  for (; i < n; ++i) sum += static_cast<float>(a[i]) * b[i];
  return sum;
}

inline void widen_scales(const at::Half* scales, int64_t n, float* out) {
  int64_t i = 0;
#if defined(KVSERVE_SIMD)
  for (; i + Simd::kLanes <= n; i += Simd::kLanes) Simd::store(out + i, Simd::load(scales + i));
#endif
  for (; i < n; ++i) out[i] = static_cast<float>(scales[i]);
}

// out[m * N + n] = x[m] . w[n] (+ bias[n]) for the weight rows [n0, n1). x is fp32 [M, K]; x_sums [M, K / 32]
// holds each block's sum of x (read with the minimums).
template <int64_t Type, int M, typename out_t>
void rows(const float* x, const float* x_sums, const WeightBlocks& w, const float* bias, int64_t K, int64_t N,
          int64_t n0, int64_t n1, out_t* out) {
  const int64_t blocks = K / kBlock, qs_bytes = kBlock * Type / 8;
  std::vector<float> d(blocks);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.qs + n * blocks * qs_bytes;
    widen_scales(w.scales + n * blocks, blocks, d.data());
    float sums[M];
    for (int m = 0; m < M; ++m)
      sums[m] = w.mins ? fp16_dot(w.mins + n * blocks, x_sums + m * blocks, blocks) : 0.f;
#if defined(KVSERVE_SIMD)
    Simd::V acc[M];
    for (int m = 0; m < M; ++m) acc[m] = Simd::zero();
#endif
    for (int64_t b = 0; b < blocks; ++b) {
      const uint8_t* qs = row + b * qs_bytes;
      for (int m = 0; m < M; ++m) {
        const float* xb = x + m * K + b * kBlock;
#if defined(KVSERVE_SIMD)
        acc[m] = Simd::fmadd(Simd::set1(d[b]), block_dot<Type>(qs, xb), acc[m]);
#else
        sums[m] += d[b] * block_dot_scalar<Type>(qs, xb);
#endif
      }
    }
    for (int m = 0; m < M; ++m) {
#if defined(KVSERVE_SIMD)
      sums[m] += Simd::reduce_add(acc[m]);
#endif
      out[m * N + n] = static_cast<out_t>(sums[m] + (bias ? bias[n] : 0.f));
    }
  }
}

template <int64_t Type, typename out_t>
void run(const float* x, const float* x_sums, int64_t M, const WeightBlocks& w, const float* bias, int64_t K,
         int64_t N, out_t* out) {
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t n0, int64_t n1) {
    if (M == 1) rows<Type, 1>(x, x_sums, w, bias, K, N, n0, n1, out);
    else rows<Type, 2>(x, x_sums, w, bias, K, N, n0, n1, out);
  });
}

}  // namespace

int64_t block_quant_linear_max_rows() { return kMaxRows; }

// x [M, K] fp32 or bf16 (M <= 2, K a multiple of 32); values uint8 [N, K / 2] (4-bit) or [N, K] (int8);
// scales fp16 [N, K / 32]; mins fp16 [N, K / 32] with 4-bit values, empty with int8 ones; bias [N] or empty.
// Returns [M, N] in x's dtype.
torch::Tensor block_quant_linear(torch::Tensor x, torch::Tensor values, torch::Tensor scales, torch::Tensor mins,
                                 torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && values.dim() == 2, "x [M, K] and values [N, K / 2 or K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "block_quant_linear takes 1 to ", kMaxRows, " rows");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x must be fp32 or bf16");
  const int64_t M = x.size(0), K = x.size(1), N = values.size(0), blocks = K / kBlock;
  TORCH_CHECK(K % kBlock == 0, "block_quant_linear needs whole blocks of 32 values, got rows of ", K);
  TORCH_CHECK(values.scalar_type() == torch::kUInt8 && values.is_contiguous(), "values must be contiguous uint8");
  TORCH_CHECK(values.size(1) == K / 2 || values.size(1) == K, "values of ", values.size(1),
              " bytes a row are neither 4-bit nor 8-bit rows of ", K);
  const bool nibbles = values.size(1) == K / 2;
  auto check_scales = [&](const torch::Tensor& t, const char* what) {
    TORCH_CHECK(t.scalar_type() == torch::kHalf && t.is_contiguous() && t.dim() == 2 && t.size(0) == N &&
                t.size(1) == blocks, what, " must be contiguous fp16 [N, K / 32]");
  };
  check_scales(scales, "scales");
  if (nibbles) check_scales(mins, "mins (4-bit values)");
  else TORCH_CHECK(mins.numel() == 0, "int8 values take no mins");
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "bias must have one value per output");
  // x widened once and each block's sum of x, without torch ops: their dispatch would cost as much as a
  // small weight's whole walk.
  x = x.contiguous();
  std::vector<float> x32(M * K), x_sums(M * blocks);
  if (x.scalar_type() == torch::kFloat) {
    std::copy_n(x.data_ptr<float>(), M * K, x32.data());
  } else {
    const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
    for (int64_t i = 0; i < M * K; ++i) x32[i] = static_cast<float>(xb[i]);
  }
  for (int64_t i = 0; i < M * blocks; ++i) {
    float sum = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) sum += x32[i * kBlock + j];
    x_sums[i] = sum;
  }
  const torch::Tensor bias32 = bias.numel() ? bias.to(torch::kFloat).contiguous() : bias;
  const float* b = bias.numel() ? bias32.data_ptr<float>() : nullptr;
  const WeightBlocks w{values.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                       nibbles ? mins.data_ptr<at::Half>() : nullptr};
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x32.data();
  const float* sp = x_sums.data();
  auto go = [&](auto* y) {
    if (nibbles) run<kNibbles>(xp, sp, M, w, b, K, N, y);
    else run<kInt8>(xp, sp, M, w, b, K, N, y);
  };
  if (x.scalar_type() == torch::kFloat) go(out.data_ptr<float>());
  else go(out.data_ptr<at::BFloat16>());
  return out;
}
