"""The engine with --attention-backend triton, its kernels run by Triton's interpreter on CPU tensors, gives the
same greedy tokens as transformers on the same weights (fp32), through preemption, chunked prefill, prefix hits
and quantized KV, on Llama (GQA), Qwen2 (biases), Mistral (a window on every layer) and Gemma 3 (window and
full layers in separate KV cache groups)."""

import pytest
from test_engine_parity import (MAX_NEW_TOKENS, PROMPT_LENGTHS, assert_all_blocks_free, greedy_references,
                                make_prompts, run_engine)

from kvserve import SamplingParams

pytest.importorskip("triton")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return greedy_references(tiny_model_dir)


CONFIGS = {
    "preempted-and-chunked": dict(num_gpu_blocks_override=40, max_num_batched_tokens=64),
    "one-batch": dict(num_gpu_blocks_override=512),
}
PREEMPTING_POOL = {"llama": {}, "qwen2": {}, "mistral": dict(num_gpu_blocks_override=12),
                   "gemma3": dict(num_gpu_blocks_override=40, max_model_len=320)}


@pytest.mark.parametrize("kind,config", [(kind, "preempted-and-chunked") for kind in PREEMPTING_POOL]
                         + [("llama", "one-batch")])
def test_triton_backend_matches_transformers(kind, config, references):
    folder, expected = references(kind)
    engine_args = CONFIGS[config] | (PREEMPTING_POOL[kind] if config.startswith("preempted") else {})
    got, llm = run_engine(folder, attention_backend="triton", **engine_args)
    assert llm.engine.runner.attention.name == "triton"
    for index, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{kind}/{config}: prompt {index} ({PROMPT_LENGTHS[index]} tokens) diverged"
    if config.startswith("preempted"):
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_triton_backend_reads_int8_kv_and_cached_prefixes_as_the_torch_path_does(references):
    """int8 KV through preemption and chunks, then the same prompts again, answered from cached prefixes: the
    Triton kernels read the pool's int8 bytes (their writer stores the torch encoder's bytes) as the portable
    path does."""
    folder, _ = references("qwen2")  # biased keys: the key offsets of quantized KV are in play
    engine_args = dict(kv_cache_dtype="int8", num_gpu_blocks_override=40, max_num_batched_tokens=64)
    expected, _ = run_engine(folder, attention_backend="torch", **engine_args)
    got, llm = run_engine(folder, attention_backend="triton", **engine_args)
    assert got == expected
    assert llm.engine.scheduler.num_preemptions > 0
    hits = llm.engine.stats().prefix_cache_hits
    again = llm.generate(make_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert llm.engine.stats().prefix_cache_hits > hits
    assert_all_blocks_free(llm)
