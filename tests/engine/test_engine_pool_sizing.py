"""The engine sizes its pool with the planner's arithmetic: `kvserve plan`'s figures are the engine's figures."""

import json

import pytest
import torch

from kvserve import LLM
from kvserve.cli import main as kvserve_main
from kvserve.engine.pool_sizing import PoolTooSmall
from kvserve.planner.budget import max_model_len_for_blocks, num_blocks_for_pool
from kvserve.planner.kv import kv_block_bytes
from kvserve.planner.spec_loader import load_spec

GIB = 2**30


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_planner_block_count_equals_engine_num_blocks(kind, tiny_model_dir):
    folder, _ = tiny_model_dir(kind)
    budget_gib = 0.01
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=budget_gib)
    spec = load_spec(str(folder))  # the planner's own reading of the folder
    predicted = num_blocks_for_pool(int(budget_gib * GIB), kv_block_bytes(spec, 16, "auto", "float32"))
    assert llm.engine.kv_cache.num_blocks == predicted
    assert llm.engine.pool.block_bytes == kv_block_bytes(spec, 16, "auto", "float32")


def test_plan_json_kv_bytes_match_engine_block_bytes(tiny_model_dir, capsys):
    folder, _ = tiny_model_dir("llama")
    assert kvserve_main(["plan", "--model", str(folder), "--gpu-memory", "1", "--dtype", "float32", "--json"]) in (0, None)
    plan = json.loads(capsys.readouterr().out)
    llm = LLM(str(folder), dtype="float32", device="cpu", kv_cache_memory=0.01)
    text = json.dumps(plan)
    assert str(llm.engine.pool.block_bytes // 16) in text  # KV bytes per token, as the plan states it


def test_engine_refuses_to_start_when_max_model_len_does_not_fit(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(PoolTooSmall) as info:
        LLM(str(folder), dtype="float32", device="cpu", num_gpu_blocks_override=8, max_model_len=1000)
    assert f"largest max-model-len that fits is {max_model_len_for_blocks(8, 16)}" in str(info.value)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_cuda_profiling_forwards_run_through_the_portable_path(kind, tiny_model_dir):
    """The passes CUDA pool sizing measures (a full-budget prefill over the longest past, a decode gathering
    its largest chunk, the sampler's costliest path over max-num-seqs rows) are valid steps of the portable path;
    here they run on CPU, where memory is not measured."""
    from kvserve.config import EngineConfig
    from kvserve.engine.memory_profile import run_profiling_passes
    from kvserve.model.loader import load_model

    folder, _ = tiny_model_dir(kind)
    config = EngineConfig.from_kwargs(model=str(folder), dtype="float32", device="cpu", max_model_len=300,
                                      max_num_batched_tokens=64, max_num_seqs=4)
    loaded = load_model(str(folder), "float32", "cpu")
    prefill, decode, sampled = run_profiling_passes(config, loaded, torch.device("cpu"))
    vocab = loaded.config.vocab_size
    assert prefill.shape == (64, vocab) and bool(prefill.isfinite().all())  # every token of the full budget
    assert decode.shape[1] == vocab and decode.shape[0] >= 1 and bool(decode.isfinite().all())
    assert len(sampled) == 4  # one draw per max-num-seqs row


def test_auto_on_a_cpu_without_native_bf16_keeps_kv_in_the_checkpoints_16_bits(monkeypatch):
    """--dtype auto computes the demo (a bf16 checkpoint once dequantized) in fp32 on an AVX2 CPU, and keeps K/V
    in bf16: half the bytes per token, so twice the tokens in the same pool, as the planner counts them."""
    from kvserve.config import ModelLoadError
    from kvserve.model.cpu_isa import ISA_ENV, runnable_isas
    from kvserve.model.demo import demo_model_path

    try:
        demo = demo_model_path()
    except ModelLoadError as exc:
        pytest.skip(f"demo model not installed: {exc}")
    if "avx2" not in [isa.name for isa in runnable_isas()]:
        pytest.skip("this CPU has no AVX2")
    monkeypatch.setenv(ISA_ENV, "avx2")
    llm = LLM(None, dtype="auto", device="cpu", kv_cache_memory=0.05, max_model_len=256)
    spec = load_spec(str(demo))
    assert llm.engine.runner.model.dtype == torch.float32
    assert llm.engine.runner.kv_caches[0].key.dtype == torch.bfloat16
    block_bytes = kv_block_bytes(spec, 16, "bfloat16", "float32")
    assert 2 * block_bytes == kv_block_bytes(spec, 16, "float32", "float32")
    assert llm.engine.pool.block_bytes == block_bytes
    assert llm.engine.kv_cache.num_blocks == num_blocks_for_pool(int(0.05 * GIB), block_bytes)
