"""Single-stream decode with and without the plain-weight small-batch matmul, in one run (CPU).

    python benchmarks/small_batch_linear.py [--tokens 200]

1. The demo model's matmuls at one and two rows, every weight once (what one decode step reads): oneDNN's
   packed weights against `small_batch_linear` over the plain ones, best of 10 passes, ms and GB/s.
2. The engine's single-stream decode (one request, `--tokens` tokens, greedy) with the plain copies (the
   default) and without (every matmul through oneDNN's packed weights, as before), tokens/s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from workloads import shared_prefix_workload  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.cpu_isa import selected_isa  # noqa: E402
from kvserve.model.layers import PackedWeight, linear  # noqa: E402


def best_ms(fn, passes: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def matmuls(llm: LLM) -> None:
    model = llm.engine.runner.model
    weights = [getattr(m, n) for m, n in model._matmul_weights()]
    assert all(isinstance(w, PackedWeight) and w.plain is not None for w in weights), "no plain copies kept"
    packed_only = [PackedWeight(w.packed) for w in weights]
    total = sum(w.plain.numel() * w.plain.element_size() for w in weights)
    print(f"matmul weights read per step: {total / 2**20:.1f} MiB ({model.dtype})")
    for rows in (1, 2):
        xs = {w.plain.shape[1]: torch.randn(rows, w.plain.shape[1]).to(model.dtype) for w in weights}
        theirs = best_ms(lambda: [linear(xs[w.plain.shape[1]], p) for w, p in zip(weights, packed_only)])
        ours = best_ms(lambda: [linear(xs[w.plain.shape[1]], w) for w in weights])
        print(f"  {rows} row(s): oneDNN packed {theirs:6.2f} ms ({total / theirs / 1e6:5.1f} GB/s), small_batch_linear "
              f"{ours:6.2f} ms ({total / ours / 1e6:5.1f} GB/s): {theirs / ours:.2f}x")


def single_stream(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == tokens
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    print(f"CPU family {selected_isa().label}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    with_copies = LLM(None, kv_cache_memory=0.5, max_model_len=2048)
    matmuls(with_copies)
    without = LLM(None, kv_cache_memory=0.5, max_model_len=2048)
    for module, name in without.engine.runner.model._matmul_weights():
        setattr(module, name, PackedWeight(getattr(module, name).packed))  # oneDNN for every batch size
    prompt = shared_prefix_workload(with_copies.get_tokenizer(), 1)[0].prompt_token_ids
    runs = {"with plain copies": [], "oneDNN only": []}
    for _ in range(2):  # interleaved, so a change in the machine's load hits both alike
        runs["with plain copies"].append(single_stream(with_copies, prompt, args.tokens))
        runs["oneDNN only"].append(single_stream(without, prompt, args.tokens))
    ours, theirs = max(runs["with plain copies"]), max(runs["oneDNN only"])
    print(f"single stream, {args.tokens} tokens (best of 2): with plain copies {ours:.1f} tok/s, oneDNN only "
          f"{theirs:.1f} tok/s: {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
