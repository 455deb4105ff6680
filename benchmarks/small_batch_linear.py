"""Single-stream decode over GGUF blocks, plain weights and oneDNN's packed weights, in one run (CPU).

    python benchmarks/small_batch_linear.py [--tokens 200]

The demo model is a Q4_1 GGUF file (its head, the tied embedding, Q8_0). Batches of 1-2 rows read:
- GGUF blocks (the default): `quant_linear` over the file's blocks, ~0.65 bytes a weight;
- plain copies: `small_batch_linear` over row-major weights in the compute dtype (what a safetensors
  checkpoint gets), 2 bytes a weight in bf16, 4 in fp32;
- oneDNN only: its packed weights for every batch size.

1. The model's matmuls at one and two rows, every weight once (what one decode step reads), best of 10 passes,
   ms and GB/s of what each variant reads.
2. The engine's single-stream decode (one request, `--tokens` tokens, greedy), tokens/s, the three variants
   interleaved (best of 2 each).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from workloads import shared_prefix_workload  # noqa: E402

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.model.cpu_isa import selected_isa  # noqa: E402
from kvserve.model.cpu_kernels import cpu_kernels  # noqa: E402
from kvserve.model.layers import PackedWeight, linear, tensor_bytes  # noqa: E402
from kvserve.model.quant_weight import QuantWeight  # noqa: E402

VARIANTS = ("GGUF blocks", "plain copies", "oneDNN only")


def best_ms(fn, passes: int = 10) -> float:
    fn()
    best = float("inf")
    for _ in range(passes):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best * 1e3


def weights_of(llm: LLM) -> list[PackedWeight | QuantWeight]:
    model = llm.engine.runner.model
    return [getattr(m, n) for m, n in model._matmul_weights()]


def as_variant(llm: LLM, variant: str) -> LLM:
    """Turns a model whose small batches read GGUF blocks into one of the other variants (same values)."""
    model = llm.engine.runner.model
    kernels = cpu_kernels()
    for module, name in model._matmul_weights():
        weight = getattr(module, name) or model.embed_tokens  # a tied head reads the embedding
        assert isinstance(weight, QuantWeight), "the demo model's matmuls should read its blocks"
        if variant != "GGUF blocks":
            plain = torch.cat([part.dequantize() for part in weight.parts]).to(model.dtype)
            packed = torch.ops.mkldnn._reorder_linear_weight(plain)
            weight = (PackedWeight(packed, plain, kernels.small_batch_linear, kernels.small_batch_linear_max_rows())
                      if variant == "plain copies" else PackedWeight(packed))
        setattr(module, name, weight)
    return llm


def read_bytes(weight: PackedWeight | QuantWeight) -> int:
    if isinstance(weight, QuantWeight):
        return weight.nbytes()
    return tensor_bytes(weight.plain if weight.plain is not None else weight.packed)


def matmuls(llms: dict[str, LLM]) -> None:
    dtype = llms[VARIANTS[0]].engine.runner.model.dtype
    weights = {variant: weights_of(llm) for variant, llm in llms.items()}
    widths = [w.shape[1] for w in weights[VARIANTS[0]]]
    for variant in VARIANTS:
        print(f"  {variant}: {sum(read_bytes(w) for w in weights[variant]) / 2**20:.1f} MiB read per step")
    for rows in (1, 2):
        xs = {width: torch.randn(rows, width).to(dtype) for width in set(widths)}
        times = {variant: best_ms(lambda ws=ws: [linear(xs[k], w) for k, w in zip(widths, ws)])
                 for variant, ws in weights.items()}
        shown = ", ".join(f"{variant} {ms:6.2f} ms" for variant, ms in times.items())
        print(f"  {rows} row(s): {shown}; blocks vs plain {times['plain copies'] / times['GGUF blocks']:.2f}x, "
              f"vs oneDNN {times['oneDNN only'] / times['GGUF blocks']:.2f}x")


def single_stream(llm: LLM, prompt: list[int], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)
    llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    out = llm.generate([prompt], params, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == tokens
    return tokens / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200)
    args = parser.parse_args()
    print(f"CPU family {selected_isa().label}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    llms = {variant: as_variant(LLM(None, kv_cache_memory=0.5, max_model_len=2048), variant) for variant in VARIANTS}
    print(f"matmuls of one decode step ({llms[VARIANTS[0]].engine.runner.model.dtype}):")
    matmuls(llms)
    prompt = shared_prefix_workload(llms[VARIANTS[0]].get_tokenizer(), 1)[0].prompt_token_ids
    runs = {variant: [] for variant in VARIANTS}
    for _ in range(2):  # interleaved, so a change in the machine's load hits every variant alike
        for variant, llm in llms.items():
            runs[variant].append(single_stream(llm, prompt, args.tokens))
    best = {variant: max(r) for variant, r in runs.items()}
    shown = ", ".join(f"{variant} {tps:.1f} tok/s" for variant, tps in best.items())
    print(f"single stream, {args.tokens} tokens (best of 2): {shown}; blocks vs plain "
          f"{best['GGUF blocks'] / best['plain copies']:.2f}x, vs oneDNN {best['GGUF blocks'] / best['oneDNN only']:.2f}x")


if __name__ == "__main__":
    main()
