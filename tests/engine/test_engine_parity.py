"""Greedy generation through the paged engine is token-identical to transformers on the same weights (fp32),
whatever the batch, chunking, preemption or prefix caching does."""

import pytest
import torch
from logprob_checks import LOGPROB_TOLERANCE, assert_rank_matches, assert_top_matches

from kvserve import LLM, SamplingParams
from kvserve.model.cpu_isa import ISA_ENV, runnable_isas, selected_isa
from kvserve.model.cpu_kernels import cpu_kernels
from kvserve.model.kernel_build import module_name

MAX_NEW_TOKENS = 12
PROMPT_LENGTHS = [1, 7, 16, 17, 33, 64, 150, 300]


def make_prompts(seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 384, (40,), generator=generator).tolist()
    prompts = []
    for index, length in enumerate(PROMPT_LENGTHS):
        if index % 2 and length > 40:
            # Half of the long prompts share a 40-token prefix, so prefix caching has something to hit.
            prompts.append(shared + torch.randint(3, 384, (length - 40,), generator=generator).tolist())
        else:
            prompts.append(torch.randint(3, 384, (length,), generator=generator).tolist())
    return prompts


def reference_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        )
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    return greedy_references(tiny_model_dir)


def greedy_references(tiny_model_dir):
    """kind -> (checkpoint folder, transformers' greedy tokens for each of make_prompts()), each built once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            folder, hf_model = tiny_model_dir(kind)
            cache[kind] = (folder, [reference_greedy(hf_model, p, MAX_NEW_TOKENS) for p in make_prompts()])
        return cache[kind]

    return get


def run_engine(folder, **engine_args) -> tuple[list[list[int]], LLM]:
    llm = LLM(str(folder), **(dict(dtype="float32", device="cpu", max_model_len=512) | engine_args))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True)
    outputs = llm.generate(make_prompts(), params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def assert_all_blocks_free(llm: LLM) -> None:
    kv = llm.engine.kv_cache
    kv.check_invariants()
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.usage == 0.0


CONFIGS = {
    "one-batch": dict(num_gpu_blocks_override=512),
    "chunked-prefill": dict(num_gpu_blocks_override=512, max_num_batched_tokens=64),
    "preemption": dict(num_gpu_blocks_override=40, max_num_batched_tokens=128),
    "no-prefix-caching": dict(num_gpu_blocks_override=512, enable_prefix_caching=False, max_num_batched_tokens=100),
}


# Pools that preempt each model: layers with a sliding window hold only the blocks their window covers (Mistral's
# 24 tokens: two or three a request); Gemma 3's blocks hold one group's 2 or 3 layers (kv_groups.py), and a
# shorter max-model-len lets the pool be small enough to preempt.
PREEMPTING_POOL = {"llama": {}, "qwen2": {}, "mistral": dict(num_gpu_blocks_override=12),
                   "gemma3": dict(num_gpu_blocks_override=40, max_model_len=320),
                   "gemma3-mqa": dict(num_gpu_blocks_override=50, max_model_len=320)}


@pytest.mark.parametrize("kind", list(PREEMPTING_POOL))
@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(kind, config, references):
    folder, expected = references(kind)
    engine_args = CONFIGS[config]
    if config == "preemption":
        engine_args = engine_args | PREEMPTING_POOL[kind]
    got, llm = run_engine(folder, **engine_args)
    for index, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{kind}/{config}: prompt {index} ({PROMPT_LENGTHS[index]} tokens) diverged"
    if config == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the small pool should have forced preemptions"
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_portable_attention_path_matches_transformers(kind, references):
    """The torch path CUDA runs, here on CPU: decodes gathered in chunks of sequences under a small gather bound."""
    folder, expected = references(kind)
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=512, num_gpu_blocks_override=512,
              max_num_batched_tokens=100)
    runner = llm.engine.runner
    runner.decode_kernel = runner.prefill_kernel = None
    runner.max_gather_tokens = 400  # one or two sequences per gather, by context length
    outputs = llm.generate(make_prompts(), SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("engine_args", [{"num_gpu_blocks_override": 512},
                                         {"num_gpu_blocks_override": 40, "max_num_batched_tokens": 64}],
                         ids=["one-batch", "chunked-and-preempted"])
def test_prompt_logprobs_match_transformers(engine_args, tiny_model_dir):
    """Every prompt token after the first is scored as transformers scores it, whatever chunking, preemption
    (a recompute scores nothing twice) or a shared prefix (which is recomputed, not read from the cache) do."""
    folder, hf_model = tiny_model_dir("llama")
    prompts = make_prompts()
    llm = LLM(str(folder), dtype="float32", device="cpu", max_model_len=512, **engine_args)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True, prompt_logprobs=2)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        entries = output.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for position, entry in enumerate(entries[1:], start=1):
            expected = reference[position - 1]
            assert entry.token_id == prompt[position]
            assert entry.logprob == pytest.approx(float(expected[prompt[position]]), abs=LOGPROB_TOLERANCE)
            # Ranks and the top-k order up to near-ties, which two fp32 computations may order either way.
            assert_rank_matches(entry.rank, expected, prompt[position])
            assert_top_matches([token for token, _ in entry.top], expected, 2)
            for token, logprob in entry.top:
                assert logprob == pytest.approx(float(expected[token]), abs=LOGPROB_TOLERANCE)
    if engine_args["num_gpu_blocks_override"] == 40:
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


OTHER_KERNEL_FAMILIES = [isa for isa in runnable_isas() if isa != selected_isa()]


@pytest.mark.parametrize("isa", OTHER_KERNEL_FAMILIES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("config", ["chunked-prefill", "preemption"])
def test_greedy_matches_transformers_with_every_kernel_family(isa, kind, config, references, monkeypatch):
    """The kernels a less capable CPU runs (AVX2 on an AVX-512 machine: KVSERVE_CPU_ISA caps the family), in
    the engine: decode and fp32 prefill attention, fused norms, rotary and activation."""
    monkeypatch.setenv(ISA_ENV, isa.name)
    folder, expected = references(kind)
    got, llm = run_engine(folder, **CONFIGS[config])
    if cpu_kernels() is not None:
        assert llm.engine.runner.model.fused_kernels.__name__ == module_name(isa)
        assert llm.engine.runner.prefill_kernel is not None
    assert got == expected
    assert_all_blocks_free(llm)
