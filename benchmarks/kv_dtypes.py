"""Quantized KV cache: what each --kv-cache-dtype buys at equal pool memory, and what it costs in speed.

    python benchmarks/kv_dtypes.py [--pool-gib 1] [--long-requests 24] [--mixed-requests 128]

capacity:  the same --kv-cache-memory for bf16, fp8_e4m3, int8 and int4; tokens the pool holds (scales included);
           for a long-context workload (prompts of 2,900 distinct tokens, 128 output tokens each, prefix caching
           off), as many requests as the pool holds whole (the planner's block math) submitted at once, which
           must all run together without a preemption, and --long-requests submitted at once (more than bf16's
           pool holds), the most the engine ran at once and the preemptions it needed; ratios to bf16;
speed:     workload (b) (prompts of 16-512 tokens, 16-256 output tokens) in output tokens/s per KV dtype, the
           ratio to bf16 (a pool large enough that nothing is preempted), on the demo model by default.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workloads import long_text_tokens, mixed_workload  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.cpu_isa import selected_isa  # noqa: E402
from kvserve.planner.budget import max_num_seqs_for_blocks  # noqa: E402

DTYPES = ("bfloat16", "fp8_e4m3", "int8", "int4")
# Long enough answers that every request held is still decoding when the last one's prefill ends.
LONG_PROMPT, LONG_OUTPUT = 2900, 128


def long_context_run(llm: LLM, num_requests: int, prompt_len: int = LONG_PROMPT,
                     output_len: int = LONG_OUTPUT) -> tuple[int, int]:
    """(most requests running at once, preemptions) for distinct long prompts submitted together."""
    engine = llm.engine
    preempted_before = engine.scheduler.num_preemptions
    text = long_text_tokens(llm.get_tokenizer(), prompt_len + num_requests * 7)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for index in range(num_requests):
        engine.add_request(f"long-{num_requests}-{index}", text[index * 7: index * 7 + prompt_len], params)
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    return peak, engine.scheduler.num_preemptions - preempted_before


def mixed_run(llm: LLM, num_requests: int) -> float:
    requests = mixed_workload(llm.get_tokenizer(), num_requests)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    started = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return produced / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--pool-gib", type=float, default=1.0, help="--kv-cache-memory for the capacity runs")
    parser.add_argument("--long-requests", type=int, default=24)
    parser.add_argument("--mixed-requests", type=int, default=128)
    parser.add_argument("--skip-capacity", action="store_true", help="only the speed runs")
    args = parser.parse_args()
    print(f"CPU family {selected_isa().label}; pool {args.pool_gib:g} GiB for capacity")
    if not args.skip_capacity:
        capacity(args)
    speed(args)


def capacity(args: argparse.Namespace) -> None:
    print(f"{'':27}{'held whole, at once':>26}{f'{args.long_requests} at once':>27}")
    print(f"{'KV dtype':10} {'B/token':>8} {'tokens':>8} {'requests':>9} {'x bf16':>7} {'preempt':>8} "
          f"{'peak running':>13} {'x bf16':>7} {'preempt':>8}")
    base_tokens = base_fit = base_peak = None
    for name in DTYPES:
        llm = LLM(args.model, kv_cache_dtype=name, kv_cache_memory=args.pool_gib, max_model_len=4096,
                  enable_prefix_caching=False)
        pool = llm.engine.pool
        fit = max_num_seqs_for_blocks(pool.num_blocks, pool.block_size, LONG_PROMPT + LONG_OUTPUT)
        fit_peak, fit_preemptions = long_context_run(llm, fit)
        peak, preemptions = long_context_run(llm, args.long_requests)
        base_tokens, base_fit, base_peak = base_tokens or pool.num_tokens, base_fit or fit, base_peak or peak
        ran_together = "" if fit_peak == fit else f" (only {fit_peak} ran together)"
        print(f"{name:10} {pool.block_bytes // pool.block_size:8,} {pool.num_tokens:8,} {fit:9} {fit / base_fit:7.2f} "
              f"{fit_preemptions:8} {peak:13} {peak / base_peak:7.2f} {preemptions:8}{ran_together}")
        del llm


def speed(args: argparse.Namespace) -> None:
    print(f"\nworkload (b), {args.mixed_requests} requests, output tok/s")
    base = None
    for name in ("bfloat16", "int8", "int4"):
        llm = LLM(args.model, kv_cache_dtype=name, kv_cache_memory=1.0, max_model_len=4096)
        rate = mixed_run(llm, args.mixed_requests)
        base = base or rate
        print(f"{name:10} {rate:8.1f} tok/s  {rate / base:5.2f}x bf16")
        del llm


if __name__ == "__main__":
    main()
