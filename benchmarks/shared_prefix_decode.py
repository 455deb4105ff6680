"""Workload (a), 32 requests sharing a 400-token prompt, with shared-prefix (cascade) decode attention against the
same engine reading every context on its own (--disable-cascade-attn), in one run, and the decode step at batch
32 against this machine's bound (bytes over the measured memory bandwidth, FLOPs over the measured matmul peak,
whichever is larger).

    python benchmarks/shared_prefix_decode.py [--model PATH] [--kv-cache-dtype auto] [--rounds 2]

The shared prompt is cached before timing (prefix caching on), as it is on a server that has seen it. A decode
step's time is (time for 64 output tokens - time for 1) / 63 over the same prompts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).parent))

from machine_bounds import describe  # noqa: E402
from model_bounds import ModelCost  # noqa: E402
from workloads import shared_prefix_workload  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.cpu_isa import selected_isa  # noqa: E402
from kvserve.model.layers import tensor_bytes  # noqa: E402
from kvserve.model.quant_weight import QuantWeight  # noqa: E402

OUTPUT_TOKENS = 64


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    started = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - started


def measure(llm: LLM, prompts: list[list[int]]) -> tuple[float, float]:
    """(output tok/s, seconds a decode step) with the shared prompt cached."""
    whole = timed_generate(llm, prompts, OUTPUT_TOKENS)
    first = timed_generate(llm, prompts, 1)
    return len(prompts) * OUTPUT_TOKENS / whole, (whole - first) / (OUTPUT_TOKENS - 1)


def matmul_weights(model) -> tuple[int, int]:
    """(parameters, bytes read) of the matmul weights a decode step of 32 rows multiplies by (a tied head: the
    embedding)."""
    weights = [getattr(m, n) for m, n in model._matmul_weights()]
    if model.lm_head is None:
        weights.append(model.embed_tokens)
    params = sum(w.numel() for w in weights)
    read = sum(w.nbytes() if isinstance(w, QuantWeight) else tensor_bytes(w) for w in weights)
    return params, read


def decode_bound(llm: LLM, prompts: list[list[int]], shared_tokens: int, cascade: bool) -> float:
    """Seconds a decode step of these prompts at their mean context needs at least (model_bounds' arithmetic over
    the weights and KV format this engine holds)."""
    model = llm.engine.runner.model
    config = model.config
    params, weight_bytes = matmul_weights(model)
    pool = llm.engine.pool
    pair_flops = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim
    cost = ModelCost(params, weight_bytes, pool.block_bytes // pool.block_size, pair_flops)
    contexts = [len(p) + OUTPUT_TOKENS // 2 for p in prompts]
    return cost.decode_bound_s(contexts, shared_tokens if cascade else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct demo GGUF")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=2, help="alternating runs of each setting; the best counts")
    args = parser.parse_args()
    engines = {}
    for cascade in (True, False):
        engines[cascade] = LLM(args.model, dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype,
                               enable_prefix_caching=True, kv_cache_memory=2.0, max_model_len=2048,
                               disable_cascade_attn=not cascade)
    requests = shared_prefix_workload(engines[True].get_tokenizer())
    prompts = [r.prompt_token_ids for r in requests]
    shared = 400
    for llm in engines.values():
        timed_generate(llm, prompts[:4], 2)  # caches the shared prompt
    best: dict[bool, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for cascade, llm in engines.items():
            rate, step = measure(llm, prompts)
            if cascade not in best or rate > best[cascade][0]:
                best[cascade] = (rate, step)
    model = engines[True].engine.runner.model
    print(f"CPU family {selected_isa().label}; model dtype {str(model.dtype).removeprefix('torch.')}, KV "
          f"{engines[True].engine.pool.kv_format}; {describe()}")
    print(f"{'workload (a), prefix cached':44} {'tok/s':>8} {'decode step':>12} {'bound':>9} {'of bound':>9}")
    for cascade in (True, False):
        rate, step = best[cascade]
        bound = decode_bound(engines[cascade], prompts, shared // 16 * 16, cascade)
        name = "shared prefix read once (cascade)" if cascade else "each context on its own"
        print(f"{name:44} {rate:8.1f} {step * 1e3:10.2f}ms {bound * 1e3:7.2f}ms {step / bound:8.2f}x")
    print(f"cascade / on its own: {best[True][0] / best[False][0]:.3f}x output tok/s, "
          f"{best[False][1] / best[True][1]:.3f}x faster decode steps")


if __name__ == "__main__":
    main()
