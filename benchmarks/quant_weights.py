"""Weights held as GGUF blocks (quant_weight.py, csrc/quant_linear.cpp) against dequantized, oneDNN-packed ones.

    python benchmarks/quant_weights.py kernels [--gguf /work/qwen.gguf]
    python benchmarks/quant_weights.py model --baseline /work/main [--gguf /work/qwen.gguf]

kernels: the matmuls of Qwen2.5-1.5B's shapes, its real blocks (layer 0's q, k, gate+up, down; the head), at
  M = 1, 2 (GB/s of blocks read) and M = 32, 256, 2048 (GFLOP/s), quant_linear against oneDNN's packed bf16
  matmul over the same weights dequantized (the --gguf-weights dequantized path), with the ratio.
model: this tree and `--baseline` (another checkout, e.g. main), each in its own process, one after the other:
  resident weight bytes against the file's tensor bytes, single-stream decode ms/token, and a 2,000-token
  prefill (uncached); with the ratios, and the fraction of this machine's bound each reaches (decode: the bytes
  of weights a token reads over the measured memory bandwidth; prefill: its matmul FLOPs over the measured bf16
  GEMM peak).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_GGUF = "/work/qwen.gguf"


def best_seconds(fn, passes: int = 5, warmup: bool = True) -> float:
    """The fastest of `passes` runs (after one unmeasured run when `warmup`)."""
    if warmup:
        fn()
    times = []
    for _ in range(passes):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


# ---------------------------------------------------------------------------------------------- kernels


def real_weights(path: str):
    """(label, QuantWeight) for layer 0's q, k, gate+up, down and the head, as the loader holds them."""
    from kvserve.model.cpu_kernels import cpu_kernels
    from kvserve.model.gguf_file import iter_gguf_quant_parts
    from kvserve.model.quant_weight import QuantWeight, merge_parts

    wanted = {"model.layers.0.self_attn.q_proj.weight": "q", "model.layers.0.self_attn.k_proj.weight": "k",
              "model.layers.0.mlp.gate_proj.weight": "gate", "model.layers.0.mlp.up_proj.weight": "up",
              "model.layers.0.mlp.down_proj.weight": "down", "model.embed_tokens.weight": "head"}
    parts = {wanted[name]: part for name, part in iter_gguf_quant_parts(path) if name in wanted}
    kernels = cpu_kernels()
    combos = {"q": ["q"], "k": ["k"], "gate_up": ["gate", "up"], "down": ["down"], "head": ["head"]}
    for label, names in combos.items():
        merged = merge_parts([parts[n] for n in names])
        yield label, QuantWeight(merged, merged[0].in_features, kernels)


def gemm_table(path: str) -> None:
    from kvserve.model.layers import linear

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; bf16 x, fp32 accumulation")
    for label, weight in real_weights(path):
        N, K = weight.shape
        types = "+".join(sorted({_type_name(p.ggml_type) for p in weight.parts}))
        dense = torch.cat([p.dequantize() for p in weight.parts]).to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(dense)
        onednn = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        for rows in (1, 2, 32, 256, 2048):
            if label == "head" and rows > 256:
                continue  # a prefill computes the head for its last rows only
            x = torch.randn(rows, K).to(torch.bfloat16)
            ours = best_seconds(lambda: linear(x, weight), passes=3 if rows >= 256 else 10)
            theirs = best_seconds(lambda: onednn(x), passes=3 if rows >= 256 else 10)
            if rows <= 2:
                rate = f"{weight.nbytes() / ours / 1e9:6.1f} GB/s of blocks"
            else:
                rate = f"{2 * rows * N * K / ours / 1e9:6.1f} GFLOP/s (oneDNN {2 * rows * N * K / theirs / 1e9:6.1f})"
            print(f"{label:8s} {types:9s} N={N:6d} K={K:5d} M={rows:5d}: quant_linear {ours * 1e3:8.2f} ms, oneDNN bf16 "
                  f"{theirs * 1e3:8.2f} ms, {rate}, ratio {theirs / ours:.2f}x")


def _type_name(ggml_type: int) -> str:
    import gguf

    return gguf.GGMLQuantizationType(ggml_type).name


# ---------------------------------------------------------------------------------------------- model


