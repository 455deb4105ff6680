"""The gateway against its baselines, in one run: three `kvserve serve` backends on the demo model, two gateways
in front of them (session routing and round robin, both `kvserve gateway` processes over one redis-server, or
SQLite when redis-server is not installed), and

1. a multi-turn chat workload (the bench's `multi-turn` sessions, each session its own `user`, every turn
   resending the history with the server's actual answers, after a think time) through each gateway: the backends' prefix-cache
   hit rate over the run (their own vllm:prefix_cache_* counters), TTFT p95, how requests spread, and where
   the misses come from (each turn's cached_tokens against the previous turn's prompt + answer);
2. the gateway's overhead: small requests sent alternately to a backend directly and through the gateway
   (pinned to that backend by a session), p50 latency difference; and streams' inter-chunk gaps both ways;
3. with --skewed, the skewed case: one session per key, a few very active sessions on one backend; every
   backend's queue against the mean, with the gateway's rebalancing on and off.

    python benchmarks/gateway.py [--num-sessions 24 --num-turns 10 ...] [--skewed]
    python benchmarks/gateway.py --skip-routing --overhead-repeats 5      # the overhead only

The two policies' workloads use different seeds, so neither run finds the other's text in a cache.
Everything shares this machine's cores: the absolute figures move with its load, the ratios much less.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).parent))
from run_all import ServerProcess, ServerSpec, free_port  # noqa: E402

from kvserve.bench.client import CHAT, COMPLETIONS, Target, make_http_client, send_request  # noqa: E402
from kvserve.bench.prompts import chat_messages  # noqa: E402
from kvserve.bench.records import RequestRecord  # noqa: E402
from kvserve.bench.text import WordText  # noqa: E402
from kvserve.bench.workloads import MultiTurnWorkload  # noqa: E402

TOKENS_PER_WORD = 1.3  # the demo tokenizer on the bench's random words, near enough for sizing
COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total", "vllm:prompt_tokens_total")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-backends", type=int, default=3)
    # Long chats: a shared system prompt, ten turns of short questions and longer answers (LMSYS-Chat-1M's
    # averages are ~70 tokens a question, ~215 an answer), 24 users at once.
    parser.add_argument("--num-sessions", type=int, default=24)
    parser.add_argument("--num-turns", type=int, default=10)
    parser.add_argument("--max-concurrency", type=int, default=24, help="sessions in flight at once")
    parser.add_argument("--system-prompt-len", type=int, default=64)
    parser.add_argument("--user-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    # Users read an answer before they type the next turn. Without a pause the sessions run in lock-step: one
    # backend's sessions all arrive in the same moment each turn, and every backend prefills at once on cores
    # they share, which no deployment of independent users does.
    parser.add_argument("--think-time", type=float, default=2.0,
                        help="mean seconds between an answer and the next turn (exponential; sessions also start "
                             "spread over one mean think time); 0: none, every session in lock-step")
    # Each backend's pool holds its share of the live sessions (8 x ~1,700 tokens at the last turn, 23,040 B a
    # token on the demo model), as a deployment sized for its sessions would: not every session on every backend.
    parser.add_argument("--kv-cache-memory", type=float, default=0.29, help="GiB of KV pool per backend")
    # Three backends share this machine's cores where a deployment gives each its own. With torch's default (a
    # thread per core) each backend's OpenMP regions wait at every barrier for a thread another backend's process
    # holds: steps stretch by scheduler time slices, and every backend's TTFT with them, whatever the routing.
    parser.add_argument("--backend-threads", type=int, default=1,
                        help="torch threads per backend (OMP_NUM_THREADS); 0: torch's default, one per core each")
    parser.add_argument("--overhead-requests", type=int, default=200)
    parser.add_argument("--overhead-streams", type=int, default=20)
    parser.add_argument("--overhead-repeats", type=int, default=1,
                        help="measure the overhead this many times over (the spread of a shared machine)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-routing", action="store_true", help="measure only the overhead")
    parser.add_argument("--skip-overhead", action="store_true", help="measure only the routing")
    parser.add_argument("--skewed", action="store_true",
                        help="also the skewed case: one session per key, a few very active sessions that share a "
                             "backend; every backend's queue against the mean, rebalancing on and off")
    parser.add_argument("--skew-sessions", type=int, default=12)
    parser.add_argument("--skew-hot", type=int, default=3, help="very active sessions, all on one backend")
    parser.add_argument("--skew-parallel", type=int, default=4, help="requests each hot session keeps in flight")
    parser.add_argument("--skew-requests", type=int, default=12, help="requests per parallel stream of a hot session")
    parser.add_argument("--log-dir", default=None, help="where server logs go (default: a temp dir)")
    return parser.parse_args(argv)


def backend_spec(kv_cache_memory: float, threads: int) -> ServerSpec:
    threads_env = ["env", f"OMP_NUM_THREADS={threads}"] if threads > 0 else []
    command = [*threads_env, sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", "{port}",
               "--max-model-len", "4096", "--kv-cache-memory", str(kv_cache_memory), "--disable-log-stats"]
    return ServerSpec("backend", "kvserve serve", command, "kvserve serve")


def gateway_spec(backend_urls: list[str], routing: str, store_flags: list[str], *extra: str) -> ServerSpec:
    command = [sys.executable, "-m", "kvserve.cli", "gateway", "--host", "127.0.0.1", "--port", "{port}",
               "--backend", *backend_urls, "--routing", routing, "--log-level", "warning", *store_flags, *extra]
    title = " ".join(["kvserve gateway --routing", routing, *extra])
    return ServerSpec(f"gateway-{routing}", title, command, "kvserve gateway")


@contextlib.contextmanager
def state_store(work: Path, count: int = 2):
    """Flags for `count` gateways' stores (Redis databases 0, 1, ..., or SQLite files) and what it is."""
    redis_server = shutil.which("redis-server")
    if redis_server is None:
        yield [["--state-path", str(work / f"gw{i}.sqlite3")] for i in range(count)], "SQLite"
        return
    port = free_port()
    process = subprocess.Popen([redis_server, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(work),
                                "--save", ""], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(200):  # until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield [["--redis-url", f"redis://127.0.0.1:{port}/{i}"] for i in range(count)], "Redis"
    finally:
        process.terminate()
        process.wait(timeout=10)


def create_key(store_flags: list[str], name: str = "bench") -> str:
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "gateway", "keys", "create", "--name", name,
                             "--rpm", "1000000", *store_flags], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()[0]


