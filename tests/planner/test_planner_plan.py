"""make_plan: the figures the CLI prints, exact, and the block count the engine must reproduce."""

from dataclasses import replace

import pytest

from kvserve.planner import kv_block_bytes, kv_pool_bytes, num_blocks_for_pool
from kvserve.planner.gpus import lookup_gpu
from kvserve.planner.plan import FITS, OVERCOMMITTED, STARTUP_ERROR, PlanRequest, make_plan
from kvserve.planner.registry import registry_spec

GiB, MiB = 1024**3, 1024**2
QWEN_14B_PARAMS = 14_770_033_664


def test_qwen14b_on_a100_80gb_figures_are_exact():
    spec = registry_spec("Qwen/Qwen2.5-14B-Instruct")
    request = PlanRequest(gpu="A100-80GB", max_model_len=32768, max_num_seqs=32, avg_context_len=16384,
                          activation_reserve_gib=1)
    plan = make_plan(spec, request)
    total = lookup_gpu("A100-80GB").memory_bytes
    pool = int(total * 0.9) - 2 * QWEN_14B_PARAMS - GiB
    assert plan.weights.per_gpu_bytes == 2 * QWEN_14B_PARAMS
    assert plan.pool_bytes == pool
    assert plan.num_blocks == pool // (3 * MiB)
    assert plan.tokens_in_pool == plan.num_blocks * 16
    assert plan.figure("kv_pool").formula.count("−") == 2
    assert plan.verdict.status == OVERCOMMITTED and plan.verdict.workload_fits is False
    assert plan.concurrency(16384) == pytest.approx(plan.num_blocks / 1024)


def test_engine_sizing_with_the_public_functions_matches_the_plan():
    """The engine sizes its pool with these calls; it must land on the planner's block count."""
    spec = registry_spec("meta-llama/Llama-3.1-8B-Instruct")
    plan = make_plan(spec, PlanRequest(gpu="L40S", max_model_len=16384, kv_cache_dtype="int8", block_size=32))
    block_bytes = kv_block_bytes(spec, 32, "int8", "bfloat16", 1)
    pool = kv_pool_bytes(plan.gpu.memory_bytes, 0.9, plan.weights.per_gpu_bytes, plan.activation.bytes)
    assert num_blocks_for_pool(pool, block_bytes) == plan.num_blocks


def test_fitting_plan_has_no_preemption():
    plan = make_plan(registry_spec("Qwen/Qwen3-8B"), PlanRequest(gpu="H100", max_model_len=8192, max_num_seqs=16))
    assert plan.verdict.status == FITS and plan.verdict.fits
    assert plan.concurrency(8192) >= 16


def test_startup_error_when_one_request_does_not_fit():
    plan = make_plan(registry_spec("meta-llama/Llama-3.1-8B-Instruct"), PlanRequest(gpu="RTX-4090"))
    assert plan.verdict.status == STARTUP_ERROR and not plan.verdict.fits


def test_default_max_model_len_is_the_models_context():
    plan = make_plan(registry_spec("microsoft/phi-4"), PlanRequest(gpu="H200"))
    assert plan.max_model_len == 16384


def test_float32_checkpoints_plan_in_bfloat16_unless_asked():
    spec = replace(registry_spec("HuggingFaceTB/SmolLM2-135M-Instruct"), dtype="float32")
    assert make_plan(spec, PlanRequest(gpu="T4")).model_dtype == "bfloat16"
    assert make_plan(spec, PlanRequest(gpu="T4", dtype="float32")).kv.name == "float32"
    assert make_plan(registry_spec("meta-llama/Llama-2-7b-hf"), PlanRequest(gpu="T4")).model_dtype == "float16"
