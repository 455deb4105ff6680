"""Hybrid KV: a model whose layers mix full attention and a sliding window keeps one block table per layer group,
and the window groups give back the blocks their window has left.

The model is a random Qwen2 with its window on every layer but the first (transformers' `max_window_layers`), so
its layers form a full-attention group and two window groups of one layer each. Prompts run several windows long,
so blocks are given back while requests prefill in chunks, decode, get preempted and hit the prefix cache; the
tokens must stay transformers' and every request must hold exactly the blocks the planner counts.
"""

from __future__ import annotations

import pytest
import torch

from test_engine_parity import reference_greedy
from tiny_models import save_model

from kvserve.cache.kv_cache_manager import RELEASED_BLOCK
from kvserve import LLM, SamplingParams
from kvserve.planner.kv import kv_layout
from kvserve.planner.specs import spec_from_hf_config

WINDOW = 24
MAX_NEW_TOKENS = 10
SHARED = [(7 * i) % 300 + 5 for i in range(70)]  # a shared 70-token prefix: hits cover blocks out of the window
PROMPTS = [SHARED + [11, 12, 13], SHARED[:40], [(3 * i) % 300 + 5 for i in range(130)], [9] * 5,
           SHARED + [(5 * i) % 300 + 5 for i in range(60)], list(range(5, 90))]