def create_keys(store_flags: list[str], count: int) -> list[str]:
    """`count` keys in one process (the CLI would start Python once a key)."""
    from kvserve.gateway.keys import create_key as create_stored_key
    from kvserve.gateway.store import open_store

    redis_url = store_flags[1] if store_flags[0] == "--redis-url" else None
    state_path = store_flags[1] if store_flags[0] == "--state-path" else ""

    async def create() -> list[str]:
        store = open_store(redis_url, state_path)
        try:
            return [(await create_stored_key(store, f"skew-{i}", 1_000_000))[0] for i in range(count)]
        finally:
            await store.close()

    return asyncio.run(create())


def scrape(url: str) -> dict[str, float]:
    totals = dict.fromkeys(COUNTERS, 0.0)
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


async def run_sessions(gateway_url: str, api_key: str, model: str, workload: MultiTurnWorkload,
                       args: argparse.Namespace, label: str) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    gate = asyncio.Semaphore(args.max_concurrency)
    started = time.perf_counter()
    async with make_http_client(600.0) as http:
        async def session(index: int) -> None:
            target = Target(gateway_url, model, CHAT, api_key, temperature=0.0, ignore_eos=True,
                            extra_body={"user": f"{label}-{index}"})
            conversation, replies = workload.session(index), []
            await asyncio.sleep(index * args.think_time / args.num_sessions)
            async with gate:
                for turn in range(args.num_turns):
                    await asyncio.sleep(conversation.turns[turn].delay_s)
                    record = RequestRecord(index, turn, time.perf_counter() - started, args.output_len)
                    await send_request(http, target, record, chat_messages(conversation, turn, replies), 600.0)
                    records.append(record)
                    if not record.ok:
                        return
                    replies.append(record.output_text)

        await asyncio.gather(*(session(i) for i in range(args.num_sessions)))
    return records


