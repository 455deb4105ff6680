// The index of each row's first maximum (CPU), as torch.max(dim=-1).indices gives it: a NaN is the maximum
// (the first one). torch's reduction over a vocabulary row costs many times its reading, and greedy decoding pays
// it every step for every row of the batch; a scalar loop with a branch per element still costs a tenth of a
// batch-32 decode step, so rows are scanned in vectors, split over the threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include <algorithm>
#include <cstring>
#include <cstdint>

namespace {

// By its bits: the kernels build with -ffast-math, under which std::isnan may be folded to false.
inline bool is_nan(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return (bits & 0x7fffffffu) > 0x7f800000u;
}

// The scalar rule: the first maximum, or the first NaN where there is one.
template <typename scalar_t>
int64_t first_argmax_scalar(const scalar_t* row, int64_t n) {
  int64_t best = 0;
  float best_value = static_cast<float>(row[0]);
  for (int64_t i = 0; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (is_nan(v)) return i;
    if (v > best_value) {
      best_value = v;
      best = i;
    }
  }
  return best;
}

#if defined(KVSERVE_SIMD)
using simd::Simd;

// NaN lanes by their bits (see is_nan), as a bit mask.
inline uint32_t nan_lanes(Simd::V v) {
#if defined(__AVX512F__)
  const __m512i magnitude = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(0x7fffffff));
  return _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7f800000));
#else
  const __m256i magnitude = _mm256_and_si256(_mm256_castps_si256(v), _mm256_set1_epi32(0x7fffffff));
  return _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(magnitude, _mm256_set1_epi32(0x7f800000))));
#endif
}

inline uint32_t equal_lanes(Simd::V a, Simd::V b) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ);
#else
  return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ));
#endif
}

// Two passes over the row (it stays in L2): the maximum and whether any lane is NaN, then the first lane equal
// to the maximum; a row with a NaN takes the scalar rule.
template <typename scalar_t>
int64_t first_argmax_row(const scalar_t* row, int64_t n) {
  constexpr int64_t kLanes = Simd::kLanes;
  const int64_t whole = n / (4 * kLanes) * (4 * kLanes);
  if (whole == 0) return first_argmax_scalar(row, n);
  Simd::V best[4] = {Simd::load(row), Simd::load(row), Simd::load(row), Simd::load(row)};
  uint32_t nans = 0;
  for (int64_t i = 0; i < whole; i += 4 * kLanes) {
    for (int k = 0; k < 4; ++k) {
      const Simd::V v = Simd::load(row + i + k * kLanes);
      nans |= nan_lanes(v);
      best[k] = Simd::max(best[k], v);
    }
  }
  float max_value = Simd::reduce_max(Simd::max(Simd::max(best[0], best[1]), Simd::max(best[2], best[3])));
  for (int64_t i = whole; i < n; ++i) {
    const float v = static_cast<float>(row[i]);
    if (is_nan(v)) ++nans;
    max_value = v > max_value ? v : max_value;
  }
  if (nans) return first_argmax_scalar(row, n);
  const Simd::V target = Simd::set1(max_value);
  for (int64_t i = 0; i < whole; i += kLanes)
    if (const uint32_t lanes = equal_lanes(Simd::load(row + i), target)) return i + __builtin_ctz(lanes);
  for (int64_t i = whole; i < n; ++i)
    if (static_cast<float>(row[i]) == max_value) return i;
  return 0;  // unreachable: the maximum is one of the row's values
}
#else
template <typename scalar_t>
int64_t first_argmax_row(const scalar_t* row, int64_t n) {
  return first_argmax_scalar(row, n);
}
#endif

}  // namespace

// logits [rows, n] (n >= 1), fp32 or bf16 -> int64 [rows].
at::Tensor first_argmax(at::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "logits [rows, n] with n >= 1");
  TORCH_CHECK(logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16, "fp32 or bf16");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* indices = out.data_ptr<int64_t>();
  // A batch's rows split over the threads; one row (a single stream) stays on the caller's.
  at::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      indices[r] = logits.scalar_type() == at::kFloat
          ? first_argmax_row(logits.data_ptr<float>() + r * n, n)
          : first_argmax_row(logits.data_ptr<at::BFloat16>() + r * n, n);
  });
  return out;
}
