"""CPU report: what kvserve picks on this CPU, and how it stands against llama.cpp and transformers, in one run.

    python benchmarks/cpu_report.py --llama-server PATH [--llama-model F16.gguf] [--skip-transformers]

Prints the ISA family found, the dtype `--dtype auto` chose, and the engine issue's workload (a) over HTTP
(32 streamed completions of ~430 tokens sharing their first 400, exactly 64 tokens out, all sent at once, to
a fresh server each time, from the same client) plus single-stream decode (one request, 128 tokens out):

  kvserve `serve --dtype auto`, prefix caching on and off;
  llama.cpp `llama-server` (built with native flags, ../shared/peers/llama-server.md) cold, then the same 32
  requests again (its prompt cache warm);
  transformers `generate` offline (static batch of 32, in the dtype fastest for it on this CPU).

and the issue's targets as ratios measured in this run. llama-server reads an f16 GGUF of the demo model
(--llama-model; default: the demo's own Q4_1 GGUF, which is not the target's baseline and is labelled so).
KVSERVE_CPU_ISA=avx2 (with ONEDNN_MAX_CPU_ISA=AVX2 for torch's matmuls) runs kvserve's AVX2 paths on an
AVX-512 machine; llama-server then needs an AVX2-only build to compare like with like.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))

from run_all import ServerProcess, ServerSpec, demo_gguf, kvserve_spec, llama_server_spec  # noqa: E402
from workloads import shared_prefix_workload  # noqa: E402

from kvserve.bench.client import COMPLETIONS, Target, send_request  # noqa: E402
from kvserve.bench.records import RequestRecord  # noqa: E402
from kvserve.model.cpu_isa import detected_isa, native_bf16, selected_isa  # noqa: E402
from kvserve.model.demo import DEMO_MODEL_NAME  # noqa: E402

OUT = Path(__file__).parent / "out" / "cpu_report"
SINGLE_STREAM_TOKENS = 128


@dataclass(slots=True)
class Run:
    output_tok_s: float
    ttft_p95_s: float


def prompts() -> list[str]:
    from kvserve.model.loader import load_model

    tokenizer = load_model(None, dtype="float32").tokenizer
    return [tokenizer.decode(r.prompt_token_ids) for r in shared_prefix_workload(tokenizer)]


async def send_all(url: str, model: str, texts: list[str], max_tokens: int, extra: dict) -> Run:
    """Every prompt at once; output tokens/s over the whole batch's wall time, and the TTFTs' p95."""
    target = Target(url, model, COMPLETIONS, ignore_eos=True, extra_body=extra)
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=len(texts))) as http:
        records = [RequestRecord(i, 0, 0.0, max_tokens) for i in range(len(texts))]
        started = time.perf_counter()
        await asyncio.gather(*(send_request(http, target, r, t, 1200.0) for r, t in zip(records, texts)))
        elapsed = time.perf_counter() - started
    failed = [r for r in records if not r.ok or r.output_tokens != max_tokens]
    if failed:
        raise SystemExit(f"{url}: {len(failed)} requests failed or stopped early: {failed[0].error_message}")
    ttfts = sorted(r.ttft_s for r in records)
    return Run(sum(r.output_tokens for r in records) / elapsed, ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))])


def measure(spec: ServerSpec, model: str, texts: list[str], repeat: bool, extra: dict | None = None,
            workload_a: bool = True) -> list[Run]:
    """Workload (a) on a fresh server (and again, warm, when `repeat`; not at all without `workload_a`), then
    single-stream decode."""
    with ServerProcess(spec, OUT / f"{spec.key}.log") as server:
        runs = [asyncio.run(send_all(server.url, model, texts, 64, extra or {}))] if workload_a else []
        if repeat:
            runs.append(asyncio.run(send_all(server.url, model, texts, 64, extra or {})))
        single = asyncio.run(send_all(server.url, model, texts[:1], SINGLE_STREAM_TOKENS, extra or {}))
    shown = f"(a) {' / '.join(f'{r.output_tok_s:.1f}' for r in runs)} tok/s, " if runs else ""
    print(f"  {spec.title}: {shown}single stream {single.output_tok_s:.1f} tok/s", flush=True)
    return [*runs, single]


def transformers_tok_s() -> tuple[float, str]:
    from offline_throughput import load_transformers, run_transformers, transformers_dtype

    from kvserve.model.loader import load_model, resolve_model_path

    tokenizer = load_model(None, dtype="float32").tokenizer
    model = load_transformers(resolve_model_path(None))
    requests = shared_prefix_workload(tokenizer)
    run_transformers(model, requests[:4])  # warm-up
    return run_transformers(model, requests), str(transformers_dtype()).removeprefix("torch.")


def ratio_line(name: str, ours: float, theirs: float, target: float) -> str:
    value = ours / theirs
    return f"  {name:58} {ours:8.1f} / {theirs:8.1f} = {value:5.2f}x  (target {target:g}x: {'met' if value >= target else 'NOT met'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", required=True, help="path to a llama-server binary")
    parser.add_argument("--llama-model", default=None, help="f16 GGUF of the demo model (default: the demo Q4_1)")
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args()
    import torch

    from kvserve.model.loader import cpu_dispatch_line, load_model

    loaded = load_model(None, dtype="auto")
    print(f"CPU: {detected_isa().label} detected, {selected_isa().label} selected"
          f"{' (capped by KVSERVE_CPU_ISA)' if selected_isa() != detected_isa() else ''}; "
          f"{os.cpu_count()} cores, torch {torch.__version__}")
    print(cpu_dispatch_line(loaded.dtype, loaded.model.fused_kernels is not None, loaded.kv_dtype))
    texts = prompts()
    del loaded
    llama_gguf = args.llama_model or demo_gguf()
    llama_label = Path(llama_gguf).name + ("" if args.llama_model else " (the demo's Q4_1, not f16)")
    print("Measuring (fresh server each; output tokens/s):", flush=True)
    kv_on = measure(kvserve_spec(True, None), DEMO_MODEL_NAME, texts, repeat=False)
    kv_off = measure(kvserve_spec(False, None), DEMO_MODEL_NAME, texts, repeat=False)
    llama = measure(llama_server_spec(args.llama_server, llama_gguf, 32), "default", texts, repeat=True)
    # kvserve's single stream reads the demo's Q4_1 blocks: llama-server on that same file too, like for like.
    llama_q4 = measure(llama_server_spec(args.llama_server, demo_gguf(), 32), "default", texts, repeat=False,
                       workload_a=False) if args.llama_model else None
    hf, hf_dtype = (None, None) if args.skip_transformers else transformers_tok_s()
    if hf:
        print(f"  transformers generate ({hf_dtype}, static batch 32, offline): (a) {hf:.1f} tok/s")
    print(f"\nRatios (kvserve / peer), llama-server on {llama_label}:")
    print(ratio_line("single-stream decode vs llama-server", kv_on[-1].output_tok_s, llama[-1].output_tok_s, 1.0))
    if llama_q4:
        print(ratio_line("single-stream decode vs llama-server on the demo's Q4_1", kv_on[-1].output_tok_s,
                         llama_q4[-1].output_tok_s, 1.0))
    print(ratio_line("(a) caching on vs llama-server cold", kv_on[0].output_tok_s, llama[0].output_tok_s, 4.0))
    print(ratio_line("(a) caching on vs llama-server warm (2nd run)", kv_on[0].output_tok_s, llama[1].output_tok_s, 1.5))
    print(ratio_line("(a) caching off vs llama-server cold", kv_off[0].output_tok_s, llama[0].output_tok_s, 1.2))
    if hf:
        print(ratio_line(f"(a) caching off vs transformers ({hf_dtype})", kv_off[0].output_tok_s, hf, 2.0))
    print(f"\nTTFT p95 on (a): kvserve on {kv_on[0].ttft_p95_s:.2f} s, off {kv_off[0].ttft_p95_s:.2f} s, "
          f"llama-server cold {llama[0].ttft_p95_s:.2f} s, warm {llama[1].ttft_p95_s:.2f} s")
    print(f"bf16 native here: {native_bf16()}; logs in {OUT}")


if __name__ == "__main__":
    main()
