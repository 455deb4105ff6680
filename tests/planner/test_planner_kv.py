"""KV bytes per token / block / request: the known values from the issue and the storage contract."""

import pytest

from kvserve.planner import PlannerError, kv_block_bytes, kv_bytes_per_request, kv_bytes_per_token, kv_format
from kvserve.planner.kv import (
    INT4_GROUP_SIZE,
    KV_CACHE_DTYPES,
    KV_SCALE_BYTES,
    explain_kv_bytes_per_token,
    kv_vector_bytes,
    tokens_held_by_layer,
)
from kvserve.planner.registry import registry_spec

GiB = 1024**3


def test_llama2_7b_fp16_is_half_a_mebibyte_per_token_and_2_gib_at_4096():
    spec = registry_spec("meta-llama/Llama-2-7b-hf")
    assert kv_bytes_per_token(spec, "auto", "float16") == 524_288
    assert kv_bytes_per_request(spec, 4096, "auto", "float16") == 2 * GiB


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ("meta-llama/Meta-Llama-3-70B", 327_680),
        ("meta-llama/Llama-3.1-70B-Instruct", 327_680),
        ("Qwen/Qwen2.5-7B-Instruct", 57_344),
        ("Qwen/Qwen2.5-14B-Instruct", 196_608),
        ("meta-llama/Llama-2-13b-hf", 819_200),
        ("deepseek-ai/DeepSeek-V3", 61 * 576 * 2),
    ],
)
def test_known_bytes_per_token(model, expected):
    assert kv_bytes_per_token(registry_spec(model)) == expected


def test_deepseek_v3_mla_is_one_latent_per_layer_and_not_split_by_tp():
    spec = registry_spec("deepseek-ai/DeepSeek-V3")
    assert kv_bytes_per_token(spec) == 70_272
    assert kv_bytes_per_token(spec, tensor_parallel_size=8) == 70_272
    assert "no ×2" in explain_kv_bytes_per_token(spec, kv_format("auto"))


def test_gemma2_9b_uses_config_head_dim_and_windows_half_its_layers():
    spec = registry_spec("google/gemma-2-9b-it")
    assert spec.head_dim == 256 != spec.hidden_size // spec.num_attention_heads
    assert spec.windowed_layers == tuple(range(0, 42, 2))
    per_layer_token = 2 * 8 * 256 * 2
    assert kv_bytes_per_token(spec) == 42 * per_layer_token
    # At 8192 tokens the 21 global layers hold everything, the 21 windowed layers only 4096.
    assert kv_bytes_per_request(spec, 8192) == (21 * 8192 + 21 * 4096) * per_layer_token
    # Below the window nothing is saved.
    assert kv_bytes_per_request(spec, 4000) == 4000 * kv_bytes_per_token(spec)


def test_fp8_halves_and_tp2_halves_per_gpu():
    spec = registry_spec("Qwen/Qwen2.5-14B-Instruct")
    full = kv_bytes_per_token(spec)
    assert kv_bytes_per_token(spec, "fp8") == full // 2
    assert kv_bytes_per_token(spec, "fp8_e5m2") == full // 2
    assert kv_bytes_per_token(spec, tensor_parallel_size=2) == full // 2
    assert kv_bytes_per_token(spec, "fp8", tensor_parallel_size=2) == full // 4


