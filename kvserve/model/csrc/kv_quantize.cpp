// Writing new K/V into the cache in one call per layer (CPU); for a quantized cache each (token, KV head) row is quantized
// and stored at its slot, with its scales. Bit-identical to kvserve/cache/storage/kv_quant.py's encoders (the same fp32
// operations in the same order, round half to even, fp16 and fp8 conversions by c10's), which replace the
// chain of ~25 torch ops per layer and step that the portable path runs. Both multiply by the scale's
// reciprocal rather than divide: -ffast-math would turn a division into that anyway, in some loops and not
// others, and values exactly between two codes would round differently.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kv_dequant.h"

namespace {

constexpr int kScaleMinExponent = -20, kScaleMaxExponent = 11, kScaleExponentBias = 20;

// kv_quant.encode_scale_byte / decode_scale_byte for one value.
inline uint8_t encode_scale_byte(float scale) {
  int exponent = 0;
  const float mantissa = std::frexp(std::max(scale, std::ldexp(1.f, kScaleMinExponent)), &exponent);
  exponent -= 1;
  float steps = std::ceil((mantissa * 2.f - 1.f) * 8.f);
  if (steps == 8.f) {
    exponent += 1;
    steps = 0.f;
  }
  if (exponent > kScaleMaxExponent) {
    exponent = kScaleMaxExponent;
    steps = 7.f;
  }
  return static_cast<uint8_t>((exponent + kScaleExponentBias) * 8 + static_cast<int>(steps));
}

inline float decode_scale_byte(uint8_t code) {
  return std::ldexp(1.f + static_cast<float>(code & 7) / 8.f, (code >> 3) - kScaleExponentBias);
}

inline float round_half_even(float x) { return std::nearbyint(x); }

void quantize_int8(const float* x, int64_t dim, int8_t* out, uint8_t* scale_out) {
  float absmax = 0.f;
  for (int64_t d = 0; d < dim; ++d) absmax = std::max(absmax, std::fabs(x[d]));
  const uint8_t code = encode_scale_byte(absmax / 127.f);
  const float inverse = 1.f / decode_scale_byte(code);
  for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<int8_t>(std::clamp(round_half_even(x[d] * inverse), -127.f, 127.f));
  *scale_out = code;
}

void quantize_int4(const float* x, int64_t dim, uint8_t* out, at::Half* scales_out) {
  const int64_t groups = (dim + kvq::kInt4Group - 1) / kvq::kInt4Group;
  std::vector<uint8_t> codes(dim);
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t begin = g * kvq::kInt4Group, end = std::min(dim, begin + kvq::kInt4Group);
    float absmax = 0.f;  // a partial last group's zero padding does not change its absmax
    for (int64_t d = begin; d < end; ++d) absmax = std::max(absmax, std::fabs(x[d]));
    const at::Half stored(std::clamp(absmax / 7.f, 0x1p-14f, 65504.f));  // kv_quant._symmetric_scales
    const float inverse = 1.f / static_cast<float>(stored);
    for (int64_t d = begin; d < end; ++d)
      codes[d] = static_cast<uint8_t>(std::clamp(round_half_even(x[d] * inverse), -7.f, 7.f) + 8.f);
    scales_out[g] = stored;
  }
  for (int64_t i = 0; i < dim / 2; ++i) out[i] = codes[2 * i] | (codes[2 * i + 1] << 4);
}

template <typename fp8_t>
void quantize_fp8(const float* x, int64_t dim, float tensor_scale, uint8_t* out) {
  const float limit = static_cast<float>(std::numeric_limits<fp8_t>::max());
  const float inverse = 1.f / tensor_scale;
  for (int64_t d = 0; d < dim; ++d) {
    const fp8_t value(std::clamp(x[d] * inverse, -limit, limit));
    out[d] = value.x;
  }
}

struct Target {
  uint8_t* data;
  void* scales;
  float tensor_scale;
};

void quantize_row(const float* x, int64_t dim, int64_t format, int64_t row, const Target& target) {
  switch (format) {
    case kvq::kInt8:
      return quantize_int8(x, dim, reinterpret_cast<int8_t*>(target.data) + row * dim,
                           static_cast<uint8_t*>(target.scales) + row);
    case kvq::kInt4: {
      const int64_t groups = (dim + kvq::kInt4Group - 1) / kvq::kInt4Group;
      return quantize_int4(x, dim, target.data + row * (dim / 2), static_cast<at::Half*>(target.scales) + row * groups);
    }
    case kvq::kFp8E4m3:
      return quantize_fp8<c10::Float8_e4m3fn>(x, dim, target.tensor_scale, target.data + row * dim);
    default:
      return quantize_fp8<c10::Float8_e5m2>(x, dim, target.tensor_scale, target.data + row * dim);
  }
}