def measure_model(path: str, decode_tokens: int, prefill_tokens: int) -> dict:
    """One tree's figures (run in a child process whose PYTHONPATH is that tree)."""
    from kvserve import LLM, SamplingParams

    llm = LLM(path, kv_cache_memory=1.0, max_model_len=4096, enable_prefix_caching=False)
    model = llm.engine.runner.model
    greedy = SamplingParams(max_tokens=decode_tokens, ignore_eos=True, temperature=0.0)
    prompt = list(range(1000, 1016))
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm-up

    def decode() -> None:
        out = llm.generate([prompt], greedy, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == decode_tokens

    decode_s = best_seconds(decode, passes=2, warmup=False)
    long_prompt = [1000 + (i * 7919) % 20000 for i in range(prefill_tokens)]
    prefill_s = best_seconds(lambda: llm.generate([long_prompt], SamplingParams(max_tokens=1, temperature=0.0),
                                                  use_tqdm=False), passes=2, warmup=False)
    return {"weight_bytes": model.weight_bytes(), "decode_ms_per_token": decode_s / decode_tokens * 1e3,
            "prefill_s": prefill_s, "dtype": str(model.dtype),
            "rss_bytes": int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")}


def memory_bandwidth() -> float:
    """Bytes/s of a read-dominated pass over 1 GiB (a sum), the best of 3."""
    data = torch.ones(2**28, dtype=torch.float32)
    return data.numel() * 4 / best_seconds(lambda: data.sum(), passes=3)


def gemm_peak() -> float:
    """FLOP/s of oneDNN's matmul at a prefill's largest shape (2048 x 8960 x 1536), the best of 3: bf16 over
    its packed layout, or fp32 where this CPU (or an ISA cap) cannot pack bf16."""
    from kvserve.model.layers import PackedWeight, onednn_packs

    dtype = torch.bfloat16 if onednn_packs(torch.bfloat16) else torch.float32
    x = torch.randn(2048, 1536).to(dtype)
    weight = torch.randn(8960, 1536).to(dtype)
    multiply = PackedWeight.of(weight).linear if dtype == torch.bfloat16 else lambda x: torch.nn.functional.linear(x, weight)
    seconds = best_seconds(lambda: multiply(x), passes=3)
    return 2 * 2048 * 8960 * 1536 / seconds


def read_per_token_bytes(path: str) -> tuple[int, int]:
    """(the file's tensor bytes, bytes a decode token reads from them: every matrix but the embedding's
    unread rows; a tied head reads the whole embedding)."""
    from kvserve.model.gguf_file import read_gguf

    contents = read_gguf(path)
    total = sum(info.nbytes or 0 for info in contents.tensors)
    tied = contents.tensor("output.weight") is None
    embedding = contents.tensor("token_embd.weight")
    return total, total - (0 if tied or embedding is None else embedding.nbytes or 0)


def matmul_flops(path: str, tokens: int) -> float:
    """2 x matmul parameters x tokens (the head once, for the last token), attention's QK and PV besides."""
    from kvserve.config import ModelConfig
    from kvserve.model.gguf_file import read_gguf, read_gguf_config

    config = ModelConfig.from_hf_dict(read_gguf_config(path), source=path)
    contents = read_gguf(path)
    layer_params = sum(_numel(info.gguf_shape) for info in contents.tensors
                       if info.name.startswith("blk.") and len(info.gguf_shape) == 2)
    attention = 2 * 2 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * tokens * tokens / 2
    return 2 * layer_params * tokens + 2 * config.vocab_size * config.hidden_size + attention


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def run_tree(tree: str, path: str, decode_tokens: int, prefill_tokens: int) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    if Path(tree).resolve() != ROOT:  # its own kernel build cache: the two trees' sources differ
        env["TORCH_EXTENSIONS_DIR"] = env.get("TORCH_EXTENSIONS_DIR", "/tmp/torch_extensions") + "-baseline"
    code = (f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import quant_weights as q; "
            f"print('RESULT', json.dumps(q.measure_model({path!r}, {decode_tokens}, {prefill_tokens})))")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tree)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{tree}: failed\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def model_table(path: str, baseline: str, decode_tokens: int, prefill_tokens: int) -> None:
    file_bytes, token_bytes = read_per_token_bytes(path)
    bandwidth, peak = memory_bandwidth(), gemm_peak()
    flops = matmul_flops(path, prefill_tokens)
    print(f"{path}: {file_bytes / 2**20:.1f} MiB of tensors; measured memory bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"GEMM peak {peak / 1e9:.1f} GFLOP/s; {torch.get_num_threads()} threads")
    results = {}
    for name, tree in (("baseline", baseline), ("this tree", str(ROOT))):
        results[name] = run_tree(tree, path, decode_tokens, prefill_tokens)
    for name, r in results.items():
        decode_bound = r["weight_bytes"] / bandwidth * 1e3
        print(f"{name:9s}: weights {r['weight_bytes'] / 2**20:8.1f} MiB ({r['weight_bytes'] / file_bytes:.2f}x the file), "
              f"RSS {r['rss_bytes'] / 2**20:8.1f} MiB; decode {r['decode_ms_per_token']:6.1f} ms/token "
              f"(bound for its weights {decode_bound:.1f} ms: {decode_bound / r['decode_ms_per_token']:.0%}; for the "
              f"file's {token_bytes / bandwidth * 1e3:.1f} ms: {token_bytes / bandwidth * 1e3 / r['decode_ms_per_token']:.0%}); "
              f"prefill of {prefill_tokens} tokens {r['prefill_s']:.2f} s "
              f"({flops / r['prefill_s'] / 1e9:.0f} GFLOP/s, {flops / peak / r['prefill_s']:.0%} of the GEMM peak)")
    base, ours = results["baseline"], results["this tree"]
    print(f"this tree / baseline: weights {ours['weight_bytes'] / base['weight_bytes']:.2f}x, decode speed "
          f"{base['decode_ms_per_token'] / ours['decode_ms_per_token']:.2f}x, prefill speed "
          f"{base['prefill_s'] / ours['prefill_s']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("kernels", "model"))
    parser.add_argument("--gguf", default=DEFAULT_GGUF)
    parser.add_argument("--baseline", default="/work/main", help="the checkout to compare with (model)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.what == "kernels":
        gemm_table(args.gguf)
    else:
        model_table(args.gguf, args.baseline, args.decode_tokens, args.prefill_tokens)


if __name__ == "__main__":
    main()
