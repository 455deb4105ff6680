// x @ weight.T (+ bias) for 1 to 8 rows of x, reading a plain row-major weight (CPU): quant_linear's path for dense
// weights (a 16-bit or fp32 checkpoint's rows) at decode batch sizes.
//
// With few rows a matmul is a walk over the weight: every byte is read once and used for a few multiply-adds,
// so its speed is the speed of that walk. Each weight row is walked against two rows of x at a time (more
// accumulators spill); a batch of up to 8 rows walks a task's 16 weight rows once per pair of x's rows, from
// memory the first time and from cache after. oneDNN's GEMV over its packed layout read bf16 weights at
// two-thirds of this walk's speed on a Zen 4 (benchmarks/RESULTS.md).
//
// Accumulation is in fp32 whatever the dtypes; bf16 x bf16 uses AVX512-BF16 dot products where the family has
// them, everything else widens to fp32 (bf16 by a 16-bit shift) and uses FMA. The result is rounded once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kGroupRows = 2;  // rows of x against one pass over the weight rows (more spill accumulators)
constexpr int64_t kRowsPerTask = 16;  // weight rows per parallel task (its outputs share cache lines)

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }
inline float widen(at::Half v) { return static_cast<float>(v); }

// out[m * N + n] = dot(x[m], w[n]) (+ bias[n]) for the weight rows [n0, n1), M rows of fp32 x.
template <int M, typename w_t, typename out_t>
void rows_widened(const float* x, const w_t* w, const float* bias, int64_t K, int64_t N, int64_t n0, int64_t n1,
                  out_t* out) {
  for (int64_t n = n0; n < n1; ++n) {
    const w_t* row = w + n * K;
    float sums[M];
    int64_t k = 0;
#if defined(KVSERVE_SIMD)
    using simd::Simd;
    constexpr int64_t L = Simd::kLanes;
    Simd::V a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = Simd::zero();
    for (; k + 2 * L <= K; k += 2 * L) {
      simd::prefetch_ahead(row + k, 2 * L * sizeof(w_t));
      const Simd::V w0 = Simd::load(row + k), w1 = Simd::load(row + k + L);
      for (int m = 0; m < M; ++m) {
        a0[m] = Simd::fmadd(w0, Simd::load(x + m * K + k), a0[m]);
        a1[m] = Simd::fmadd(w1, Simd::load(x + m * K + k + L), a1[m]);
      }
    }
    for (int m = 0; m < M; ++m) sums[m] = Simd::reduce_add(Simd::add(a0[m], a1[m]));
#else
    for (int m = 0; m < M; ++m) sums[m] = 0.f;
#endif
    for (; k < K; ++k)
      for (int m = 0; m < M; ++m) sums[m] += widen(row[k]) * x[m * K + k];
    for (int m = 0; m < M; ++m) out[m * N + n] = static_cast<out_t>(sums[m] + (bias ? bias[n] : 0.f));
  }
}

#if defined(__AVX512BF16__)
// The same for bf16 x and bf16 weights with bf16 dot products (two products per fp32 lane per instruction).
template <int M>
void rows_bf16(const at::BFloat16* x, const at::BFloat16* w, const float* bias, int64_t K, int64_t N, int64_t n0,
               int64_t n1, at::BFloat16* out) {
  auto load = [](const at::BFloat16* p) { return (__m512bh)_mm512_loadu_si512(p); };
  for (int64_t n = n0; n < n1; ++n) {
    const at::BFloat16* row = w + n * K;
    __m512 a0[M], a1[M];
    for (int m = 0; m < M; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      simd::prefetch_ahead(row + k, 128);
      const __m512bh w0 = load(row + k), w1 = load(row + k + 32);
      for (int m = 0; m < M; ++m) {
        a0[m] = _mm512_dpbf16_ps(a0[m], w0, load(x + m * K + k));
        a1[m] = _mm512_dpbf16_ps(a1[m], w1, load(x + m * K + k + 32));
      }
    }
    float sums[M];
    for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
    for (; k < K; ++k)
      for (int m = 0; m < M; ++m) sums[m] += static_cast<float>(row[k]) * static_cast<float>(x[m * K + k]);
    for (int m = 0; m < M; ++m) out[m * N + n] = static_cast<at::BFloat16>(sums[m] + (bias ? bias[n] : 0.f));
  }
}
#endif

