"""Peak memory of the engine serving the demo model with a 1 GiB KV pool, against weights + pool + 600 MiB.

    python benchmarks/memory.py [--model PATH] [--kv-cache-memory GIB]

Runs the offline benchmark's workload (a) (32 prompts of ~430 tokens, 64 output tokens each) and reports the
process's peak RSS next to the bytes it cannot avoid: the weights and the preallocated KV pool.
"""

from __future__ import annotations

import argparse
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workloads import shared_prefix_workload  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402

MIB = 2**20
BUDGET_OVERHEAD_MIB = 600


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # ru_maxrss is KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--kv-cache-memory", type=float, default=1.0)
    args = parser.parse_args()
    before = peak_rss_mib()
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory)
    requests = shared_prefix_workload(llm.get_tokenizer())
    llm.generate([r.prompt_token_ids for r in requests], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True),
                 use_tqdm=False)
    weights = llm.engine.loaded.weights_bytes / MIB
    pool = llm.engine.pool.pool_bytes / MIB
    peak = peak_rss_mib()
    limit = weights + pool + BUDGET_OVERHEAD_MIB
    print(f"interpreter + libraries before loading: {before:.0f} MiB")
    print(f"weights {weights:.0f} MiB + KV pool {pool:.0f} MiB = {weights + pool:.0f} MiB")
    print(f"peak RSS {peak:.0f} MiB; overhead over weights + pool {peak - weights - pool:.0f} MiB "
          f"(budget {BUDGET_OVERHEAD_MIB} MiB): {'OK' if peak <= limit else 'OVER'}")


if __name__ == "__main__":
    main()
