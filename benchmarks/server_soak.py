"""Server memory over a long mixed run (issue 33 item 11): does `kvserve serve` give back what requests take?

Starts `kvserve serve` on the demo model, sends `--requests` mixed requests at `--concurrency` (completions and
chat, streamed and not, prompts of 3-700 words, 30% of them opening with one long shared prefix, a fifth
abandoned by the client: a stream closed after its first chunks, or a non-streamed request given up after a short
client timeout), samples the server's RSS (VmRSS) every `--sample-every` requests, and prints the table and the
growth over the last 80% of the run, with the command line, the date and the CPU.

    python benchmarks/server_soak.py                          # 1,000 requests, the issue's acceptance run
    python benchmarks/server_soak.py --requests 300 --max-tokens 8   # a short look

The server's log is written to a temporary folder (its path is printed). Not a timed test: the target is
"grows less than 50 MiB over the last 800 of 1,000 requests", read from the printed table.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import platform
import random
import re
import shlex
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from run_all import ServerProcess, ServerSpec  # noqa: E402

from kvserve.bench.text import random_words  # noqa: E402

SHARED_PREFIX_WORDS = 400
MIB = 1024 * 1024


@dataclass(slots=True)
class SoakCounts:
    """What the client saw, by outcome."""

    completed: int = 0
    aborted: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(slots=True)
class RssSample:
    num_requests: int
    rss_mib: float


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32, help="each request asks for 1..this many tokens")
    parser.add_argument("--sample-every", type=int, default=100, help="requests between RSS samples")
    parser.add_argument("--abort-fraction", type=float, default=0.2)
    parser.add_argument("--shared-fraction", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="a GGUF or HF folder; default: the demo model")
    parser.add_argument("--server-args", default="", help="more `kvserve serve` flags, one quoted string")
    return parser.parse_args(argv)


def server_spec(args: argparse.Namespace) -> ServerSpec:
    flags = ["--max-model-len", "2048"] + (["--model", args.model] if args.model else [])
    flags += shlex.split(args.server_args)
    quiet = ["--disable-log-stats", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    command = [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", "{port}", *flags, *quiet]
    return ServerSpec("kvserve", "kvserve serve", command, "kvserve serve " + " ".join(flags))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        match = re.search(r"^VmRSS:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert match, "no VmRSS line"
    return int(match.group(1)) / 1024


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            match = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read(), re.MULTILINE)
        return match.group(1).strip() if match else platform.processor()
    except OSError:
        return platform.processor()


def make_prompt(rng: random.Random, shared_prefix: str, shared_fraction: float) -> str:
    if rng.random() < shared_fraction:
        return shared_prefix + " " + random_words(rng, rng.randint(3, 700 - SHARED_PREFIX_WORDS))
    return random_words(rng, rng.randint(3, 700))


def request_body(rng: random.Random, prompt: str, max_tokens: int, stream: bool) -> tuple[str, dict]:
    body = {"max_tokens": rng.randint(1, max_tokens), "stream": stream, "temperature": 0.8}
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": prompt}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}


async def send_one(http: httpx.AsyncClient, url: str, body: dict, abort: bool, rng: random.Random,
                   counts: SoakCounts) -> None:
    """One request; `abort` leaves it early, as a client that gives up does."""
    try:
        if body["stream"]:
            await stream_one(http, url, body, abort)
        else:
            timeout = rng.uniform(0.05, 0.5) if abort else 600.0
            response = await http.post(url, json=body, timeout=timeout)
            response.raise_for_status()
        counts.completed += 1
    except httpx.TimeoutException:
        counts.aborted += 1
    except StreamAbandoned:
        counts.aborted += 1
    except httpx.HTTPError as exc:
        counts.failed += 1
        counts.errors.append(f"{type(exc).__name__}: {exc}")


class StreamAbandoned(Exception):
    pass


async def stream_one(http: httpx.AsyncClient, url: str, body: dict, abort: bool) -> None:
    async with http.stream("POST", url, json=body, timeout=600.0) as response:
        response.raise_for_status()
        num_chunks = 0
        async for line in response.aiter_lines():
            num_chunks += line.startswith("data:")
            if abort and num_chunks >= 2:
                raise StreamAbandoned  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                return
    if abort:
        raise StreamAbandoned  # it finished before we could leave: count it as the abort it was meant to be


async def soak(args: argparse.Namespace, base_url: str, pid: int) -> tuple[list[RssSample], SoakCounts]:
    rng = random.Random(args.seed)
    shared_prefix = random_words(random.Random(args.seed + 1), SHARED_PREFIX_WORDS)
    counts = SoakCounts()
    samples = [RssSample(0, rss_mib(pid))]
    next_index = 0
    num_done = 0
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)

    async def worker(http: httpx.AsyncClient) -> None:
        nonlocal next_index, num_done
        while next_index < args.requests:
            next_index += 1
            prompt = make_prompt(rng, shared_prefix, args.shared_fraction)
            path, body = request_body(rng, prompt, args.max_tokens, stream=rng.random() < 0.5)
            await send_one(http, base_url + path, body, rng.random() < args.abort_fraction, rng, counts)
            num_done += 1
            if num_done % args.sample_every == 0 or num_done == args.requests:
                samples.append(RssSample(num_done, rss_mib(pid)))
                print(f"  {num_done:5d} requests: RSS {samples[-1].rss_mib:,.0f} MiB", file=sys.stderr, flush=True)

    async with httpx.AsyncClient(limits=limits) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    await asyncio.sleep(1.0)  # aborts reach the engine within a step; let the last ones land
    samples.append(RssSample(num_done, rss_mib(pid)))
    return samples, counts


def used_blocks(base_url: str) -> str:
    text = httpx.get(base_url + "/metrics", timeout=60).text
    match = re.search(r'^kvserve:kv_cache_blocks\{[^}]*state="used"[^}]*\} (\S+)', text, re.MULTILINE)
    return match.group(1) if match else "?"


def report(args: argparse.Namespace, spec: ServerSpec, samples: list[RssSample], counts: SoakCounts,
           blocks_used: str) -> None:
    print(f"command: python {' '.join(shlex.quote(a) for a in sys.argv)}")
    print(f"server:  {spec.shown_command}")
    print(f"date:    {datetime.date.today().isoformat()}; CPU: {cpu_model()}")
    print(f"requests: {counts.completed} completed, {counts.aborted} aborted by the client, {counts.failed} failed;"
          f" KV blocks in use after the run: {blocks_used}")
    for error in counts.errors[:5]:
        print(f"  error: {error}")
    print("\n| requests | RSS MiB | since previous |")
    print("|---|---|---|")
    for previous, sample in zip([None, *samples], samples):
        delta = "" if previous is None else f"{sample.rss_mib - previous.rss_mib:+,.1f}"
        label = f"{sample.num_requests:,}" if sample is not samples[-1] else f"{sample.num_requests:,} + 1 s idle"
        print(f"| {label} | {sample.rss_mib:,.1f} | {delta} |")
    start = min(samples, key=lambda s: abs(s.num_requests - args.requests * 0.2))
    growth = samples[-1].rss_mib - start.rss_mib
    num_requests = samples[-1].num_requests - start.num_requests
    per_request = growth / num_requests * 1024 if num_requests else 0.0
    print(f"\nRSS growth over the last {num_requests:,} requests (from {start.num_requests:,}): {growth:+,.1f} MiB "
          f"({per_request:+,.1f} KiB a request); target for 1,000 requests: < 50 MiB over the last 800")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    spec = server_spec(args)
    log_path = Path(tempfile.mkdtemp(prefix="kvserve-soak-")) / "server.log"
    print(f"server log: {log_path}", file=sys.stderr)
    # A first start builds the CPU kernels (minutes on a busy machine).
    with ServerProcess(spec, log_path, startup_timeout_s=900) as server:
        samples, counts = asyncio.run(soak(args, server.url, server.process.pid))
        blocks_used = used_blocks(server.url)
    report(args, spec, samples, counts, blocks_used)
    return 0


if __name__ == "__main__":
    sys.exit(main())
