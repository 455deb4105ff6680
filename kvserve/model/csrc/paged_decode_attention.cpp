// Decode attention straight over the paged KV cache, for CPUs.
//
// One query token per sequence. Each (sequence, KV head) pair is one task: its query heads (the GQA group)
// walk the sequence's blocks through the block table, so K and V are read exactly once, in place; nothing is
// gathered or padded. Scores and softmax are fp32; the output is written in the query's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

namespace {

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

// kHeadDim > 0 fixes the head size at compile time so the inner loops unroll into whole SIMD registers;
// 0 takes it from `runtime_head_dim`.
template <typename scalar_t, int kHeadDim>
void decode_task(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* table,
                 int64_t context_len, int64_t first_token, int64_t block_size, int64_t num_kv_heads,
                 int64_t kv_head, int64_t group, int64_t runtime_head_dim, float scale, scalar_t* out,
                 std::vector<float>& scores, std::vector<float>& acc, std::vector<float>& qf,
                 std::vector<float>& row) {
  const int64_t head_dim = kHeadDim > 0 ? kHeadDim : runtime_head_dim;
  const int64_t num_tokens = context_len - first_token;
  scores.assign(group * num_tokens, 0.f);
  acc.assign(group * head_dim, 0.f);
  qf.resize(group * head_dim);
  row.resize(head_dim);
  to_float(q, qf.data(), group * head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) qf[i] *= scale;
  const int64_t token_stride = num_kv_heads * head_dim;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t pos = first_token + t;
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    to_float(k_cache + slot * token_stride + kv_head * head_dim, row.data(), head_dim);
    const float* key = row.data();
    for (int64_t g = 0; g < group; ++g) {
      const float* qg = qf.data() + g * head_dim;
      float dot = 0.f;
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * key[d];
      scores[g * num_tokens + t] = dot;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores.data() + g * num_tokens;
    float max_score = s[0];  // not -inf: the kernel is built with -ffast-math, which assumes finite values
    for (int64_t t = 1; t < num_tokens; ++t) max_score = std::max(max_score, s[t]);
    float total = 0.f;
    for (int64_t t = 0; t < num_tokens; ++t) {
      s[t] = std::exp(s[t] - max_score);
      total += s[t];
    }
    const float inv = 1.f / total;
    for (int64_t t = 0; t < num_tokens; ++t) s[t] *= inv;
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t pos = first_token + t;
    const int64_t slot = table[pos / block_size] * block_size + pos % block_size;
    to_float(v_cache + slot * token_stride + kv_head * head_dim, row.data(), head_dim);
    const float* value = row.data();
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * num_tokens + t];
      float* a = acc.data() + g * head_dim;
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * value[d];
    }
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<scalar_t>(acc[i]);
}

}  // namespace

// q: [num_seqs, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
// block_tables: [num_seqs, max_blocks] int64; context_lens: [num_seqs] int64 (including the new token).
// sliding_window <= 0 means none. Returns [num_seqs, num_heads, head_dim].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window) {
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(), "inputs must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == torch::kLong, "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == torch::kLong, "context_lens: int64");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "KV cache and query must share a dtype");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  auto out = torch::empty_like(q);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention", [&] {
    const scalar_t* q_ptr = q.data_ptr<scalar_t>();
    const scalar_t* k_ptr = k_cache.data_ptr<scalar_t>();
    const scalar_t* v_ptr = v_cache.data_ptr<scalar_t>();
    scalar_t* out_ptr = out.data_ptr<scalar_t>();
    at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc, qf, row;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
        const int64_t context_len = lens[seq];
        const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, context_len - sliding_window) : 0;
        const int64_t offset = (seq * num_heads + kv_head * group) * head_dim;
        auto task_fn = head_dim == 64 ? decode_task<scalar_t, 64>
                       : head_dim == 128 ? decode_task<scalar_t, 128> : decode_task<scalar_t, 0>;
        task_fn(q_ptr + offset, k_ptr, v_ptr, tables + seq * max_blocks, context_len, first, block_size,
                num_kv_heads, kv_head, group, head_dim, static_cast<float>(scale), out_ptr + offset, scores, acc,
                qf, row);
      }
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
}