Target make_target(const at::Tensor& data, const at::Tensor& scales, double tensor_scale, int64_t format) {
  TORCH_CHECK(data.is_contiguous() && data.element_size() == 1, "quantized KV data: contiguous bytes");
  const bool scaled = format == kvq::kInt8 || format == kvq::kInt4;
  TORCH_CHECK(!scaled || scales.is_contiguous(), "KV scales must be contiguous");
  return Target{static_cast<uint8_t*>(data.data_ptr()), scaled ? scales.data_ptr() : nullptr,
                static_cast<float>(tensor_scale)};
}

// kv_quant._key_step_fits: whether 16 levels of this step byte from an integer zero point in int8 cover [low, high].
inline bool key_step_fits(int code, float low, float high) {
  const float step = decode_scale_byte(static_cast<uint8_t>(code));
  const float zero = std::floor(low * (1.f / step));
  return zero >= -128.f && zero <= 127.f && (zero + 15.f) * step >= high;
}

// kv_quant.encode_int4_key_block for one KV head: rows [n, dim] (row stride dim) -> each row's packed codes
// (row r at codes + r * codes_stride) and the block's channel bytes [2, dim].
void encode_int4_key_block(const float* rows, int64_t n, int64_t dim, uint8_t* codes, int64_t codes_stride,
                           uint8_t* channel) {
  std::vector<uint8_t> levels(n * dim);
  for (int64_t c = 0; c < dim; ++c) {
    float low = rows[c], high = rows[c];
    for (int64_t r = 1; r < n; ++r) {
      low = std::min(low, rows[r * dim + c]);
      high = std::max(high, rows[r * dim + c]);
    }
    const int first = encode_scale_byte(std::max((high - low) * (1.f / 15.f), std::fabs(low) * (1.f / 127.f)));
    int chosen = std::min(first + 2, 255);
    for (int bump = 1; bump >= 0; --bump)
      if (key_step_fits(std::min(first + bump, 255), low, high)) chosen = std::min(first + bump, 255);
    const float inverse = 1.f / decode_scale_byte(static_cast<uint8_t>(chosen));
    const float zero = std::clamp(std::floor(low * inverse), -128.f, 127.f);
    channel[c] = static_cast<uint8_t>(chosen);
    channel[dim + c] = static_cast<uint8_t>(static_cast<int8_t>(zero));
    for (int64_t r = 0; r < n; ++r)
      levels[r * dim + c] = static_cast<uint8_t>(std::clamp(round_half_even(rows[r * dim + c] * inverse) - zero, 0.f, 15.f));
  }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t start = 0; start < dim; start += 64) {
      const int64_t half = std::min<int64_t>(64, dim - start) / 2;
      for (int64_t j = 0; j < half; ++j)
        codes[r * codes_stride + start / 2 + j] = levels[r * dim + start + j] | levels[r * dim + start + half + j] << 4;
    }
}

// A row of `dim` elements of a float tensor's dtype (fp32, bf16 or fp16) as fp32, and back.
void load_row(const void* base, at::ScalarType type, int64_t index, int64_t dim, float* out) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "load_row", [&] {
    const scalar_t* row = static_cast<const scalar_t*>(base) + index * dim;
    for (int64_t d = 0; d < dim; ++d) out[d] = static_cast<float>(row[d]);
  });
}

void store_row(void* base, at::ScalarType type, int64_t index, int64_t dim, const float* in) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, type, "store_row", [&] {
    scalar_t* row = static_cast<scalar_t*>(base) + index * dim;
    for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<scalar_t>(in[d]);
  });
}

}  // namespace

