"""bf16 on the demo model: the compiled CPU attention kernels are as close to fp32 as the portable torch path.

bf16 cannot be token-identical to fp32 (8 mantissa bits), so the check is the one a user cares about: the
distribution of the first generated token, after a prefill that the kernels computed, errs from fp32's no more
than the portable path's does. Chunked prefill and prefix caching make segments continue a cached past.
"""

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import ModelLoadError
from kvserve.model.cpu_kernels import cpu_kernels, prefill_kernel
from kvserve.model.demo import demo_model_path

try:
    demo_model_path()
except ModelLoadError as exc:
    pytest.skip(f"demo model not installed: {exc}", allow_module_level=True)

LONG = "A paged KV cache stores keys and values in fixed-size blocks. " * 30
PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
    "The three primary colors are", "Water boils at a temperature of", "List of planets: Mercury, Venus,",
    "import numpy as np\nx = np.arange(10)\n", LONG + "Summarize: ", LONG + "In one word, the topic is",
]


def first_token_logprobs(dtype: str, use_kernels: bool = True) -> list[dict[int, float]]:
    # 128-token chunks and prefix caching: the long prompts are prefilled in chunks over a cached past.
    llm = LLM(None, dtype=dtype, device="cpu", kv_cache_memory=0.25, max_model_len=1024, max_num_batched_tokens=128,
              enable_prefix_caching=True)
    runner = llm.engine.runner
    if not use_kernels:
        runner.decode_kernel = runner.prefill_kernel = None
    else:  # the kernel even where the runner prefers torch's SDPA (CPUs with AMX): this test is about the kernel
        runner.prefill_kernel = prefill_kernel(cpu_kernels(), runner.model.dtype, runner.model.config.head_dim,
                                               runner.kv_caches[0])
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1, logprobs=20), use_tqdm=False)
    return [dict(o.outputs[0].logprobs[0].top) for o in outputs]


def mean_error(got: list[dict[int, float]], reference: list[dict[int, float]]) -> float:
    """Mean over prompts of the largest logprob error among fp32's top-5 tokens (one missing from the top-20
    counts as if it had the 20th logprob)."""
    errors = [max(abs(g.get(t, min(g.values())) - r[t]) for t in list(r)[:5]) for g, r in zip(got, reference)]
    return sum(errors) / len(errors)


@pytest.mark.slow
def test_bf16_kernels_are_as_close_to_fp32_as_the_portable_path():
    kernels = cpu_kernels()
    if kernels is None or not kernels.has_prefill_attention_bf16():
        pytest.skip("the bf16 prefill kernel needs a compiler and a CPU with AVX512-BF16")
    reference = first_token_logprobs("float32", use_kernels=False)
    with_kernels = first_token_logprobs("bfloat16", use_kernels=True)
    portable = first_token_logprobs("bfloat16", use_kernels=False)
    kernel_error, portable_error = mean_error(with_kernels, reference), mean_error(portable, reference)
    assert kernel_error < 1.5 * portable_error + 0.02, (kernel_error, portable_error)


@pytest.mark.slow
def test_fp32_compute_over_a_bf16_cache_is_closer_to_fp32_than_bf16_is(monkeypatch):
    """What --dtype auto runs on a CPU without native bf16 (capped here to AVX2): fp32 compute, K/V kept in the
    checkpoint's bf16 and widened by the AVX2 kernels as they read. Only the cache is rounded, so its error
    from fp32 must be well under bf16's (where everything is rounded)."""
    from kvserve.model.cpu_isa import ISA_ENV, runnable_isas

    if "avx2" not in [isa.name for isa in runnable_isas()]:
        pytest.skip("this CPU has no AVX2")
    reference = first_token_logprobs("float32", use_kernels=False)
    bf16 = first_token_logprobs("bfloat16", use_kernels=False)
    monkeypatch.setenv(ISA_ENV, "avx2")
    llm_check = LLM(None, dtype="auto", device="cpu", kv_cache_memory=0.05, max_model_len=256)
    runner = llm_check.engine.runner
    assert runner.kv_caches[0].key.dtype == torch.bfloat16 and runner.model.dtype == torch.float32
    if cpu_kernels() is not None:
        assert runner.decode_kernel is not None and runner.prefill_kernel is not None
    del llm_check
    auto = first_token_logprobs("auto")
    auto_error, bf16_error = mean_error(auto, reference), mean_error(bf16, reference)
    assert auto_error < 0.5 * bf16_error, (auto_error, bf16_error)
