"""What users of the engine see: seeds, stops, limits, logprobs, n, aborts, rejected input, block accounting."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve import LLM, SamplingParams
from kvserve.engine.llm_engine import RequestRejected


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=256, num_gpu_blocks_override=256)


def prompt(seed: int, length: int) -> list[int]:
    return torch.randint(3, 384, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def all_free(llm: LLM) -> bool:
    kv = llm.engine.kv_cache
    kv.check_invariants()
    return kv.num_free_blocks == kv.num_blocks


def test_seed_gives_same_tokens_alone_and_in_a_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate([prompt(0, 30)], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [prompt(i, 5 + 7 * i) for i in range(1, 17)]
    batch_params = [params] + [SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)] * 16
    together = llm.generate([prompt(0, 30)] + others, batch_params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together
    different = llm.generate([prompt(0, 30)], SamplingParams(temperature=1.0, seed=99, max_tokens=20, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert different != alone
    assert all_free(llm)


def test_max_tokens_and_min_tokens(llm):
    out = llm.generate([prompt(1, 10)], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 7
    assert out.outputs[0].finish_reason == "length"
    first = out.outputs[0].token_ids[0]
    # The first greedy token as a stop token: min_tokens forbids stopping on it before 3 tokens.
    out = llm.generate([prompt(1, 10)], SamplingParams(temperature=0, max_tokens=7, stop_token_ids=[first], min_tokens=3,
                                                       ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 3 and first not in out.token_ids[:3]


def test_stop_token_ids_end_generation(llm):
    greedy = llm.generate([prompt(2, 10)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    stop_at = greedy[3]
    out = llm.generate([prompt(2, 10)], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                       stop_token_ids=[stop_at]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_string_truncates_text(llm):
    full = llm.generate([prompt(3, 10)], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[4:6]
    out = llm.generate([prompt(3, 10)], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    kept = llm.generate([prompt(3, 10)], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=[stop],
                                                        include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.index(stop) + len(stop)]


def test_logprobs_of_sampled_and_top_k(llm):
    out = llm.generate([prompt(4, 12)], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token_id, entry in zip(out.token_ids, out.logprobs):
        assert entry.token_id == token_id and entry.rank == 1  # greedy picks the most likely token
        assert len(entry.top) == 3 and entry.top[0][0] == token_id
        assert entry.top[0][1] >= entry.top[1][1] >= entry.top[2][1]
        assert entry.logprob <= 0
    assert out.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs))


def test_n_returns_distinct_samples_sharing_the_prompt(llm):
    out = llm.generate([prompt(5, 40)], SamplingParams(n=4, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True),
                       use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    assert all_free(llm)


def test_too_long_prompt_is_rejected_not_truncated(llm):
    with pytest.raises(RequestRejected) as info:
        llm.generate([prompt(6, 300)], SamplingParams(max_tokens=1), use_tqdm=False)
    assert info.value.code == "context_length_exceeded"
    assert "256" in str(info.value) and "300" in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_vllm_prompt_dicts_give_what_their_text_or_ids_give(llm):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = prompt(7, 20)
    text = llm.get_tokenizer().decode(ids)
    by_ids, by_dict = llm.generate([ids, {"prompt_token_ids": ids}], params, use_tqdm=False)
    assert by_dict.outputs[0].token_ids == by_ids.outputs[0].token_ids
    by_text, by_text_dict = llm.generate([text, {"prompt": text}], params, use_tqdm=False)
    assert by_text_dict.outputs[0].token_ids == by_text.outputs[0].token_ids
    assert llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids == \
        by_ids.outputs[0].token_ids
    by_numpy = llm.generate({"prompt_token_ids": np.array(ids)}, params, use_tqdm=False)[0]
    assert by_numpy.outputs[0].token_ids == by_ids.outputs[0].token_ids
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"text": text}], params, use_tqdm=False)
    with pytest.raises(RequestRejected, match="integers"):
        llm.generate([ids, [1, "2", 3]], params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert all_free(llm)


def test_invalid_sampling_params_fail_clearly():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=2, min_tokens=5)


def test_abort_frees_blocks_in_the_same_step(llm):
    engine = llm.engine
    engine.add_request("to-abort", prompt(7, 100), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv_cache.usage > 0
    engine.abort_request("to-abort")
    assert engine.kv_cache.usage == 0
    assert not engine.has_unfinished_requests()


# int4: a quantized pool (data, scales, rotation); host tier: evictions offload, admissions load back.
@pytest.mark.parametrize("kv_cache_dtype,host_tier_blocks", [("auto", None), ("int4", None), ("auto", 6)],
                         ids=["plain", "int4", "host-tier"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(["add", "abort", "step", "step"]), st.integers(0, 10_000)), max_size=30))
def test_random_add_abort_step_keeps_pool_invariants(tiny_model_dir, kv_cache_dtype, host_tier_blocks, actions):
    folder, _ = tiny_model_dir("llama")
    llm = _small_pool_llm(folder, kv_cache_dtype, host_tier_blocks)
    engine = llm.engine
    live: list[str] = []
    finished = []
    for index, (action, value) in enumerate(actions):
        if action == "add":
            request_id = f"r{index}"
            # Prompts drawn from few seeds so prefixes collide and the prefix cache is exercised; some sampled,
            # some scoring their prompt (which bypasses the cache and must survive preemption and chunking).
            params = SamplingParams(temperature=0.8 if value % 3 == 0 else 0, top_p=0.9, max_tokens=1 + value % 20,
                                    ignore_eos=True, prompt_logprobs=1 if value % 5 == 0 else None)
            engine.add_request(request_id, prompt(value % 4, 1 + value % 90), params)
            live.append(request_id)
        elif action == "abort" and live:
            engine.abort_request(live.pop(value % len(live)))
        else:
            finished += [o for o in engine.step() if o.finished]
        engine.kv_cache.check_invariants()
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
        engine.kv_cache.check_invariants()
    assert all_free(llm)
    if llm.engine.tiers is not None:  # nothing leaked in the tier: its bytes are its entries', within capacity
        host = llm.engine.tiers.tier("host")
        assert host.used_bytes == sum(p.numel() for p in host.entries.values()) <= host.capacity_bytes
    for output in finished:
        if output.prompt_logprobs is not None and output.outputs[0].finish_reason != "abort":
            assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
            assert [e.token_id for e in output.prompt_logprobs[1:]] == output.prompt_token_ids[1:]


def _small_pool_llm(folder, kv_cache_dtype="auto", host_tier_blocks=None):
    # A fresh engine per example: a failing example must not leave state behind for the next one.
    tier = {}
    if host_tier_blocks:  # the tiny llama's fp32 block: 3 layers x K,V x 16 tokens x 2 heads x 16 dims x 4 B
        tier = {"kv_offloading_size": host_tier_blocks * 3 * 2 * 16 * 2 * 16 * 4 / 2**30}
    return LLM(str(folder), dtype="float32", device="cpu", max_model_len=128, num_gpu_blocks_override=12,
               max_num_batched_tokens=48, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype, **tier)
