"""The seed's idle-session scenario: sessions with long histories in a pool that holds only a few of them; each
comes back after the others ran. Time to first token of the returning turn, in one run, with its history
recomputed (no tier), loaded from the host tier, and loaded from the disk tier (after dropping the page cache
where the machine allows), then after an engine restart with the same --kv-disk-path.

    python benchmarks/idle_sessions.py [--sessions 6] [--history 4000] [--pool-sessions 2]

Offline engine (no HTTP): TTFT is the time to prefill the returning turn and sample its first token. Also: the
mixed workload (b) with the host tier on and nothing ever returning, against tiers off (what a tier costs).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from workloads import long_text_tokens, mixed_workload  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.cpu_isa import selected_isa  # noqa: E402

FIRST = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
RETURNING = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
GIB = 2**30


def histories(llm: LLM, sessions: int, length: int) -> list[list[int]]:
    text = long_text_tokens(llm.get_tokenizer(), length + sessions * 97)
    return [text[s * 97: s * 97 + length] for s in range(sessions)]


def first_turns(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    """Runs each session's first turn, one after the other; returns the returning turns' prompts."""
    follow_up = llm.get_tokenizer().encode("\nAnd what happened next?", add_special_tokens=False)
    turns = []
    for prompt in prompts:
        output = llm.generate([prompt], FIRST, use_tqdm=False)[0]
        turns.append(prompt + output.outputs[0].token_ids + follow_up)
    return turns


def returning_ttfts(llm: LLM, turns: list[list[int]]) -> tuple[list[float], int, dict[str, int]]:
    """TTFT of each returning turn, oldest session first; tokens served by the cache, and loaded per tier."""
    ttfts, cached, loaded = [], 0, {}
    for turn in turns:
        started = time.perf_counter()
        output = llm.generate([turn], RETURNING, use_tqdm=False)[0]
        ttfts.append(time.perf_counter() - started)
        cached += output.num_cached_tokens
        for tier, tokens in output.tier_loaded_tokens.items():
            loaded[tier] = loaded.get(tier, 0) + tokens
    return ttfts, cached, loaded


def drop_page_cache() -> bool:
    """Only clean pages can be dropped: dirty ones (files written but not yet written back) are synced first,
    or they would still be read from memory."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1\n")
        return True
    except OSError:
        return False


def p95(values: list[float]) -> float:
    return statistics.quantiles(values, n=20)[-1] if len(values) >= 2 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the demo model")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--history", type=int, default=4000, help="tokens of each session's history")
    parser.add_argument("--pool-sessions", type=float, default=2.0, help="how many histories the pool holds")
    parser.add_argument("--mixed-requests", type=int, default=96, help="0: skip what the host tier costs workload (b)")
    args = parser.parse_args()
    probe = LLM(args.model, kv_cache_memory=0.05, max_model_len=1024)
    prompts = histories(probe, args.sessions, args.history)
    pool_gib = args.pool_sessions * (args.history + 64) * probe.engine.pool.block_bytes / probe.engine.pool.block_size / GIB
    del probe
    common = dict(kv_cache_memory=pool_gib, max_model_len=args.history + 256)
    print(f"CPU family {selected_isa().label}; {args.sessions} sessions x {args.history} tokens, pool {pool_gib:.3f} GiB "
          f"(~{args.pool_sessions:g} histories)")
    results = {}
    baseline = LLM(args.model, **common)
    turns = first_turns(baseline, prompts)
    results["no tier (recompute)"] = returning_ttfts(baseline, turns)
    del baseline
    host = LLM(args.model, kv_offloading_size=4.0, **common)
    first_turns(host, prompts)
    results["host tier"] = returning_ttfts(host, turns)
    del host
    with tempfile.TemporaryDirectory(prefix="kvserve-disk-tier-") as folder:
        disk = LLM(args.model, kv_disk_path=folder, **common)
        first_turns(disk, prompts)
        disk.engine.tiers.tier("disk").flush()
        dropped = drop_page_cache()
        results[f"disk tier ({'page cache dropped' if dropped else 'page cache kept: not allowed here'})"] = \
            returning_ttfts(disk, turns)
        disk.close()
        restarted = LLM(args.model, kv_disk_path=folder, **common)
        drop_page_cache()
        results["disk tier after a restart"] = returning_ttfts(restarted, turns)
        del restarted, disk
    base = p95(results["no tier (recompute)"][0])
    history_tokens = sum(len(t) for t in turns)
    print(f"{'returning turn':52} {'TTFT p50':>9} {'TTFT p95':>9} {'p95 ratio':>10} {'cached':>8} {'loaded':>16}")
    for name, (ttfts, cached, loaded) in results.items():
        loaded_text = ", ".join(f"{tier} {tokens}" for tier, tokens in loaded.items()) or "-"
        print(f"{name:52} {statistics.median(ttfts):8.3f}s {p95(ttfts):8.3f}s {p95(ttfts) / base:9.3f}x "
              f"{cached / history_tokens:7.1%} {loaded_text:>16}")
    restart_loaded = results["disk tier after a restart"][2].get("disk", 0)
    print(f"after the restart, {restart_loaded / history_tokens:.1%} of the returning turns' tokens were loaded "
          f"from disk")
    if args.mixed_requests > 0:
        print_tier_cost(args)


def print_tier_cost(args: argparse.Namespace) -> None:
    """Workload (b) with the host tier on and nothing ever returning, against tiers off."""
    print(f"\nworkload (b), {args.mixed_requests} requests, nothing returning: output tok/s")
    rates = {}
    for name, extra in (("tiers off", {}), ("host tier on", {"kv_offloading_size": 4.0})):
        llm = LLM(args.model, kv_cache_memory=0.25, max_model_len=4096, **extra)
        requests = mixed_workload(llm.get_tokenizer(), args.mixed_requests)
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        started = time.perf_counter()
        llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
        rates[name] = sum(r.max_tokens for r in requests) / (time.perf_counter() - started)
        del llm
    for name, rate in rates.items():
        print(f"{name:14} {rate:8.1f} tok/s {rate / rates['tiers off']:6.3f}x")


if __name__ == "__main__":
    main()
