"""Prefix caching as users of the engine see it: exact hits, shared prefills, cached_tokens, lpm, reset."""

import torch

from kvserve import LLM, SamplingParams


def tokens(seed: int, length: int) -> list[int]:
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_llm(folder, blocks: int = 400, max_model_len: int = 1024, **kwargs) -> LLM:
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=max_model_len, num_gpu_blocks_override=blocks,
               **kwargs)


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def test_two_requests_sharing_five_blocks_hit_80_tokens(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = make_llm(folder)
    shared = tokens(0, 80)
    first = llm.generate([shared + tokens(1, 7)], GREEDY, use_tqdm=False)[0]
    second = llm.generate([shared + tokens(2, 9)], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 80
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (87 + 89, 80)


def test_prompt_of_whole_blocks_still_computes_its_last_token(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = make_llm(folder)
    prompt = tokens(3, 64)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 48  # capped at 63 tokens, rounded down to whole blocks


def test_requests_arriving_together_compute_a_shared_prompt_once(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = make_llm(folder, max_num_batched_tokens=4096)
    system = tokens(4, 1000)
    prompts = [system + tokens(100 + i, 5) for i in range(32)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    cached = [o.num_cached_tokens for o in outputs]
    assert cached[0] == 0 and all(c == 992 for c in cached[1:])  # 62 full blocks of the 1000-token prompt
    stats = llm.engine.stats()
    computed = stats.prefix_cache_queries - stats.prefix_cache_hits
    assert computed == 1005 + 31 * 13  # the system prompt once, then each request's own tail


def test_outputs_identical_with_caching_on_and_off(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2")
    system = tokens(5, 300)
    prompts = [system + tokens(200 + i, 3 + i) for i in range(12)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    # A small pool and a small token budget: preemptions and chunked prefill happen in both runs.
    on = make_llm(folder, blocks=40, max_model_len=512, max_num_batched_tokens=96)
    off = make_llm(folder, blocks=40, max_model_len=512, max_num_batched_tokens=96, enable_prefix_caching=False)
    on_tokens = [o.outputs[0].token_ids for o in on.generate(prompts, params, use_tqdm=False)]
    off_tokens = [o.outputs[0].token_ids for o in off.generate(prompts, params, use_tqdm=False)]
    assert on_tokens == off_tokens
    assert on.engine.stats().prefix_cache_hits > 0 and off.engine.stats().prefix_cache_hits == 0
    assert on.engine.stats().num_preemptions > 0 and off.engine.stats().num_preemptions > 0


def test_n_samples_share_the_prompt_blocks(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = make_llm(folder)
    engine = llm.engine
    engine.add_request("par", tokens(6, 165), SamplingParams(n=4, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True))
    engine.step()  # all four siblings admitted in one step
    used = sum(1 for b in engine.kv_cache.pool.blocks if b.ref_cnt > 0)
    assert used == 10 + 4  # 10 shared full prompt blocks, then one own block each for the 5-token tail
    while engine.has_unfinished_requests():
        engine.step()


def test_cache_salt_isolates_tenants(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = make_llm(folder)
    engine = llm.engine
    prompt = tokens(7, 100)
    for request_id, salt in [("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")]:
        engine.add_request(request_id, prompt, GREEDY, cache_salt=salt)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        cached = outputs[0].num_cached_tokens
        assert cached == {"a": 0, "b": 0, "c": 96}[request_id]


def test_lpm_admits_the_longest_cached_prefix_first(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = make_llm(folder, max_num_seqs=1, scheduling_policy="lpm")
    engine = llm.engine
    warm = tokens(8, 200)
    llm.generate([warm + [5]], GREEDY, use_tqdm=False)  # cache the 200-token prefix
    engine.add_request("cold", tokens(9, 200), GREEDY)
    engine.add_request("warm", warm + [6], GREEDY)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["warm", "cold"]


def test_lpm_does_not_starve_the_head_of_the_queue(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = make_llm(folder, max_num_seqs=1, scheduling_policy="lpm")
    engine = llm.engine
    warm = tokens(10, 100)
    llm.generate([warm + [5]], GREEDY, use_tqdm=False)
    engine.add_request("cold", tokens(11, 100), GREEDY)
    for i in range(40):
        engine.add_request(f"warm{i}", warm + [6 + i], GREEDY)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order.index("cold") <= 17  # passed over at most LPM_MAX_SKIPS times


def test_reset_prefix_cache(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    llm = make_llm(folder)
    prompt = tokens(12, 100)
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.reset_prefix_cache()
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
