// The Python module of one ISA family's kernels: the only file that includes torch/extension.h (pybind11 and
// torch's whole C++ API, several times the compile time of ATen alone), so the kernel files include ATen only.
#include <torch/extension.h>

// paged_attention.cpp
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     int64_t sliding_window, torch::Tensor shared_lens, torch::Tensor shared_leaders);
torch::Tensor paged_decode_attention_quantized(torch::Tensor q, torch::Tensor k_data, torch::Tensor v_data,
                                               torch::Tensor k_scales, torch::Tensor v_scales, double k_tensor_scale,
                                               double v_tensor_scale, int64_t format, torch::Tensor block_tables,
                                               torch::Tensor context_lens, double scale, int64_t sliding_window,
                                               torch::Tensor shared_lens, torch::Tensor shared_leaders);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
void rotary_qk_(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_cache, torch::Tensor sin_cache,
                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim);
torch::Tensor silu_and_mul(torch::Tensor gate_up);

// kv_quantize.cpp
void write_quantized_kv(torch::Tensor key, torch::Tensor value, torch::Tensor slot_mapping, torch::Tensor k_data,
                        torch::Tensor v_data, torch::Tensor k_scales, torch::Tensor v_scales, double k_tensor_scale,
                        double v_tensor_scale, int64_t format);
void write_kv(torch::Tensor key, torch::Tensor value, torch::Tensor slot_mapping, torch::Tensor k_cache,
              torch::Tensor v_cache);
void write_int4_keys(torch::Tensor key, torch::Tensor plan, torch::Tensor codes, torch::Tensor channels,
                     torch::Tensor stage);

// prefill_attention.cpp, prefill_attention_fp32.cpp
void paged_prefill_attention_bf16(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                  torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor num_past,
                                  double scale, int64_t sliding_window, torch::Tensor out);
bool has_prefill_attention_bf16();
void paged_prefill_attention_fp32(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                  torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor num_past,
                                  double scale, int64_t sliding_window, torch::Tensor out);
int64_t prefill_attention_fp32_head_dim_multiple();
void paged_prefill_attention_fp32_quantized(torch::Tensor q, torch::Tensor k_data, torch::Tensor v_data,
                                            torch::Tensor k_scales, torch::Tensor v_scales, double k_tensor_scale,
                                            double v_tensor_scale, int64_t format, torch::Tensor block_tables,
                                            torch::Tensor query_starts, torch::Tensor num_past, double scale,
                                            int64_t sliding_window, torch::Tensor out);
void paged_prefill_attention_bf16_quantized(torch::Tensor q, torch::Tensor k_data, torch::Tensor v_data,
                                            torch::Tensor k_scales, torch::Tensor v_scales, double k_tensor_scale,
                                            double v_tensor_scale, int64_t format, torch::Tensor block_tables,
                                            torch::Tensor query_starts, torch::Tensor num_past, double scale,
                                            int64_t sliding_window, torch::Tensor out);

// small_batch_linear.cpp
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor weight, torch::Tensor bias);
bool small_batch_linear_has_bf16_dot();
int64_t small_batch_linear_max_rows();

// argmax.cpp
torch::Tensor first_argmax(torch::Tensor logits);

// quant_linear.cpp
void quant_linear_out(torch::Tensor x, torch::Tensor blocks, int64_t type, torch::Tensor bias, torch::Tensor out,
                      int64_t col);
void quant_rows_out(torch::Tensor blocks, int64_t type, torch::Tensor ids, torch::Tensor out);
bool quant_linear_reads(int64_t type);
bool quant_linear_uses_amx();
bool quant_linear_int8_batches(int64_t type, bool bf16_x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_prefill_attention_bf16", &paged_prefill_attention_bf16,
        "prefill attention over a paged KV cache, all segments of a step in one call (CPU, bf16, AVX512-BF16)");
  m.def("has_prefill_attention_bf16", &has_prefill_attention_bf16, "whether the bf16 prefill kernel was built");
  m.def("paged_prefill_attention_fp32", &paged_prefill_attention_fp32,
        "prefill attention over a paged KV cache, all segments of a step in one call (CPU, fp32, AVX2 or AVX-512)");
  m.def("prefill_attention_fp32_head_dim_multiple", &prefill_attention_fp32_head_dim_multiple,
        "head_dim multiple the fp32 prefill kernel needs (0: not built)");
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("paged_decode_attention_quantized", &paged_decode_attention_quantized,
        "decode attention over a paged fp8/int8/int4 KV cache (CPU)");
  m.def("paged_prefill_attention_fp32_quantized", &paged_prefill_attention_fp32_quantized,
        "fp32 prefill attention over a paged fp8/int8/int4 KV cache (CPU, AVX2 or AVX-512)");
  m.def("paged_prefill_attention_bf16_quantized", &paged_prefill_attention_bf16_quantized,
        "bf16 prefill attention over a paged fp8/int8/int4 KV cache (CPU, AVX512-BF16)");
  m.def("write_kv", &write_kv, "copy new K/V rows into their slots of an unquantized cache (CPU)");
  m.def("write_int4_keys", &write_int4_keys, "quantize int4 keys block by block from their staged originals (CPU)");
  m.def("write_quantized_kv", &write_quantized_kv, "quantize new K/V rows into their slots of an fp8/int8/int4 cache (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x, then RMSNorm of the residual (CPU)");
  m.def("rotary_qk_", &rotary_qk_, "rotary embedding in place on q and k of a fused qkv tensor (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up (CPU)");
  m.def("small_batch_linear", &small_batch_linear, "x @ weight.T (+ bias) for 1-2 rows over a plain weight (CPU)");
  m.def("small_batch_linear_has_bf16_dot", &small_batch_linear_has_bf16_dot, "whether bf16 x bf16 uses AVX512-BF16");
  m.def("small_batch_linear_max_rows", &small_batch_linear_max_rows, "the most rows small_batch_linear takes");
  m.def("first_argmax", &first_argmax, "each row's first maximum, as torch.max(dim=-1).indices (CPU)");
  m.def("quant_linear_out", &quant_linear_out,
        "out[:, col:col+N] = x @ W.T (+ bias), W held as rows of GGUF blocks, any batch size (CPU)");
  m.def("quant_rows_out", &quant_rows_out, "rows of a weight held as GGUF blocks, decoded (embedding lookup) (CPU)");
  m.def("quant_linear_reads", &quant_linear_reads, "whether quant_linear reads this ggml type");
  m.def("quant_linear_uses_amx", &quant_linear_uses_amx, "whether batched decode over blocks runs on AMX tiles");
  m.def("quant_linear_int8_batches", &quant_linear_int8_batches,
        "whether more than 8 rows of x (bf16 or fp32) over blocks of this ggml type are quantized to int8");
}
