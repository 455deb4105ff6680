"""The benchmark suite: where kvserve stands against its baselines and peers on this machine, in one command.

    python benchmarks/run_all.py [--quick] [--model PATH] [--llama-server PATH] [--llama-model GGUF]
    kvserve bench suite [same flags]

1. offline throughput, kvserve vs transformers `generate` (benchmarks/offline_throughput.py, a subprocess);
2. kvserve servers with prefix caching on and off (`kvserve serve` subprocesses), driven over HTTP by
   `kvserve bench`: a shared system prompt, multi-turn chats, and unrelated random prompts (the control);
3. the seed's run: 1,000 requests sharing a 2K-token system prompt at concurrency 32, P95 TTFT;
4. llama.cpp's llama-server on the same GGUF with the same workloads, when one is on PATH (else a note);
5. peak memory (benchmarks/memory.py).
Writes benchmarks/RESULTS.md, PNG plots and each run's JSON (for `kvserve bench compare`) in
benchmarks/results/. `--quick` is a smoke run of every part with a few requests each (a few minutes).

Everything runs on the same machine as the servers, so the load generator's own CPU time is part of what
the servers compete with; on a machine shared with other work the numbers move between runs.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from rich.console import Console

from kvserve.bench.plots import itl_histogram, over_time, run_series, ttft_cdf
from kvserve.bench.report import print_report, write_json
from kvserve.bench.suite_args import add_suite_arguments
from kvserve.bench.runner import BenchConfig, BenchResult, run_benchmark

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
console = Console(stderr=True)


class SuiteError(Exception):
    pass


# ---- scale ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Scale:
    """How big each part is; --quick shrinks every part, so the smoke run exercises the same code."""

    shared_requests: int = 64
    shared_concurrency: int = 16
    chat_sessions: int = 8
    chat_turns: int = 4
    random_requests: int = 32
    seed_requests: int = 1000
    seed_concurrency: int = 32
    offline_workloads: str = "a,b,single"
    run_memory: bool = True


FULL = Scale()
QUICK = Scale(shared_requests=12, shared_concurrency=6, chat_sessions=3, chat_turns=3, random_requests=8,
              seed_requests=64, offline_workloads="a", run_memory=False)


@dataclass(slots=True)
class WorkloadSpec:
    key: str
    title: str
    config: dict  # BenchConfig fields


def workloads(scale: Scale) -> list[WorkloadSpec]:
    """Output lengths are fixed (--ignore-eos) so every server generates the same number of tokens."""
    return [
        WorkloadSpec("shared", f"shared prefix: {scale.shared_requests} requests, 1,024-token system prompt + "
                     f"32-token question, 32 out, concurrency {scale.shared_concurrency}",
                     dict(workload="shared-prefix", system_prompt_len=1024, user_len=32, output_len=32,
                          num_requests=scale.shared_requests, max_concurrency=scale.shared_concurrency)),
        WorkloadSpec("chat", f"multi-turn: {scale.chat_sessions} chats x {scale.chat_turns} turns, 512-token "
                     f"system prompt, 64-token user turns, 48 out, whole history resent, concurrency "
                     f"{scale.chat_sessions}",
                     dict(workload="multi-turn", system_prompt_len=512, user_len=64, output_len=48,
                          num_turns=scale.chat_turns, num_sessions=scale.chat_sessions,
                          max_concurrency=scale.chat_sessions)),
        WorkloadSpec("random", f"random (control, nothing shared): {scale.random_requests} requests, 256-768 "
                     "tokens in, 64 out, concurrency 8",
                     dict(workload="random", input_len=512, range_ratio=0.5, output_len=64,
                          num_requests=scale.random_requests, max_concurrency=8)),
    ]


def seed_workload(scale: Scale) -> WorkloadSpec:
    return WorkloadSpec("seed", f"The seed's run: {scale.seed_requests:,} requests, shared 2,048-token system "
                        f"prompt + 32-token question, 64 out, concurrency {scale.seed_concurrency}",
                        dict(workload="shared-prefix", system_prompt_len=2048, user_len=32, output_len=64,
                             num_requests=scale.seed_requests, max_concurrency=scale.seed_concurrency))


# ---- machine -------------------------------------------------------------------------------------------------


def read_first(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def git_revision() -> str:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
        return commit + (" + uncommitted changes" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_info() -> dict[str, str]:
    mem_kib = read_first("/proc/meminfo", "MemTotal")
    ram = f"{int(mem_kib.split()[0]) / 2**20:.1f} GiB" if mem_kib else "unknown"
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "not installed"
    return {
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "CPU": read_first("/proc/cpuinfo", "model name") or platform.processor() or "unknown",
        "cores": f"{os.cpu_count()} logical ({len(os.sched_getaffinity(0))} usable by this process)",
        "RAM": ram,
        "OS": f"{platform.system()} {platform.release()}",
        "Python": platform.python_version(),
        "torch": torch_version,
        "kvserve": f"{metadata.version('kvserve')} at {git_revision()}",
        "load average at start (1/5/15 min)": " / ".join(f"{v:.2f}" for v in os.getloadavg()),
    }


# ---- servers -------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(slots=True)
class ServerSpec:
    key: str
    title: str
    command: list[str]  # with {port}
    shown_command: str  # what a user would type
    ready_path: str = "/health"


@dataclass(slots=True)
class ServerProcess:
    """A server subprocess for the length of a `with` block; its log goes to `log_path`."""

    spec: ServerSpec
    log_path: Path
    startup_timeout_s: float = 300.0
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerProcess:
        command = [part.replace("{port}", str(self.port)) for part in self.spec.command]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("w")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SuiteError(f"{self.spec.title} exited with {self.process.returncode} while starting; "
                                 f"log {self.log_path}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + self.spec.ready_path, timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise SuiteError(f"{self.spec.title} was not ready after {self.startup_timeout_s:.0f} s; log {self.log_path}")

    def log_tail(self, num_lines: int = 15) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def kvserve_spec(caching: bool, model: str | None, extra_flags: list[str] | None = None) -> ServerSpec:
    flags = ["--max-model-len", "4096", "--kv-cache-memory", "2", "--max-num-seqs", "64"]
    flags += [] if caching else ["--no-enable-prefix-caching"]
    flags += ["--model", model] if model else []
    flags += extra_flags or []
    quiet = ["--disable-log-stats", "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    state = "on" if caching else "off"
    return ServerSpec(f"kvserve-{state}", f"kvserve, prefix caching {state}",
                      [sys.executable, "-m", "kvserve.cli", "serve", "--host", "127.0.0.1", "--port", "{port}",
                       *flags, *quiet],
                      "kvserve serve " + " ".join(flags))


def llama_server_spec(binary: str, gguf: str, concurrency: int) -> ServerSpec:
    threads = str(len(os.sched_getaffinity(0)))
    # Each of the -np slots gets -c / -np tokens: room for the 2K-token system prompt, a question and the answer.
    context = str(concurrency * 2304)
    flags = ["-m", gguf, "-np", str(concurrency), "-c", context, "-cb", "-t", threads, "--metrics"]
    return ServerSpec("llama-server", "llama.cpp llama-server", [binary, "--host", "127.0.0.1", "--port", "{port}",
                                                                   *flags],
                      "llama-server " + " ".join(flags))


def demo_gguf() -> str:
    from kvserve.model.demo import demo_model_path  # locates the file only; imports no torch

    return str(demo_model_path())


# ---- running -------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class SuiteResults:
    machine: dict[str, str]
    scale: Scale
    quick: bool
    servers: dict[str, ServerSpec] = field(default_factory=dict)
    runs: dict[tuple[str, str], BenchResult] = field(default_factory=dict)  # (server key, workload key)
    offline: str | None = None
    memory: str | None = None
    notes: list[str] = field(default_factory=list)


def bench(server: ServerProcess, spec: WorkloadSpec, results: SuiteResults, out: Path, seed: int) -> None:
    label = f"{server.spec.key}/{spec.key}"
    console.rule(f"[bold]{label}[/]: {spec.title}")
    config = BenchConfig(base_url=server.url, ignore_eos=True, warmup=2, seed=seed, label=label,
                         timeout_s=1800, **spec.config)
    result = run_benchmark(config, console)
    print_report(result, console)
    write_json(result, out / "results" / f"{server.spec.key}-{spec.key}.json")
    results.runs[(server.spec.key, spec.key)] = result


def run_server_workloads(spec: ServerSpec, specs: list[WorkloadSpec], results: SuiteResults, out: Path,
                         seed: int) -> None:
    results.servers[spec.key] = spec
    console.rule(f"[bold]starting {spec.title}[/]: {spec.shown_command}")
    # Logs stay out of the repository; a server that fails to start has its log's tail in the error.
    with ServerProcess(spec, Path(tempfile.gettempdir()) / "kvserve-bench-suite" / f"{spec.key}.log") as server:
        for workload in specs:
            bench(server, workload, results, out, seed)


def run_script(name: str, args: list[str]) -> str:
    command = [sys.executable, str(BENCHMARKS / name), *args]
    console.rule(f"[bold]{name}[/] {' '.join(args)}")
    completed = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    if completed.returncode != 0:
        return f"{name} failed ({completed.returncode}):\n{completed.stderr[-2000:]}"
    console.print(completed.stdout)
    return completed.stdout.strip()


def find_llama_server(explicit: str | None) -> str | None:
    if explicit:
        return explicit
    return shutil.which("llama-server")


# ---- RESULTS.md ----------------------------------------------------------------------------------------------


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def fmt_pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def ratio(numerator: float | None, denominator: float | None) -> str:
    return "-" if not numerator or not denominator else f"{numerator / denominator:.2f}x"


def stat(result: BenchResult, latency: str, name: str) -> float | None:
    """e.g. stat(result, "ttft", "p95"); None when no request completed."""
    distribution = getattr(result.summary, latency)
    return None if distribution is None else getattr(distribution, name)


def run_row(name: str, result: BenchResult) -> list[str]:
    s, server = result.summary, result.server
    hit_rate = server.prefix_cache_hit_rate if server is not None else None
    return [name, f"{s.num_completed}/{s.num_sent}", fmt(stat(result, "ttft", "p50")),
            fmt(stat(result, "ttft", "p95")), fmt(stat(result, "tpot", "mean")),
            fmt(s.output_token_throughput), fmt(s.total_token_throughput),
            fmt_pct(hit_rate if hit_rate is not None else s.cache_hit_rate),
            fmt(server.preemptions if server else None, 0), fmt_pct(server.peak_kv_usage if server else None)]


RUN_HEADERS = ["server", "ok/sent", "TTFT p50 ms", "TTFT p95 ms", "TPOT mean ms", "out tok/s", "total tok/s",
               "prefix hit rate", "preemptions", "peak KV"]


def offline_section(results: SuiteResults) -> str:
    if results.offline is None:
        return "## 1. Offline throughput vs transformers\n\nNot run (--skip-offline).\n"
    rows = []
    for line in results.offline.splitlines():
        match = re.match(r"^(\(.*?\).*?|single stream.*?)\s{2,}([\d.]+)\s+([\d.]+|nan)\s+([\d.]+x|n/a)\s*$", line)
        if match:
            rows.append([match[1].strip(), match[2], match[3], match[4]])
    header = next((line for line in results.offline.splitlines() if line.startswith("model:")), "")
    table = md_table(["workload", "kvserve tok/s", "transformers tok/s", "ratio"], rows) if rows else ""
    return (f"## 1. Offline throughput vs transformers\n\n`python benchmarks/offline_throughput.py --workloads "
            f"{results.scale.offline_workloads}`: the engine without HTTP against transformers `generate` (static "
            f"batches of 32, bf16), output tokens/s. {header}\n\n{table}\n\n```\n{results.offline}\n```\n")


def comparison_section(results: SuiteResults, out: Path) -> str:
    parts = ["## 2. Prefix caching on vs off (kvserve serve, over HTTP)\n",
             "Each workload ran against `kvserve serve` with prefix caching on and off (two fresh servers), "
             "2 warm-up requests first, fixed output lengths (`--ignore-eos`). Hit rate: the server's "
             "`vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` over the run.\n"]
    for spec in workloads(results.scale):
        on, off = results.runs.get(("kvserve-on", spec.key)), results.runs.get(("kvserve-off", spec.key))
        if on is None or off is None:
            continue
        rows = [run_row("caching on", on), run_row("caching off", off)]
        rows.append(["on / off", "", ratio(stat(on, "ttft", "p50"), stat(off, "ttft", "p50")),
                     ratio(stat(on, "ttft", "p95"), stat(off, "ttft", "p95")),
                     ratio(stat(on, "tpot", "mean"), stat(off, "tpot", "mean")),
                     ratio(on.summary.output_token_throughput, off.summary.output_token_throughput),
                     ratio(on.summary.total_token_throughput, off.summary.total_token_throughput), "", "", ""])
        plot = ttft_cdf({"caching on": run_series(on)["ttft_ms"], "caching off": run_series(off)["ttft_ms"]},
                        out / "results" / f"ttft_cdf_{spec.key}.png", f"TTFT CDF: {spec.key}")
        parts.append(f"### {spec.title}\n\n{md_table(RUN_HEADERS, rows)}\n\n"
                     f"![TTFT CDF]({plot.relative_to(out).as_posix()})\n")
    return "\n".join(parts)


def seed_section(results: SuiteResults, out: Path) -> str:
    spec = seed_workload(results.scale)
    runs = {key: results.runs[(key, "seed")] for key in results.servers if (key, "seed") in results.runs}
    if not runs:
        return "## 3. The seed's run\n\nNot run.\n"
    titles = {key: results.servers[key].title for key in runs}
    rows = [run_row(titles[key], result) for key, result in runs.items()]
    main = runs.get("kvserve-on") or next(iter(runs.values()))
    series = {titles[key]: run_series(result) for key, result in runs.items()}
    folder = out / "results"
    plots = [
        ttft_cdf({k: s["ttft_ms"] for k, s in series.items()}, folder / "seed_ttft_cdf.png", "TTFT CDF: seed run"),
        itl_histogram({k: s["itl_ms"] for k, s in series.items()}, folder / "seed_itl_hist.png",
                      "inter-token latency: seed run"),
        over_time({k: s["throughput"] for k, s in series.items()}, folder / "seed_throughput.png",
                  "output token throughput: seed run", "output tokens/s (1 s bins)"),
        over_time({k: s["kv_usage"] for k, s in series.items() if s["kv_usage"]}, folder / "seed_kv_usage.png",
                  "KV cache usage: seed run", "KV cache used (%)"),
    ]
    images = "\n".join(f"![{p.stem}]({p.relative_to(out).as_posix()})" for p in plots)
    p95 = stat(main, "ttft", "p95")
    return (f"## 3. {spec.title}\n\n**P95 TTFT ({titles.get('kvserve-on', main.label)}): {fmt(p95)} ms**\n\n"
            f"{md_table(RUN_HEADERS, rows)}\n\nOnly the caching-on kvserve (and llama-server, which caches "
            f"prompts per slot) run it: without prefix caching every request recomputes the 2K-token prompt, "
            f"and section 2 already measures that difference.\n\n{images}\n")


def llama_section(results: SuiteResults) -> str:
    if "llama-server" not in results.servers:
        reason = next((n for n in results.notes if n.startswith("llama-server")), "llama-server was not run.")
        reason = reason.removeprefix("llama-server: ")
        reason = reason[:1].upper() + reason[1:]
        return f"## 4. llama.cpp llama-server\n\n{reason}\n"
    rows = []
    for spec in [*workloads(results.scale), seed_workload(results.scale)]:
        ours, theirs = results.runs.get(("kvserve-on", spec.key)), results.runs.get(("llama-server", spec.key))
        if ours is None or theirs is None:
            continue
        rows.append([spec.key, fmt(stat(ours, "ttft", "p95")), fmt(stat(theirs, "ttft", "p95")),
                     fmt(ours.summary.output_token_throughput), fmt(theirs.summary.output_token_throughput),
                     ratio(ours.summary.output_token_throughput, theirs.summary.output_token_throughput)])
    spec = results.servers["llama-server"]
    return (f"## 4. llama.cpp llama-server\n\n`{spec.shown_command}` (its prompt cache on, the default), the same "
            "workloads through the same load tester.\n\n"
            + md_table(["workload", "kvserve TTFT p95 ms", "llama-server TTFT p95 ms", "kvserve out tok/s",
                        "llama-server out tok/s", "kvserve / llama-server"], rows) + "\n")


def write_results_md(results: SuiteResults, out: Path, command: str) -> Path:
    machine = md_table(["", ""], [[k, v] for k, v in results.machine.items()])
    banner = ("> **Quick smoke run** (`--quick`): a handful of requests per part, to check the suite works. "
              "These are not the reference numbers; run without `--quick` for them.\n\n" if results.quick else "")
    servers = "\n".join(f"- {spec.title}: `{spec.shown_command}`" for spec in results.servers.values())
    # llama-server's own notes are in its section
    notes = "\n".join(f"- {note}" for note in results.notes if not note.startswith("llama-server:"))
    memory = f"## 5. Memory\n\n```\n{results.memory}\n```\n" if results.memory else ""
    text = (f"# kvserve benchmark results\n\n{banner}Produced by `{command}` on {results.machine['date']}. "
            "Every figure below was measured in that one run on this machine, by `kvserve bench` over HTTP "
            "(streaming, TTFT to the first token's chunk) unless it says otherwise. The load tester runs on "
            "the same cores as the servers.\n\n"
            f"## Machine\n\n{machine}\n\nServers:\n\n{servers}\n\n"
            f"{offline_section(results)}\n{comparison_section(results, out)}\n{seed_section(results, out)}\n"
            f"{llama_section(results)}\n{memory}\n"
            + (f"## Notes\n\n{notes}\n\n" if notes else "")
            + "## Reproduce and compare\n\n"
            "Each run's JSON is in `results/`; compare any two with "
            "`kvserve bench compare results/kvserve-off-shared.json results/kvserve-on-shared.json`.\n")
    path = out / "RESULTS.md"
    path.write_text(text + kept_by_hand(path))
    return path


# Figures measured by hand (one benchmark script at a time) follow this line in RESULTS.md; a rerun keeps them.
HAND_MARKER = "<!-- run_all.py keeps everything below this line when it rewrites this file -->"


def kept_by_hand(path: Path) -> str:
    """The hand-measured part of an existing RESULTS.md, from HAND_MARKER on ("" when there is none)."""
    old = path.read_text() if path.is_file() else ""
    return "\n" + old[old.index(HAND_MARKER):] if HAND_MARKER in old else ""


# ---- main ----------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_suite_arguments(parser, default_out=BENCHMARKS)
    return parser.parse_args(argv)


def run_llama_server(args: argparse.Namespace, scale: Scale, specs: list[WorkloadSpec],
                     results: SuiteResults) -> None:
    binary = None if args.skip_llama_server else find_llama_server(args.llama_server)
    if binary is None:
        why = "skipped (--skip-llama-server)" if args.skip_llama_server else "not on PATH"
        results.notes.append(f"llama-server: {why}, so it was not measured. Build llama.cpp's `llama-server` "
                             "(CPU), put it on PATH (or pass --llama-server PATH) and rerun.")
        return
    gguf = args.llama_model or (args.model if args.model and args.model.endswith(".gguf") else demo_gguf())
    if gguf.endswith("Q4_1.gguf") or "q4" in Path(gguf).name.lower():
        results.notes.append(f"llama-server serves {Path(gguf).name} with its quantized kernels, while kvserve "
                             "dequantizes the same file to bf16: pass --llama-model with an f16 GGUF of the "
                             "same model for a like-for-like comparison.")
    try:
        run_server_workloads(llama_server_spec(binary, gguf, scale.seed_concurrency), specs, results, args.out,
                             args.seed)
    except SuiteError as exc:
        results.notes.append(f"llama-server failed: {exc}")


def run_suite(args: argparse.Namespace, command: str) -> int:
    scale = QUICK if args.quick else FULL
    results = SuiteResults(machine_info(), scale, args.quick)
    started = time.monotonic()
    if not args.skip_offline:
        model_flag = ["--model", args.model] if args.model else []
        results.offline = run_script("offline_throughput.py", ["--workloads", scale.offline_workloads, *model_flag])
    specs = workloads(scale)
    try:
        run_server_workloads(kvserve_spec(True, args.model), [*specs, seed_workload(scale)], results, args.out,
                             args.seed)
        run_server_workloads(kvserve_spec(False, args.model), specs, results, args.out, args.seed)
    except SuiteError as exc:
        console.print(f"[red]{exc}[/]")
        results.notes.append(f"kvserve server failed: {exc}")
    run_llama_server(args, scale, [*specs, seed_workload(scale)], results)
    if scale.run_memory:
        results.memory = run_script("memory.py", ["--model", args.model] if args.model else [])
    results.machine["load average at end (1/5/15 min)"] = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    results.machine["suite wall time"] = f"{(time.monotonic() - started) / 60:.1f} min"
    path = write_results_md(results, args.out, command)
    console.print(f"wrote {path}")
    return 0 if results.runs else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_suite(parse_args(argv), command=" ".join(["python benchmarks/run_all.py", *argv]))


if __name__ == "__main__":
    sys.exit(main())