// rows(n0, n1, m0, size) for each run of kRowsPerTask weight rows [n0, n1) and each group of x's rows
// [m0, m0 + size): the first group reads the run's weight rows from memory, the next ones find them in cache.
template <typename Rows>
void over_weight_rows(int64_t N, int64_t M, Rows&& rows) {
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t n0 = begin; n0 < end; n0 += kRowsPerTask) {
      const int64_t n1 = std::min(n0 + kRowsPerTask, end);
      for (int64_t m0 = 0; m0 < M; m0 += kGroupRows) {
        if (M - m0 >= 2) rows(n0, n1, m0, std::integral_constant<int, 2>{});
        else rows(n0, n1, m0, std::integral_constant<int, 1>{});
      }
    }
  });
}

template <typename w_t, typename out_t>
void run_widened(const float* x, int64_t M, const w_t* w, const float* bias, int64_t K, int64_t N, out_t* out) {
  over_weight_rows(N, M, [&](int64_t n0, int64_t n1, int64_t m0, auto size) {
    rows_widened<decltype(size)::value>(x + m0 * K, w, bias, K, N, n0, n1, out + m0 * N);
  });
}

}  // namespace

bool small_batch_linear_has_bf16_dot() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

int64_t small_batch_linear_max_rows() { return kMaxRows; }

// fp32 x with fp32, bf16 or fp16 weights (a 16-bit checkpoint computed in fp32 keeps its weights 16-bit), or
// bf16 x with bf16 weights.
bool small_batch_linear_reads(at::ScalarType x, at::ScalarType weight) {
  if (x == at::kFloat) return weight == at::kFloat || weight == at::kBFloat16 || weight == at::kHalf;
  return x == at::kBFloat16 && weight == at::kBFloat16;
}

// x [M, K] (M <= kMaxRows), weight [N, K] row-major, bias [N] or empty; dtypes as small_batch_linear_reads says.
// Returns [M, N] in x's dtype.
at::Tensor small_batch_linear(at::Tensor x, at::Tensor weight, at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K] and weight [N, K]");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "small_batch_linear takes 1 to ", kMaxRows, " rows");
  TORCH_CHECK(small_batch_linear_reads(x.scalar_type(), weight.scalar_type()),
              "small_batch_linear reads fp32 x with fp32, bf16 or fp16 weights, or bf16 x with bf16 weights; got ",
              x.scalar_type(), " x and ", weight.scalar_type(), " weights");
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(bias.numel() == 0 || bias.numel() == N, "bias must have one value per output");
  x = x.contiguous();
  const at::Tensor bias32 = bias.numel() ? bias.to(at::kFloat).contiguous() : bias;
  const float* b = bias.numel() ? bias32.data_ptr<float>() : nullptr;
  auto out = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kFloat) {
    const float* xf = x.data_ptr<float>();
    float* yf = out.data_ptr<float>();
    if (weight.scalar_type() == at::kFloat) run_widened(xf, M, weight.data_ptr<float>(), b, K, N, yf);
    else if (weight.scalar_type() == at::kBFloat16) run_widened(xf, M, weight.data_ptr<at::BFloat16>(), b, K, N, yf);
    else run_widened(xf, M, weight.data_ptr<at::Half>(), b, K, N, yf);
    return out;
  }
  const auto* w = weight.data_ptr<at::BFloat16>();
  auto* y = out.data_ptr<at::BFloat16>();
#if defined(__AVX512BF16__)
  const auto* xb = x.data_ptr<at::BFloat16>();
  over_weight_rows(N, M, [&](int64_t n0, int64_t n1, int64_t m0, auto size) {
    rows_bf16<decltype(size)::value>(xb + m0 * K, w, b, K, N, n0, n1, y + m0 * N);
  });
#else
  const at::Tensor x32 = x.to(at::kFloat);  // M x K: widened once, read once per weight row
  run_widened(x32.data_ptr<float>(), M, w, b, K, N, y);
#endif
  return out;
}
