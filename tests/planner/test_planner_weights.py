"""Weight bytes from the architecture: parameter counts match the published totals, quantization, TP split."""

import pytest

from kvserve.planner.quant import WeightQuant, quant_from_config, quant_from_flag
from kvserve.planner.registry import registry_spec
from kvserve.planner.weights import Matrix, estimate_weights, matrix_bytes, total_params

GiB = 1024**3


@pytest.mark.parametrize(
    ("model", "params"),
    [("meta-llama/Llama-2-7b-hf", 6_738_415_616), ("meta-llama/Meta-Llama-3-8B", 8_030_261_248),
     ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512), ("mistralai/Mixtral-8x7B-Instruct-v0.1", 46_702_792_704),
     ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768)],
)
def test_parameter_counts_match_published_totals(model, params):
    assert total_params(registry_spec(model)) == params


def test_deepseek_v3_is_671b_without_its_mtp_layer_and_ships_fp8():
    spec = registry_spec("deepseek-ai/DeepSeek-V3")
    assert total_params(spec) == pytest.approx(671e9, rel=0.001)
    weights = estimate_weights(spec, "bfloat16")
    assert weights.quant.method == "fp8"
    assert 620 * GiB < weights.total_bytes < 635 * GiB


def test_unquantized_bytes_are_params_times_dtype():
    spec = registry_spec("Qwen/Qwen2.5-14B-Instruct")
    weights = estimate_weights(spec, "bfloat16")
    assert weights.total_bytes == weights.per_gpu_bytes == 2 * total_params(spec)
    assert "14.77 B params × 2 B (bfloat16)" in weights.formula


def test_awq_int4_llama2_7b_matches_the_usual_checkpoint_size():
    weights = estimate_weights(registry_spec("meta-llama/Llama-2-7b-hf"), "float16", quant_from_flag("awq"))
    assert 3.85e9 < weights.total_bytes < 3.95e9  # AWQ checkpoints of Llama-2-7B are 3.89 GB


def test_fp8_roughly_halves_decoder_weights():
    spec = registry_spec("meta-llama/Llama-3.1-8B-Instruct")
    bf16 = estimate_weights(spec, "bfloat16").total_bytes
    fp8 = estimate_weights(spec, "bfloat16", quant_from_flag("fp8")).total_bytes
    embeddings = 2 * 128256 * 4096 * 2
    assert fp8 == pytest.approx((bf16 - embeddings) / 2 + embeddings, rel=0.001)


def test_tensor_parallel_splits_weights():
    spec = registry_spec("meta-llama/Llama-3.1-70B-Instruct")
    one = estimate_weights(spec, "bfloat16")
    four = estimate_weights(spec, "bfloat16", tensor_parallel_size=4)
    assert four.total_bytes == one.total_bytes
    assert one.total_bytes / 4 < four.per_gpu_bytes < one.total_bytes / 4 * 1.001  # norms are replicated


def test_pipeline_parallel_puts_a_tied_head_on_the_last_stage():
    spec = registry_spec("meta-llama/Llama-3.2-1B-Instruct")
    two_stages = estimate_weights(spec, "bfloat16", pipeline_parallel_size=2)
    embedding = 128256 * 2048 * 2
    assert two_stages.per_gpu_bytes > (2 * total_params(spec)) / 2  # each stage holds a copy of the vocab matrix
    assert two_stages.per_gpu_bytes < 2 * total_params(spec) / 2 + embedding


def test_quantized_matrix_bytes():
    matrix = Matrix("w", 4096, 4096)
    assert matrix_bytes(matrix, WeightQuant(), 2) == 4096 * 4096 * 2
    assert matrix_bytes(matrix, WeightQuant("fp8", 8, block_shape=(128, 128)), 2) == 4096 * 4096 + 32 * 32 * 4
    awq = matrix_bytes(matrix, WeightQuant("awq", 4, group_size=128), 2)
    assert awq == 4096 * 4096 // 2 + 32 * 4096 * 2 + 32 * 4096 // 8 * 4
    router = Matrix("router", 4096, 8, quantizable=False)
    assert matrix_bytes(router, WeightQuant("awq", 4, group_size=128), 2) == 4096 * 8 * 2


def test_quantization_config_parsing():
    assert quant_from_config({"quant_method": "awq", "bits": 4, "group_size": 64}) == (WeightQuant("awq", 4, 64), "")
    assert quant_from_config(None) == (None, "")
    quant, note = quant_from_config({"quant_method": "bitsandbytes"})
    assert quant is None and "not modelled" in note
