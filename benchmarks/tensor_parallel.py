"""What tensor parallelism costs on this CPU: TP=1 against --tensor-parallel-size N on the same model, one run.

    python benchmarks/tensor_parallel.py [--tp 3] [--model PATH] [--batch 16]

TP exists to serve a model that does not fit one device (each rank holds 1/N of the weights and its own KV
pool for 1/N of the KV heads); on one machine's CPU cores it only adds work: every layer does two all-reduces
over gloo, and the ranks share the same cores and memory bandwidth. This prints, per TP size: weights and KV
bytes per token per rank, single-stream decode tokens/s (128 out) and batch throughput (--batch prompts of
~256 tokens, 64 out, all at once), with the ratio to TP=1. The demo model (SmolLM2-135M: 9 heads, 3 KV heads)
splits at TP 3.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workloads import long_text_tokens  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.cpu_isa import selected_isa  # noqa: E402


def single_stream(llm: LLM, prompt: list[int]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    return 128 / (time.perf_counter() - started)


def batch(llm: LLM, prompts: list[list[int]]) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def measure(model: str | None, tp: int, prompts: list[list[int]]) -> dict:
    llm = LLM(model, tensor_parallel_size=tp, kv_cache_memory=0.5, enable_prefix_caching=False)
    try:
        engine = llm.engine
        return {
            "weights_mib": engine.loaded.weights_bytes / 2**20,
            "kv_bytes_per_token": engine.pool.block_bytes / engine.pool.block_size,
            "single_stream": single_stream(llm, prompts[0]),
            "batch": batch(llm, prompts),
        }
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--tp", type=int, default=3, help="the TP size to compare with 1 (must divide the heads)")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    tokenizer = LLM(args.model, num_gpu_blocks_override=64, max_model_len=1024).get_tokenizer()
    text = long_text_tokens(tokenizer, 256 * args.batch + 64)
    prompts = [text[i * 256:(i + 1) * 256] for i in range(args.batch)]
    print(f"CPU: {selected_isa().label}; model: {args.model or 'demo (SmolLM2-135M)'}; --dtype auto")
    results = {tp: measure(args.model, tp, prompts) for tp in (1, args.tp)}
    base = results[1]
    print(f"{'TP':>3} {'weights/rank MiB':>17} {'KV B/token/rank':>16} {'single tok/s':>13} {'ratio':>6} "
          f"{'batch tok/s':>12} {'ratio':>6}")
    for tp, r in results.items():
        print(f"{tp:>3} {r['weights_mib']:>17.1f} {r['kv_bytes_per_token']:>16.0f} {r['single_stream']:>13.1f} "
              f"{r['single_stream'] / base['single_stream']:>6.2f} {r['batch']:>12.1f} {r['batch'] / base['batch']:>6.2f}")


if __name__ == "__main__":
    main()