@pytest.fixture(scope="module")
def windowed_qwen2(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen2-window")
    model = save_model("qwen2", folder, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    expected = [reference_greedy(model, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    return folder, expected


def _engine(folder, **kwargs) -> LLM:
    return LLM(str(folder), **(dict(dtype="float32", device="cpu", max_model_len=256) | kwargs))


def _generate(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params, use_tqdm=False)]


def _assert_all_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks


def test_layers_form_a_full_group_and_window_groups(windowed_qwen2):
    folder, _ = windowed_qwen2
    llm = _engine(folder, num_gpu_blocks_override=64)
    layout = llm.engine.pool.layout
    assert layout.windows == (None, WINDOW, WINDOW) and layout.num_slots == 1
    # A pool block holds one layer's K/V: a third of a block of every layer.
    assert llm.engine.pool.block_bytes == 16 * 2 * 2 * 16 * 4
    assert [cache.group for cache in llm.engine.runner.kv_caches] == [0, 1, 2]
    shared = llm.engine.runner.kv_caches
    assert shared[1].key.data_ptr() == shared[2].key.data_ptr() == shared[0].key.data_ptr()


CONFIGS = {
    "one-batch": dict(num_gpu_blocks_override=256),
    "chunked-preempted": dict(num_gpu_blocks_override=28, max_num_batched_tokens=32, max_num_seqs=4),
    "no-prefix-caching": dict(num_gpu_blocks_override=28, max_num_batched_tokens=48, enable_prefix_caching=False),
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(windowed_qwen2, config):
    folder, expected = windowed_qwen2
    llm = _engine(folder, **CONFIGS[config])
    assert _generate(llm) == expected
    if config == "chunked-preempted":
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool should have forced preemptions"
    # Again: the shared prefix and whole prompts now hit blocks the window groups gave back but kept cached.
    queries, hits = llm.engine.kv_cache.stats.queries, llm.engine.kv_cache.stats.hits
    assert _generate(llm) == expected
    if CONFIGS[config].get("enable_prefix_caching", True):
        assert llm.engine.kv_cache.stats.hits - hits > 0
        assert llm.engine.kv_cache.stats.queries > queries
    _assert_all_free(llm)


def test_a_prefix_hit_past_the_window_takes_only_the_windows_blocks(windowed_qwen2):
    folder, expected = windowed_qwen2
    llm = _engine(folder, num_gpu_blocks_override=256)
    assert _generate(llm, PROMPTS[:1]) == expected[:1]
    engine = llm.engine
    engine.add_request("again", PROMPTS[4], SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True))
    engine.step()
    assert engine.scheduler.running[0].num_cached_tokens == 64  # the shared prefix's 4 whole blocks
    full, window, other_window = engine.kv_cache.get_block_tables("again")
    # The first query after the hit is at position 64 and sees 41..64: the window groups took blocks 2 and 3 of
    # the hit, not 0 and 1, and the prompt's 130 tokens needed 9 blocks in each group.
    assert window[:2] == other_window[:2] == [RELEASED_BLOCK, RELEASED_BLOCK]
    assert len(full) == len(window) == 9
    assert engine.kv_cache.num_blocks_of("again") == 9 + 7 + 7
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    assert outputs[0].outputs[0].token_ids == expected[4]
    _assert_all_free(llm)


def test_each_decoding_request_holds_the_blocks_the_planner_counts(windowed_qwen2):
    folder, _ = windowed_qwen2
    llm = _engine(folder, num_gpu_blocks_override=256, enable_prefix_caching=False)
    engine = llm.engine
    layout = kv_layout(spec_from_hf_config(engine.loaded.hf_config))
    assert layout == engine.pool.layout
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for index, prompt in enumerate(PROMPTS):
        engine.add_request(str(index), prompt, params)
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            if request.num_computed_tokens > request.num_prompt_tokens:  # decoding: its last step wrote one token
                held = engine.kv_cache.num_blocks_of(request.request_id)
                assert held == layout.blocks_per_request(request.num_computed_tokens, 16)
                checked += 1
    assert checked > 100
    _assert_all_free(llm)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_pool_gives_the_same_tokens_however_blocks_are_given_back(windowed_qwen2, kv_cache_dtype):
    """A quantized hybrid pool: the window groups' layers share storage slots with the full group's but keep their
    own scales and key offsets; chunks, preemption and hits change nothing in the arithmetic."""
    folder, _ = windowed_qwen2
    roomy = _generate(_engine(folder, num_gpu_blocks_override=256, kv_cache_dtype=kv_cache_dtype))
    tight = _engine(folder, kv_cache_dtype=kv_cache_dtype, **CONFIGS["chunked-preempted"])
    assert _generate(tight) == roomy
    assert _generate(tight) == roomy  # with hits
    _assert_all_free(tight)


def test_int4_pool_stages_each_groups_keys(windowed_qwen2):
    """int4 keys are quantized per block from staged rows, one staging per group (each group writes its own
    slots). Prefilling in chunks rounds differently from prefilling whole (as without windows), so the check is
    what does not depend on it: the pool stays consistent through preemption and hits, and the prompts prefilled
    whole give the roomy pool's tokens."""
    folder, _ = windowed_qwen2
    roomy = _generate(_engine(folder, num_gpu_blocks_override=256, kv_cache_dtype="int4"))
    tight = _engine(folder, kv_cache_dtype="int4", **CONFIGS["chunked-preempted"])
    staging = {id(cache.key_staging) for cache in tight.engine.runner.kv_caches}
    assert len(staging) == 3
    got = _generate(tight)
    assert got[3] == roomy[3]  # 5 tokens: one chunk
    assert tight.engine.scheduler.num_preemptions > 0
    _generate(tight)
    _assert_all_free(tight)


def test_host_tier_loads_every_groups_blocks_back(windowed_qwen2):
    folder, expected = windowed_qwen2
    block_bytes = 16 * 2 * 2 * 16 * 4
    llm = _engine(folder, num_gpu_blocks_override=28, max_num_batched_tokens=32, max_num_seqs=2,
                  kv_offloading_size=400 * block_bytes / 2**30)
    assert _generate(llm) == expected
    assert _generate(llm) == expected
    tier = llm.engine.tiers.tier("host")
    assert tier.stats.offloaded_blocks > 0 and tier.stats.hits > 0
    _assert_all_free(llm)


def test_tensor_parallel_ranks_share_the_group_tables(windowed_qwen2):
    folder, expected = windowed_qwen2
    llm = _engine(folder, tensor_parallel_size=2, num_gpu_blocks_override=28, max_num_batched_tokens=32,
                  max_num_seqs=4)
    try:
        assert _generate(llm) == expected
        _assert_all_free(llm)
    finally:
        llm.close()


def test_mistral_with_a_window_on_every_layer_is_one_window_group(tmp_path):
    save_model("mistral", tmp_path)
    llm = _engine(tmp_path, num_gpu_blocks_override=64)
    assert llm.engine.pool.layout.windows == (24,)
    assert torch.is_tensor(llm.engine.runner.kv_caches[0].key)


def test_disabling_the_hybrid_manager_keeps_every_token_with_the_same_tokens(windowed_qwen2):
    """--disable-hybrid-kv-cache-manager (vLLM's flag): one table for all layers, nothing given back; the window
    layers still attend over their window only (the decode kernel and the portable path take it per layer)."""
    folder, expected = windowed_qwen2
    llm = _engine(folder, num_gpu_blocks_override=28, max_num_batched_tokens=32, max_num_seqs=4,
                  disable_hybrid_kv_cache_manager=True)
    assert llm.engine.pool.layout.windows == (None,) and llm.engine.pool.block_bytes == 3 * 16 * 2 * 2 * 16 * 4
    assert _generate(llm) == expected
    runner = llm.engine.runner
    runner.decode_kernel = runner.prefill_kernel = None  # the portable path, as CUDA runs it
    assert _generate(llm) == expected
    _assert_all_free(llm)
    hybrid = _engine(folder, num_gpu_blocks_override=3 * 28)  # the same bytes as 28 blocks of all three layers
    one_table = llm.engine.pool
    assert one_table.pool_bytes == hybrid.engine.pool.pool_bytes
    assert hybrid.engine.pool.blocks_per_request(200) < one_table.blocks_per_request(200) * 3


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_gemma3_quantized_pool_calibrates_each_layer_kind_on_its_own_rotary(tiny_model_dir, kv_cache_dtype):
    """Gemma 3's sliding layers turn by their own rope base: each layer's key offset is measured on the channels
    its own table turns slowly, and a padded group (3 window layers in groups of 2) shares slots like the rest."""
    folder, _ = tiny_model_dir("gemma3")
    roomy = _engine(folder, num_gpu_blocks_override=256, kv_cache_dtype=kv_cache_dtype)
    model = roomy.engine.runner.model
    assert model.rotary_of(0) is model.local_rotary and model.rotary_of(2) is model.rotary
    assert roomy.engine.pool.layout.windows == (8, 8, None)
    expected = _generate(roomy)
    tight = _engine(folder, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks_override=24, max_num_batched_tokens=32,
                    max_num_seqs=4, max_model_len=160)
    assert _generate(tight) == expected
    assert tight.engine.scheduler.num_preemptions > 0
    _assert_all_free(tight)


def test_disk_tier_brings_every_groups_blocks_back_after_a_restart(windowed_qwen2, tmp_path):
    folder, expected = windowed_qwen2
    args = dict(num_gpu_blocks_override=64, kv_offloading_size=64 * 16 * 2 * 2 * 16 * 4 / 2**30,
                kv_disk_path=str(tmp_path / "kv"))
    first = _engine(folder, **args)
    assert _generate(first) == expected
    first.close()  # saves what the pool caches to the disk tier
    again = _engine(folder, **args)
    assert _generate(again) == expected
    disk = again.engine.tiers.tier("disk")
    assert disk.stats.hits > 0
    _assert_all_free(again)
    again.close()


# A pool that preempts each: Gemma 3's blocks hold 2 or 3 layers of one group, Mistral's (one window group) all 3.
TIGHT = {"gemma3": 24, "gemma3-mqa": 30, "mistral": 7}


@pytest.mark.parametrize("kind", list(TIGHT))
def test_windowed_models_match_transformers_through_preemption_chunks_and_hits(tiny_model_dir, kind):
    """Prompts several times the window (8, 12 and 24 tokens), a shared prefix hit past the window on the second
    pass, chunked prefill and preemption: the tokens stay transformers'."""
    folder, hf_model = tiny_model_dir(kind)
    expected = [reference_greedy(hf_model, prompt, MAX_NEW_TOKENS) for prompt in PROMPTS]
    llm = _engine(folder, num_gpu_blocks_override=TIGHT[kind], max_num_batched_tokens=32, max_num_seqs=4,
                  max_model_len=160)
    assert _generate(llm) == expected
    hits = llm.engine.kv_cache.stats.hits
    assert _generate(llm) == expected
    assert llm.engine.kv_cache.stats.hits > hits
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_free(llm)


def test_start_up_concurrency_is_kvserve_plans(tiny_model_dir):
    """`kvserve plan --kv-cache-memory` and the engine's start-up log give the same requests per pool."""
    from kvserve.planner.plan import PlanRequest, model_cost
    from kvserve.planner.spec_loader import load_spec

    folder, _ = tiny_model_dir("gemma3")
    llm = _engine(folder, kv_cache_memory=0.002)
    pool = llm.engine.pool
    engine_figure = pool.num_blocks / pool.blocks_per_request(256)
    assert f"maximum concurrency at max-model-len 256: {engine_figure:.2f}x" in pool.describe()
    request = PlanRequest(kv_cache_memory_gib=0.002, max_model_len=256, avg_context_len=256, dtype="float32")
    planned = model_cost(load_spec(str(folder)), request).kv_costs[0].pool_requests.value
    assert planned == engine_figure