BLOCK_SIZE = 16  # kvserve serve's default --block-size: only whole blocks are cached


def miss_breakdown(records: list[RequestRecord]) -> dict[str, float]:
    """Where each turn's prompt tokens came from, as the backends' usage reports them: cached, or missed because
    it is turn 1 (nothing of the session yet; the shared system prompt may hit), because it is the turn's new text
    (the user message and the template's tokens around it), because the previous answer ended inside a block
    (only whole blocks are cached, and the answer's last token never went through the model), or because the history the previous turn left was not there (evicted, the
    session moved, or a template that renders earlier turns differently): shares of all prompt tokens."""
    parts = dict.fromkeys(("cached", "turn 1", "new text", "block tails", "history not found"), 0.0)
    by_session: dict[int, list[RequestRecord]] = {}
    for record in records:
        if record.ok and record.prompt_tokens is not None and record.cached_tokens is not None:
            by_session.setdefault(record.session_index, []).append(record)
    for turns in by_session.values():
        history = 0  # the previous turn's prompt + answer: all a perfect cache could hold for this turn
        for record in sorted(turns, key=lambda r: r.turn_index):
            prompt, cached = record.prompt_tokens, record.cached_tokens
            parts["cached"] += cached
            if record.turn_index == 0:
                parts["turn 1"] += prompt - cached
            else:
                whole_blocks = (history - 1) // BLOCK_SIZE * BLOCK_SIZE
                parts["new text"] += prompt - history
                parts["block tails"] += history - whole_blocks
                parts["history not found"] += max(0, whole_blocks - cached)
            history = prompt + (record.completion_tokens or 0)
    total = sum(r.prompt_tokens for turns in by_session.values() for r in turns) or 1
    return {name: value / total for name, value in parts.items()}


def ttft_by_turn(records: list[RequestRecord]) -> dict[int, tuple[float, float]]:
    """TTFT p50 and p95 (ms) of each turn index."""
    turns: dict[int, list[float]] = {}
    for record in records:
        turns.setdefault(record.turn_index, []).append(record.ttft_s * 1000)
    return {turn: (float(np.percentile(v, 50)), float(np.percentile(v, 95))) for turn, v in sorted(turns.items())}


def tail_breakdown(tail: list[RequestRecord]) -> dict[str, float]:
    """What the requests at or above the TTFT p95 were: their turns, how much of their prompt the backend had
    cached, and their prompt length (the prefill they waited for, or the one they queued behind)."""
    if not tail:
        return {}
    cached = [r.cached_tokens / r.prompt_tokens for r in tail if r.cached_tokens is not None and r.prompt_tokens]
    return {"requests": len(tail), "median turn": float(np.median([r.turn_index + 1 for r in tail])),
            "mostly cached (>= 50%)": float(np.mean([c >= 0.5 for c in cached])) if cached else float("nan"),
            "median prompt tokens": float(np.median([r.prompt_tokens or 0 for r in tail]))}


def policy_run(gateway: ServerProcess, backends: list[ServerProcess], api_key: str, model: str, seed: int,
               args: argparse.Namespace, label: str) -> dict:
    workload = MultiTurnWorkload(WordText(TOKENS_PER_WORD), seed, args.num_turns, args.system_prompt_len,
                                 args.user_len, args.output_len, think_time_s=args.think_time)
    before, decisions_before = [scrape(b.url) for b in backends], scrape_decisions(gateway.url)
    records = asyncio.run(run_sessions(gateway.url, api_key, model, workload, args, label))
    after, decisions_after = [scrape(b.url) for b in backends], scrape_decisions(gateway.url)
    delta = [{name: a[name] - b[name] for name in COUNTERS} for a, b in zip(after, before)]
    hits = sum(d["vllm:prefix_cache_hits_total"] for d in delta)
    queries = sum(d["vllm:prefix_cache_queries_total"] for d in delta)
    ok = [r for r in records if r.ok]
    prompt_shares = [d["vllm:prompt_tokens_total"] for d in delta]
    p95 = float(np.percentile([r.ttft_s for r in ok], 95))
    return {
        "ttft_by_turn": ttft_by_turn(ok),
        "tail": tail_breakdown([r for r in ok if r.ttft_s >= p95]),
        "requests": len(records), "failed": len(records) - len(ok),
        "hit_rate": hits / queries if queries else 0.0,
        "ttft_p50_ms": float(np.percentile([r.ttft_s for r in ok], 50) * 1000),
        "ttft_p95_ms": float(np.percentile([r.ttft_s for r in ok], 95) * 1000),
        "prompt_tokens_by_backend": prompt_shares,
        "misses": miss_breakdown(records),
        "decisions": {reason: count - decisions_before.get(reason, 0.0) for reason, count in decisions_after.items()
                      if count > decisions_before.get(reason, 0.0)},
    }


