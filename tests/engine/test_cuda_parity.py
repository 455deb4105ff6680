"""On a CUDA device: the engine in bf16 is as close to transformers' fp32 output as transformers' own bf16 is,
seeded sampling is batch-independent, the pool is sized from --gpu-memory-utilization and stays within it, and
the server answers the official client.

Runs wherever torch sees a GPU and is skipped elsewhere (CI has none). bf16 cannot be token-identical to fp32,
so the parity bound is relative: for every prompt of the engine parity set (1-300 tokens, half sharing a
prefix), the first generated token's logprobs, after a prefill that is chunked and preempted, err from fp32's no
more than those of transformers run in bf16 on the same device.
"""

import gc

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.pool_sizing import PoolTooSmall
from test_engine_behaviour import prompt
from test_engine_parity import make_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TOP = 5
# A tiny model needs little: a small share of the card keeps each engine's pool (and its block tables) small.
UTILIZATION = 0.05


@pytest.fixture(autouse=True)
def release_engines():
    """Each test's engines are gone before the next sizes its pool (sizing counts every live allocation)."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def first_token_logprobs(model, prompts, device) -> list[dict[int, float]]:
    result = []
    with torch.no_grad():
        for p in prompts:
            logprobs = model(torch.tensor([p], device=device)).logits[0, -1].float().log_softmax(-1)
            values, ids = logprobs.topk(20)
            result.append(dict(zip(ids.tolist(), values.tolist())))
    return result


def transformers_bf16_on_cuda(folder):
    """Loaded as users load it (rotary frequencies stay fp32), not cast from the shared fp32 test model."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to("cuda").eval()


def mean_error(got: list[dict[int, float]], reference: list[dict[int, float]]) -> float:
    errors = [max(abs(g.get(t, min(g.values())) - r[t]) for t in list(r)[:TOP]) for g, r in zip(got, reference)]
    return sum(errors) / len(errors)


def all_blocks_free(llm: LLM) -> bool:
    kv = llm.engine.kv_cache
    kv.check_invariants()
    return kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("engine_args", [{"gpu_memory_utilization": UTILIZATION},
                                         {"max_num_batched_tokens": 128, "num_gpu_blocks_override": 40}],
                         ids=["plain", "chunked-and-preempted"])
def test_engine_bf16_on_cuda_is_as_close_to_fp32_as_transformers_bf16(kind, engine_args, tiny_model_dir):
    folder, hf_model = tiny_model_dir(kind)
    prompts = make_prompts()
    reference = first_token_logprobs(hf_model, prompts, "cpu")
    theirs = first_token_logprobs(transformers_bf16_on_cuda(folder), prompts, "cuda")
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=512, **engine_args)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=20, ignore_eos=True),
                           use_tqdm=False)
    ours = [dict(o.outputs[0].logprobs[0].top) for o in outputs]
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    ours_error, theirs_error = mean_error(ours, reference), mean_error(theirs, reference)
    assert ours_error < 1.5 * theirs_error + 0.05, (ours_error, theirs_error)
    assert all_blocks_free(llm)
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0


def test_seeded_sampling_on_cuda_is_the_same_alone_and_in_a_batch(tiny_model_dir):
    """fp32, so that batch shape cannot move a logit enough to change a draw; penalties run on the device too."""
    folder, _ = tiny_model_dir("llama")
    llm = LLM(str(folder), dtype="float32", device="cuda", max_model_len=256, gpu_memory_utilization=UTILIZATION)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True,
                            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    alone = llm.generate([prompt(0, 30)], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [prompt(i, 5 + 7 * i) for i in range(1, 17)]
    batch_params = [params] + [SamplingParams(temperature=1.0, min_p=0.05, max_tokens=20, ignore_eos=True)] * 16
    together = llm.generate([prompt(0, 30)] + others, batch_params, use_tqdm=False)[0].outputs[0].token_ids
    assert alone == together
    assert len(alone) == 20
    assert all_blocks_free(llm)


def test_pool_sized_from_gpu_memory_utilization_holds_every_step(tiny_model_dir):
    """The profiled activation peak covers the steps the engine then runs: the process never allocates beyond
    --gpu-memory-utilization of the card, through long prefills, chunking and a full batch of decodes."""
    folder, _ = tiny_model_dir("llama")
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=1024, max_num_batched_tokens=256,
              gpu_memory_utilization=UTILIZATION)
    assert "--gpu-memory-utilization" in llm.engine.pool.source
    _, total = torch.cuda.mem_get_info()
    budget = UTILIZATION * total
    torch.cuda.reset_peak_memory_stats()
    prompts = [prompt(i, 100 + 450 * (i % 2)) for i in range(64)]
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    assert torch.cuda.max_memory_allocated() <= budget
    assert all_blocks_free(llm)


def test_engine_refuses_more_memory_than_the_gpu_has_free(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(PoolTooSmall, match="lower --gpu-memory-utilization"):
        LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=256, gpu_memory_utilization=1.0)


def test_server_on_cuda_streams_to_the_openai_client_and_reports_gpu_memory(tiny_model_dir):
    from server_harness import MODEL_NAME, start_server

    folder, _ = tiny_model_dir("llama")
    running = start_server(folder, device="cuda", dtype="bfloat16", num_gpu_blocks_override=None,
                           gpu_memory_utilization=UTILIZATION)
    try:
        stream = running.openai().chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True, seed=3,
            temperature=0.8,
        )
        chunks = list(stream)
        assert chunks[-1].choices[0].finish_reason in ("stop", "length")
        metrics = running.metrics()
        used = [v for k, v in metrics.items() if k.startswith("kvserve:device_memory_used_bytes") and "cuda" in k]
        assert used and used[0] > 0
    finally:
        running.stop()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two CUDA devices")
def test_tp2_over_nccl_generates_what_tp1_does(tiny_model_dir):
    """fp32 on both: the all-reduce changes only the order of two partial sums per layer."""
    folder, _ = tiny_model_dir("llama")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    results = []
    for tp in (1, 2):
        llm = LLM(str(folder), dtype="float32", device="cuda", tensor_parallel_size=tp, max_model_len=512,
                  gpu_memory_utilization=UTILIZATION, max_num_batched_tokens=64)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(make_prompts(), params, use_tqdm=False)])
        finally:
            llm.close()
    assert results[1] == results[0]