def test_int8_and_int4_include_their_scales():
    spec = registry_spec("Qwen/Qwen2.5-14B-Instruct")  # 48 layers, 8 KV heads, head_dim 128
    assert kv_bytes_per_token(spec, "int8") == 2 * 48 * 8 * (128 + 1)  # one exponent byte per vector
    # int4: V's codes and fp16 scales per token; K's codes per token and 2 bytes per channel per 16-token block
    values = 64 + 128 // INT4_GROUP_SIZE * KV_SCALE_BYTES
    assert kv_bytes_per_token(spec, "int4") == 48 * 8 * (values + 64 + 128 * 2 // 16)
    assert kv_block_bytes(spec, 32, "int4") == 48 * 8 * (32 * (values + 64) + 128 * 2)
    assert kv_bytes_per_token(spec, "bfloat16") / kv_bytes_per_token(spec, "int4") >= 3.2


def test_kv_format_contract():
    assert kv_format("auto", "float16").name == "float16"
    assert kv_format("auto").name == "bfloat16"
    assert kv_format("fp8").name == "fp8_e4m3"
    int8, int4 = kv_format("int8"), kv_format("int4")
    assert (int8.bits, int8.group_size, int8.scale_bytes) == (8, None, 1)
    assert (int4.bits, int4.group_size, int4.scale_bytes) == (4, 32, 2)
    assert kv_format("fp8").scale_bytes == 0
    assert set(KV_CACHE_DTYPES) == {"auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2",
                                    "int8", "int4"}
    # A partial last int4 group still gets a scale: head_dim 80 -> 3 groups.
    assert kv_vector_bytes(int4, 80) == 40 + 3 * 2
    with pytest.raises(PlannerError, match="kv-cache-dtype"):
        kv_format("int3")


def test_block_bytes_are_block_size_tokens_across_all_layers():
    spec = registry_spec("meta-llama/Llama-3.1-8B-Instruct")
    assert kv_block_bytes(spec, 16) == 16 * kv_bytes_per_token(spec)
    assert kv_block_bytes(spec, 32, "int8", tensor_parallel_size=2) == 32 * kv_bytes_per_token(spec, "int8",
                                                                                                tensor_parallel_size=2)
    with pytest.raises(PlannerError, match="block-size"):
        kv_block_bytes(spec, 0)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    spec = registry_spec("meta-llama/Meta-Llama-3-70B")  # 64 heads, 8 KV heads
    assert kv_bytes_per_token(spec, tensor_parallel_size=8) == 2 * 80 * 1 * 128 * 2
    assert kv_bytes_per_token(spec, tensor_parallel_size=16) == 2 * 80 * 1 * 128 * 2


def test_tp_that_does_not_divide_heads_is_a_clear_error():
    spec = registry_spec("Qwen/Qwen2.5-14B-Instruct")  # 40 heads, 8 KV heads
    with pytest.raises(PlannerError, match="does not divide .* 40 attention heads; valid TP sizes: 1, 2, 4, 8"):
        kv_bytes_per_token(spec, tensor_parallel_size=16)
    with pytest.raises(PlannerError, match="8 KV heads"):
        kv_bytes_per_token(spec, tensor_parallel_size=5)
    with pytest.raises(PlannerError):
        kv_bytes_per_token(spec, tensor_parallel_size=0)


def test_pipeline_parallel_counts_the_most_loaded_stage():
    spec = registry_spec("meta-llama/Llama-2-7b-hf")  # 32 layers
    per_layer = kv_bytes_per_token(spec) // 32
    assert kv_bytes_per_token(spec, pipeline_parallel_size=2) == 16 * per_layer
    assert kv_bytes_per_token(spec, pipeline_parallel_size=3) == 11 * per_layer  # stages 11, 11, 10


def test_windowed_layers_hold_whole_blocks_with_one_straddling_block():
    spec = registry_spec("mistralai/Mistral-7B-v0.1")  # window 4096 on every layer
    assert tokens_held_by_layer(spec, 0, 10_000) == 4096
    # The last query (position 9,999) sees 5,904..9,999: blocks 369..624, 256 whole blocks. One token later the
    # window starts inside block 369 and reaches into block 625: one more.
    assert tokens_held_by_layer(spec, 0, 10_000, block_size=16) == 4096
    assert tokens_held_by_layer(spec, 0, 10_001, block_size=16) == (4096 // 16 + 1) * 16
    assert tokens_held_by_layer(spec, 0, 100, block_size=16) == 112
    with pytest.raises(PlannerError):
        kv_bytes_per_request(spec, -1)


def test_explanation_shows_the_arithmetic():
    spec = registry_spec("Qwen/Qwen2.5-14B-Instruct")
    assert explain_kv_bytes_per_token(spec, kv_format("auto")) == (
        "2 (K,V) × 48 layers × 8 KV heads × 128 × 2 B = 192 KiB"
    )
    assert "4 KV heads/GPU (8 ÷ TP 2)" in explain_kv_bytes_per_token(spec, kv_format("auto"), 2)
    assert "48 layers × 8 KV heads × (K 128 × 0.5 B + 128 × 2 B / 16-token block + V 128 × 0.5 B + 4 × 2 B)" in \
        explain_kv_bytes_per_token(spec, kv_format("int4"))
