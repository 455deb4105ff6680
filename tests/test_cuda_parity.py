"""On a CUDA device, the engine in bf16 is as close to transformers' fp32 output as transformers' own bf16 is.

Runs wherever torch sees a GPU and is skipped elsewhere (CI has none). bf16 cannot be token-identical to fp32,
so the bound is relative: for every prompt of the engine parity set (1-300 tokens, half sharing a prefix),
the first generated token's logprobs, after a prefill that is chunked and preempted, err from fp32's no more
than those of transformers run in bf16 on the same device.
"""

import pytest
import torch

from kvserve import LLM, SamplingParams
from test_engine_parity import make_prompts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

TOP = 5


def hf_first_token_logprobs(hf_model, prompts, dtype, device) -> list[dict[int, float]]:
    model = hf_model.to(device=device, dtype=dtype)
    result = []
    with torch.no_grad():
        for prompt in prompts:
            logprobs = model(torch.tensor([prompt], device=device)).logits[0, -1].float().log_softmax(-1)
            values, ids = logprobs.topk(20)
            result.append(dict(zip(ids.tolist(), values.tolist())))
    hf_model.to(device="cpu", dtype=torch.float32)
    return result


def mean_error(got: list[dict[int, float]], reference: list[dict[int, float]]) -> float:
    errors = [max(abs(g.get(t, min(g.values())) - r[t]) for t in list(r)[:TOP]) for g, r in zip(got, reference)]
    return sum(errors) / len(errors)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("engine_args", [{}, {"max_num_batched_tokens": 128, "num_gpu_blocks_override": 40}],
                         ids=["plain", "chunked-and-preempted"])
def test_engine_bf16_on_cuda_is_as_close_to_fp32_as_transformers_bf16(kind, engine_args, tiny_model_dir):
    folder, hf_model = tiny_model_dir(kind)
    prompts = make_prompts()
    reference = hf_first_token_logprobs(hf_model, prompts, torch.float32, "cpu")
    hf_bf16 = hf_first_token_logprobs(hf_model, prompts, torch.bfloat16, "cuda")
    llm = LLM(str(folder), dtype="bfloat16", device="cuda", max_model_len=512, **engine_args)
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, logprobs=20, ignore_eos=True),
                           use_tqdm=False)
    ours = [dict(o.outputs[0].logprobs[0].top) for o in outputs]
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    ours_error, theirs_error = mean_error(ours, reference), mean_error(hf_bf16, reference)
    assert ours_error < 1.5 * theirs_error + 0.05, (ours_error, theirs_error)
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
    if "num_gpu_blocks_override" in engine_args:
        assert llm.engine.scheduler.num_preemptions > 0