// int4 keys, block by block, as LayerKVCache._write_int4_keys does (bit-identical). plan: [runs, 6] int64 from
// cache/key_staging.py, one row per stretch of a block this step writes: (block, first token, first offset lo,
// last offset hi, staging row or -1, rows to decode). Rows [0, lo) of the block come from its staging row, after
// its first `decode` rows are filled from the cache's own codes (a row the staging had no room for); with no
// staging row, straight from the codes. The stretch's keys are stored into the staging row (in its dtype), and
// the block's rows [0, hi] are quantized together. key: [tokens, kv_heads, head_dim] (dense rows); codes:
// [blocks, block_size, kv_heads, head_dim / 2] uint8; channels: [blocks, kv_heads, 2, head_dim] uint8; stage:
// [rows, block_size, kv_heads, head_dim] (fp32, bf16 or fp16; may be empty when no plan row uses it).
void write_int4_keys(at::Tensor key, at::Tensor plan, at::Tensor codes, at::Tensor channels,
                     at::Tensor stage) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1, "key: [tokens, kv_heads, head_dim] with dense rows");
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.is_contiguous() && plan.dim() == 2 && plan.size(1) == 6,
              "plan: [runs, 6] int64");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte && channels.is_contiguous() &&
              channels.scalar_type() == at::kByte, "codes, channels: contiguous uint8");
  TORCH_CHECK(stage.is_contiguous(), "stage: contiguous");
  const int64_t heads = key.size(1), dim = key.size(2), block_size = codes.size(1), num_blocks = codes.size(0);
  TORCH_CHECK(dim % 2 == 0 && codes.size(2) == heads && codes.size(3) == dim / 2 && channels.size(0) == num_blocks &&
              channels.size(1) == heads && channels.size(2) == 2 && channels.size(3) == dim, "int4 key cache shapes");
  const int64_t runs = plan.size(0);
  const int64_t* entries = plan.data_ptr<int64_t>();
  for (int64_t r = 0; r < runs; ++r) {
    const int64_t* e = entries + r * 6;
    TORCH_CHECK(e[0] >= 0 && e[0] < num_blocks && 0 <= e[2] && e[2] <= e[3] && e[3] < block_size && e[1] >= 0 &&
                e[1] + e[3] - e[2] < key.size(0) && e[5] <= e[2] && (e[4] < 0 || e[4] < stage.size(0)),
                "write_int4_keys: bad plan row ", r);
  }
  const kvq::Source cached{codes.data_ptr<uint8_t>(), channels.data_ptr<uint8_t>(), 1.f, kvq::kInt4, dim, heads,
                           block_size};
  // Stretches of one block must run in order (the engine never writes a block twice in a step; a profiling pass
  // that maps every token to one slot does).
  std::vector<int64_t> blocks(runs);
  for (int64_t r = 0; r < runs; ++r) blocks[r] = entries[r * 6];
  std::sort(blocks.begin(), blocks.end());
  const bool repeated = std::adjacent_find(blocks.begin(), blocks.end()) != blocks.end();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_int4_keys", [&] {
    at::parallel_for(0, runs * heads, repeated ? runs * heads : 1, [&](int64_t begin, int64_t end) {
      std::vector<float> rows(block_size * dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t* e = entries + (i / heads) * 6;
        const int64_t h = i % heads, block = e[0], first = e[1], lo = e[2], hi = e[3], row = e[4], decode = e[5];
        const int64_t stage_base = (row * block_size) * heads + h;  // stage index of (row, offset 0, h), in rows of dim
        for (int64_t o = 0; o < lo; ++o) {
          if (row < 0 || o < decode) cached.decode(block * block_size + o, h, rows.data() + o * dim);
          if (row >= 0 && o < decode) store_row(stage.data_ptr(), stage.scalar_type(), stage_base + o * heads, dim, rows.data() + o * dim);
          if (row >= 0) load_row(stage.data_ptr(), stage.scalar_type(), stage_base + o * heads, dim, rows.data() + o * dim);
        }
        for (int64_t o = lo; o <= hi; ++o) {
          const scalar_t* x = key.data_ptr<scalar_t>() + (first + o - lo) * key.stride(0) + h * key.stride(1);
          for (int64_t d = 0; d < dim; ++d) rows[o * dim + d] = static_cast<float>(x[d]);
          if (row >= 0) store_row(stage.data_ptr(), stage.scalar_type(), stage_base + o * heads, dim, rows.data() + o * dim);
        }
        uint8_t* block_codes = codes.data_ptr<uint8_t>() + (block * block_size * heads + h) * (dim / 2);
        encode_int4_key_block(rows.data(), hi + 1, dim, block_codes, heads * (dim / 2),
                              channels.data_ptr<uint8_t>() + (block * heads + h) * 2 * dim);
      }
    });
  });
}