def timed_post(client: httpx.Client, url: str, body: dict, headers: dict[str, str]) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    response = client.post(url, json=body, headers=headers)
    return time.perf_counter() - started, response


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds the process has used, from /proc ((0, 0) where there is none)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0, 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks  # utime, stime: fields 14 and 15 of stat(5)


def overhead_run(gateway: ServerProcess, api_key: str, model: str, args: argparse.Namespace) -> dict:
    """Small requests, one at a time, alternating direct and through the gateway, to the same backend;
    `--overhead-repeats` times over, each repeat's added p50 kept for the spread."""
    body = {"model": model, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    pinned = {"Authorization": f"Bearer {api_key}", "X-Session-ID": "overhead-probe"}
    direct, through, added_by_repeat = [], [], []
    with httpx.Client(timeout=60) as client:
        _, first = timed_post(client, f"{gateway.url}/v1/completions", body, pinned)
        backend_url = first.headers["x-kvserve-backend"]
        # The gateway's own CPU per request: what it costs whatever the machine's load does to the wall clock.
        cpu_before = cpu_seconds(gateway.process.pid)
        for _ in range(args.overhead_repeats):
            repeat_direct, repeat_through = [], []
            for _ in range(args.overhead_requests):
                repeat_direct.append(timed_post(client, f"{backend_url}/v1/completions", body, {})[0])
                repeat_through.append(timed_post(client, f"{gateway.url}/v1/completions", body, pinned)[0])
            added_by_repeat.append(float((np.median(repeat_through) - np.median(repeat_direct)) * 1000))
            direct += repeat_direct
            through += repeat_through
        cpu_after = cpu_seconds(gateway.process.pid)
    gaps = asyncio.run(stream_gaps(gateway.url, backend_url, api_key, model, args.overhead_streams))
    return {"direct_p50_ms": float(np.median(direct) * 1000), "gateway_p50_ms": float(np.median(through) * 1000),
            "added_p50_ms": float((np.median(through) - np.median(direct)) * 1000),
            # Each gateway request beside the direct one just before it: steadier when the machine's load drifts.
            "added_paired_p50_ms": float(np.median(np.subtract(through, direct)) * 1000),
            "added_p50_by_repeat_ms": added_by_repeat,
            "gateway_cpu_ms": [(after - before) * 1000 / len(through) for after, before in zip(cpu_after, cpu_before)],
            "direct_p90_ms": float(np.percentile(direct, 90) * 1000),
            "gateway_p90_ms": float(np.percentile(through, 90) * 1000),
            "itl_direct_p50_ms": gaps[0], "itl_gateway_p50_ms": gaps[1]}


async def stream_gaps(gateway_url: str, backend_url: str, api_key: str, model: str, count: int) -> tuple[float, float]:
    """p50 gap between a stream's text chunks, direct and through the gateway (streams must not be held back)."""
    gaps: dict[str, list[float]] = {"direct": [], "gateway": []}
    targets = {"direct": Target(backend_url, model, COMPLETIONS, ignore_eos=True),
               "gateway": Target(gateway_url, model, COMPLETIONS, api_key, ignore_eos=True,
                                 extra_body={"user": "overhead-probe-stream"})}
    async with make_http_client(600.0) as http:
        for index in range(count):
            for name, target in targets.items():
                record = RequestRecord(index, 0, 0.0, 64)
                await send_request(http, target, record, "Tell me about caches.", 600.0)
                gaps[name].extend(record.inter_token_latencies_s)
    return float(np.median(gaps["direct"]) * 1000), float(np.median(gaps["gateway"]) * 1000)


# ---- the skewed case ------------------------------------------------------------------------------------------

SKEW_OUTPUT_LEN = 16


def skew_body(model: str, session: str, index: int) -> dict:
    # Short, distinct prompts: this case is about queues, not caching.
    return {"model": model, "user": session, "max_tokens": SKEW_OUTPUT_LEN, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"{session} request {index}: say something about queues."}]}


