"""Offline throughput: kvserve vs transformers `generate` on the same weights, prompts and output lengths.

    python benchmarks/offline_throughput.py [--model PATH] [--workloads a,b,single] [--skip-transformers]

(a) 32 prompts of ~430 tokens sharing their first 400, exactly 64 output tokens each (kvserve with prefix
    caching off, as the engine issue's target asks, and again with it on: `a-cached`; and sampled with
    temperature 0.8 and top-p 0.95 instead of greedy, both engines: `a-sampled`);
(b) 256 prompts of 16-512 tokens with 16-256 output tokens;
single: one request, 256 output tokens (single-stream decode speed).
kvserve runs `--dtype auto` (what this CPU computes fast: bf16 with AVX512-BF16 or AMX, float32 otherwise;
`--dtype` overrides). transformers runs static batches of 32 (left-padded, every batch runs to its longest
output) in the dtype fastest for it on this CPU, the same rule. Prints output tokens/s of each engine and
the ratio, measured in the same run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from workloads import BenchRequest, mixed_workload, shared_prefix_workload  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.cpu_isa import native_bf16, selected_isa  # noqa: E402
from kvserve.model.loader import resolve_model_path  # noqa: E402


SAMPLED = {"temperature": 0.8, "top_p": 0.95}


def run_kvserve(llm: LLM, requests: list[BenchRequest], sampling: dict | None = None) -> float:
    sampling = sampling or {"temperature": 0.0}
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, **sampling) for r in requests]
    started = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(r.max_tokens for r in requests)
    return produced / elapsed


def transformers_dtype() -> torch.dtype:
    """The dtype transformers runs fastest in here: its matmuls are torch's, fast in bf16 only with native bf16."""
    return torch.bfloat16 if native_bf16() else torch.float32


def load_transformers(model_path: Path):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    folder = model_path.parent if model_path.suffix == ".gguf" else model_path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=transformers_dtype(), **kwargs).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def run_transformers(model, requests: list[BenchRequest], sampling: dict | None = None, batch_size: int = 32) -> float:
    started = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        longest = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), longest, dtype=torch.long)
        mask = torch.zeros(len(batch), longest, dtype=torch.long)
        for row, request in enumerate(batch):
            ids[row, longest - len(request.prompt_token_ids):] = torch.tensor(request.prompt_token_ids)
            mask[row, longest - len(request.prompt_token_ids):] = 1
        new_tokens = max(r.max_tokens for r in batch)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, do_sample=bool(sampling), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, **(sampling or {}))
    elapsed = time.perf_counter() - started
    return sum(r.max_tokens for r in requests) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the SmolLM2-135M-Instruct demo GGUF")
    parser.add_argument("--workloads", default="a,a-cached,a-sampled,b,single")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--kv-cache-memory", type=float, default=2.0)
    parser.add_argument("--dtype", default="auto", help="kvserve's --dtype (default: auto)")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_path = resolve_model_path(args.model)
    workloads = args.workloads.split(",")
    llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=False, kv_cache_memory=args.kv_cache_memory,
              max_model_len=2048)
    tokenizer = llm.get_tokenizer()
    cached_llm = None
    if "a-cached" in workloads:
        cached_llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=True, kv_cache_memory=args.kv_cache_memory,
                         max_model_len=2048)
    sets = {
        "a": ("(a) 32 x ~430-token prompts, 400 shared, 64 out", shared_prefix_workload(tokenizer)),
        "a-cached": ("(a) the same, kvserve with prefix caching on", shared_prefix_workload(tokenizer)),
        "a-sampled": ("(a) the same, sampled (temperature 0.8, top-p 0.95)", shared_prefix_workload(tokenizer)),
        "b": ("(b) 256 x 16-512-token prompts, 16-256 out", mixed_workload(tokenizer)),
        "single": ("single stream, 256 out", [BenchRequest(shared_prefix_workload(tokenizer, 1)[0].prompt_token_ids, 256)]),
    }
    run_kvserve(llm, sets["a"][1][:4])  # warm-up
    hf_model = None if args.skip_transformers else load_transformers(model_path)
    kv_dtype = str(llm.engine.runner.model.dtype).removeprefix("torch.")
    hf_dtype = str(transformers_dtype()).removeprefix("torch.")
    print(f"model: {model_path.name}, CPU family {selected_isa().label}, kvserve {kv_dtype}, transformers {hf_dtype}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'workload':52} {'kvserve tok/s':>14} {'transformers':>13} {'ratio':>7}")
    hf_results: dict[str, float] = {}
    for key in workloads:
        title, requests = sets[key]
        if key == "a-cached":
            run_kvserve(cached_llm, sets["a"][1][:4])  # warm-up, then forget it: the run computes the prefix once
            cached_llm.reset_prefix_cache()
        sampling = SAMPLED if key == "a-sampled" else None
        ours = run_kvserve(cached_llm if key == "a-cached" else llm, requests, sampling)
        baseline_key = "a" if key == "a-cached" else key
        if hf_model is not None and baseline_key not in hf_results:
            hf_results[baseline_key] = run_transformers(hf_model, requests, sampling)
        theirs = hf_results.get(baseline_key)
        ratio = f"{ours / theirs:6.2f}x" if theirs else "   n/a"
        print(f"{title:52} {ours:14.1f} {theirs or float('nan'):13.1f} {ratio}", flush=True)


if __name__ == "__main__":
    main()