// key, value: [tokens, num_kv_heads, head_dim] in the model's dtype (any token/head strides, dense rows);
// slot_mapping: [tokens] int64; the caches as paged_decode_attention_quantized takes them. For int4 only the
// values: its keys are written by write_int4_keys.
void write_quantized_kv(at::Tensor key, at::Tensor value, at::Tensor slot_mapping, at::Tensor k_data,
                        at::Tensor v_data, at::Tensor k_scales, at::Tensor v_scales, double k_tensor_scale,
                        double v_tensor_scale, int64_t format) {
  TORCH_CHECK(format >= kvq::kFp8E4m3 && format <= kvq::kInt4, "unknown quantized KV format ", format);
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.dim() == 3 && value.stride(2) == 1,
              "key, value: [tokens, kv_heads, head_dim] with dense rows");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(format != kvq::kInt4 || dim % 2 == 0, "int4 needs an even head_dim");
  const Target targets[2] = {make_target(k_data, k_scales, k_tensor_scale, format),
                             make_target(v_data, v_scales, v_tensor_scale, format)};
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, key.scalar_type(), "write_quantized_kv", [&] {
    const at::Tensor* sources[2] = {&key, &value};
    const int first = format == kvq::kInt4 ? 1 : 0;  // int4 keys are written per block (write_int4_keys)
    at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
      std::vector<float> row(dim);
      for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / heads, h = i % heads;
        for (int which = first; which < 2; ++which) {
          const at::Tensor& source = *sources[which];
          const scalar_t* x = source.data_ptr<scalar_t>() + t * source.stride(0) + h * source.stride(1);
          for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<float>(x[d]);
          quantize_row(row.data(), dim, format, slots[t] * heads + h, targets[which]);
        }
      }
    });
  });
}

// The same for an unquantized cache (k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] in the
// model's dtype or, under an fp32 model, bf16/fp16): each row copied, or rounded to the cache's dtype as
// Tensor.to rounds it. One call per layer instead of two index_copy_ and their views (~15 us a layer of a
// single stream's decode step).
void write_kv(at::Tensor key, at::Tensor value, at::Tensor slot_mapping, at::Tensor k_cache,
              at::Tensor v_cache) {
  TORCH_CHECK(key.dim() == 3 && key.stride(2) == 1 && value.dim() == 3 && value.stride(2) == 1,
              "key, value: [tokens, kv_heads, head_dim] with dense rows");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous(), "slot_mapping: int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type(),
              "caches: contiguous, one dtype");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key and value: one dtype");
  const int64_t tokens = key.size(0), heads = key.size(1), dim = key.size(2);
  TORCH_CHECK(k_cache.size(2) == heads && k_cache.size(3) == dim, "caches: [blocks, block_size, ", heads, ", ", dim, "]");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  auto copy = [&](auto* source_tag, auto* cache_tag) {
    using source_t = std::remove_pointer_t<decltype(source_tag)>;
    using cache_t = std::remove_pointer_t<decltype(cache_tag)>;
    const at::Tensor* sources[2] = {&key, &value};
    cache_t* caches[2] = {k_cache.data_ptr<cache_t>(), v_cache.data_ptr<cache_t>()};
    for (int which = 0; which < 2; ++which) {
      const at::Tensor& source = *sources[which];
      const source_t* base = source.data_ptr<source_t>();
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const source_t* x = base + t * source.stride(0) + h * source.stride(1);
          cache_t* row = caches[which] + (slots[t] * heads + h) * dim;
          for (int64_t d = 0; d < dim; ++d) row[d] = static_cast<cache_t>(x[d]);
        }
    }
  };
  const auto cache_type = k_cache.scalar_type();
  if (key.scalar_type() == cache_type) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, cache_type, "write_kv", [&] {
      copy(static_cast<scalar_t*>(nullptr), static_cast<scalar_t*>(nullptr));
    });
  } else {
    TORCH_CHECK(key.scalar_type() == at::kFloat && (cache_type == at::kBFloat16 || cache_type == at::kHalf),
                "key/value in the cache's dtype, or fp32 into a bf16/fp16 cache");
    if (cache_type == at::kBFloat16) copy(static_cast<float*>(nullptr), static_cast<at::BFloat16*>(nullptr));
    else copy(static_cast<float*>(nullptr), static_cast<at::Half*>(nullptr));
  }
}