async def sample_queues(backend_urls: list[str], stop: asyncio.Event, interval_s: float = 0.2) -> list[list[float]]:
    """Each backend's running + waiting requests from its /metrics, every interval, until `stop`."""
    samples: list[list[float]] = []
    async with httpx.AsyncClient(timeout=10) as http:
        while not stop.is_set():
            row = []
            for url in backend_urls:
                totals = {"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 0.0}
                for family in text_string_to_metric_families((await http.get(f"{url}/metrics")).text):
                    for sample in family.samples:
                        if sample.name in totals:
                            totals[sample.name] += sample.value
                row.append(sum(totals.values()))
            samples.append(row)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
    return samples


async def skewed_run(gateway_url: str, backend_urls: list[str], keys: list[str], model: str,
                     args: argparse.Namespace) -> dict:
    """Sessions placed first (one warm-up request each, one key each); then the hot ones (sessions the gateway
    put on the same backend: the unlucky case) keep `skew_parallel` requests in flight while the others send one
    at a time with a pause, until the hot ones are done."""
    sessions = [f"skew-{i}" for i in range(args.skew_sessions)]
    async with httpx.AsyncClient(timeout=600) as http:
        async def post(session: str, key: str, index: int) -> httpx.Response:
            return await http.post(f"{gateway_url}/v1/chat/completions", json=skew_body(model, session, index),
                                   headers={"Authorization": f"Bearer {key}"})

        placed: dict[str, str] = {}
        for session, key in zip(sessions, keys):
            placed[session] = (await post(session, key, 0)).headers["x-kvserve-backend"]
        crowded = max(backend_urls, key=lambda url: list(placed.values()).count(url))
        hot = [s for s in sessions if placed[s] == crowded][: args.skew_hot]
        key_of = dict(zip(sessions, keys))
        hot_done = asyncio.Event()
        failed = [0]

        async def hot_stream(session: str, stream: int) -> None:
            for index in range(args.skew_requests):
                failed[0] += (await post(session, key_of[session], 1000 * stream + index + 1)).status_code != 200

        async def cold_session(session: str) -> None:
            index = 0
            while not hot_done.is_set():
                index += 1
                failed[0] += (await post(session, key_of[session], index)).status_code != 200
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(hot_done.wait(), 0.5)

        stop_sampling = asyncio.Event()
        sampler = asyncio.create_task(sample_queues(backend_urls, stop_sampling))
        cold = [asyncio.create_task(cold_session(s)) for s in sessions if s not in hot]
        await asyncio.gather(*(hot_stream(s, k) for s in hot for k in range(args.skew_parallel)))
        hot_done.set()
        await asyncio.gather(*cold)
        stop_sampling.set()
        samples = await sampler
        decisions = scrape_decisions(gateway_url)
    mean_by_backend = np.mean(np.array(samples), axis=0)
    overall = float(np.mean(mean_by_backend))
    return {"hot": len(hot), "queue_by_backend": [float(q) for q in mean_by_backend],
            "max_over_mean": float(np.max(mean_by_backend) / overall) if overall else 0.0,
            "rebalance": decisions.get("rebalance", 0.0), "failover": decisions.get("failover", 0.0),
            "failed": failed[0],
            "samples": len(samples)}


def skewed_runs(urls: list[str], store_flags: list[list[str]], model: str, work: Path,
                args: argparse.Namespace) -> dict[str, dict]:
    """The skewed case through two fresh gateways (each its own store): rebalancing on (the default) and off.
    Both read the backends' /metrics every second: with the default 5 s, llm-d's saturation rule (waiting = the
    gateway's in-flight requests past the backend's last reported running ones) sees a burst as a queue and
    moves sessions too, which would hide what the rebalancing does."""
    rows = {}
    for index, (name, extra) in enumerate((("session, rebalancing (default)", []),
                                           ("session, --rebalance-ratio 0", ["--rebalance-ratio", "0"]))):
        print(f"skewed: {name} ...", flush=True)
        spec = gateway_spec(urls, "session", store_flags[index], "--health-interval", "1", *extra)
        with ServerProcess(spec, work / f"gateway-skewed-{index}.log") as gateway:
            keys = create_keys(store_flags[index], args.skew_sessions)
            rows[name] = asyncio.run(skewed_run(gateway.url, urls, keys, model, args))
    return rows


def scrape_decisions(gateway_url: str) -> dict[str, float]:
    decisions: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{gateway_url}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "kvserve:gateway_routing_decisions_total":
                decisions[sample.labels["reason"]] = sample.value
    return decisions


def report_skewed(rows: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\nskewed: {args.skew_sessions} sessions, one key each; {args.skew_hot} hot sessions placed on one "
          f"backend keep {args.skew_parallel} requests in flight each ({args.skew_requests} each), the rest one "
          f"at a time with 0.5 s pauses; {SKEW_OUTPUT_LEN} tokens out; queue = running + waiting, sampled every 0.2 s")
    print(f"{'':30}{'mean queue by backend':>26}{'max / mean':>12}{'moved: rebalance':>18}{'failover':>10}"
          f"{'failed':>8}")
    for name, row in rows.items():
        queues = " / ".join(f"{q:.1f}" for q in row["queue_by_backend"])
        print(f"{name:30}{queues:>26}{row['max_over_mean']:>11.2f}x{row['rebalance']:>18.0f}{row['failover']:>10.0f}"
              f"{row['failed']:>8}")


def report(session: dict | None, round_robin: dict | None, overhead: dict | None, store: str,
           args: argparse.Namespace) -> None:
    if session is not None and round_robin is not None:
        report_routing(session, round_robin, store, args)
    if overhead is not None:
        report_overhead(overhead, args)


def report_routing(session: dict, round_robin: dict, store: str, args: argparse.Namespace) -> None:
    def shares(row: dict) -> str:
        total = sum(row["prompt_tokens_by_backend"]) or 1.0
        return " / ".join(f"{100 * t / total:.0f}%" for t in row["prompt_tokens_by_backend"])

    print(f"\n{args.num_backends} backends (demo model), state in {store}; {args.num_sessions} sessions x "
          f"{args.num_turns} turns, system {args.system_prompt_len} + user {args.user_len} tokens a turn, "
          f"{args.output_len} out, {args.max_concurrency} sessions at once, think time {args.think_time:g} s, "
          f"{args.backend_threads or 'default'} torch thread(s) per backend")
    print(f"{'':28}{'session routing':>18}{'round robin':>14}{'ratio':>9}")
    print(f"{'prefix-cache hit rate':28}{session['hit_rate']:>17.1%}{round_robin['hit_rate']:>14.1%}"
          f"{session['hit_rate'] / max(round_robin['hit_rate'], 1e-9):>8.2f}x")
    for key, name in (("ttft_p95_ms", "TTFT p95 (ms)"), ("ttft_p50_ms", "TTFT p50 (ms)")):
        print(f"{name:28}{session[key]:>18.1f}{round_robin[key]:>14.1f}{session[key] / round_robin[key]:>8.2f}x")
    print(f"{'failed requests':28}{session['failed']:>18}{round_robin['failed']:>14}")
    print(f"{'prompt tokens by backend':28}{shares(session):>18}  {shares(round_robin):>14}")
    print("prompt tokens, from the answers' usage (cached_tokens per turn):")
    for part in session["misses"]:
        print(f"  {part:26}{session['misses'][part]:>17.1%}{round_robin['misses'][part]:>14.1%}")
    for name, row in (("session routing", session), ("round robin", round_robin)):
        counts = ", ".join(f"{reason} {count:.0f}" for reason, count in sorted(row["decisions"].items()))
        print(f"routing decisions, {name}: {counts}")
    print("TTFT by turn, p50 / p95 (ms):")
    for turn in session["ttft_by_turn"]:
        ours, theirs = session["ttft_by_turn"][turn], round_robin["ttft_by_turn"].get(turn, (float("nan"),) * 2)
        print(f"  turn {turn + 1:<21}{ours[0]:>9.0f} / {ours[1]:<6.0f}{theirs[0]:>7.0f} / {theirs[1]:<6.0f}"
              f"{ours[1] / theirs[1]:>6.2f}x")
    print("the requests at or above each policy's TTFT p95:")
    for part in session["tail"]:
        print(f"  {part:26}{session['tail'][part]:>17.2f}{round_robin['tail'].get(part, float('nan')):>14.2f}")


def report_overhead(overhead: dict, args: argparse.Namespace) -> None:
    num_requests = args.overhead_requests * args.overhead_repeats
    print(f"\ngateway overhead, {num_requests} requests each way (max_tokens 1, one at a time): "
          f"direct p50 {overhead['direct_p50_ms']:.2f} ms, through the gateway {overhead['gateway_p50_ms']:.2f} ms, "
          f"added p50 {overhead['added_p50_ms']:.2f} ms (paired p50 {overhead['added_paired_p50_ms']:.2f} ms) "
          f"({overhead['gateway_p50_ms'] / overhead['direct_p50_ms']:.2f}x); p90 {overhead['direct_p90_ms']:.2f} / "
          f"{overhead['gateway_p90_ms']:.2f} ms")
    user_ms, system_ms = overhead["gateway_cpu_ms"]
    print(f"the gateway process's CPU per request: {user_ms + system_ms:.2f} ms (user {user_ms:.2f}, system "
          f"{system_ms:.2f}; loopback sends run the receiver's TCP path in the sender's system time)")
    repeats = overhead["added_p50_by_repeat_ms"]
    if len(repeats) > 1:
        print(f"added p50 in each of {len(repeats)} repeats: " + ", ".join(f"{r:.2f}" for r in repeats)
              + f" ms (median {np.median(repeats):.2f}, min {min(repeats):.2f}, max {max(repeats):.2f})")
    print(f"stream inter-chunk gap p50, {args.overhead_streams} streams of 64 tokens each way: direct "
          f"{overhead['itl_direct_p50_ms']:.2f} ms, through the gateway {overhead['itl_gateway_p50_ms']:.2f} ms "
          f"({overhead['itl_gateway_p50_ms'] / overhead['itl_direct_p50_ms']:.2f}x)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvserve-gateway-bench-") as temp, contextlib.ExitStack() as stack:
        work = Path(args.log_dir or temp)
        print(f"starting {args.num_backends} backends (logs in {work}) ...", flush=True)
        backends = [stack.enter_context(ServerProcess(backend_spec(args.kv_cache_memory, args.backend_threads), work / f"backend{i}.log"))
                    for i in range(args.num_backends)]
        model = httpx.get(f"{backends[0].url}/v1/models", timeout=10).json()["data"][0]["id"]
        store_flags, store = stack.enter_context(state_store(work, 4 if args.skewed else 2))
        urls = [b.url for b in backends]
        session_gateway = stack.enter_context(ServerProcess(gateway_spec(urls, "session", store_flags[0]),
                                                            work / "gateway-session.log"))
        round_robin_gateway = stack.enter_context(ServerProcess(gateway_spec(urls, "round-robin", store_flags[1]),
                                                                work / "gateway-round-robin.log"))
        keys = [create_key(flags) for flags in store_flags[:2]]
        session = round_robin = overhead = None
        if not args.skip_routing:
            print("round robin ...", flush=True)
            round_robin = policy_run(round_robin_gateway, backends, keys[1], model, args.seed + 1, args, "rr")
            print("session routing ...", flush=True)
            session = policy_run(session_gateway, backends, keys[0], model, args.seed, args, "session")
        if not args.skip_overhead:
            print("overhead ...", flush=True)
            overhead = overhead_run(session_gateway, keys[0], model, args)
        skew = skewed_runs(urls, store_flags[2:], model, work, args) if args.skewed else None
        report(session, round_robin, overhead, store, args)
        if skew:
            report_skewed(skew, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
