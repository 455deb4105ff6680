"""Matmul weights of a 16-bit checkpoint held once, in either layout kvserve holds them in (plain rows read in
place by csrc/quant_linear.cpp; oneDNN's packed layout alone, on CPUs with AMX), against the layout they replaced
(oneDNN's packed weights with a plain copy for batches of 1-2 rows: twice the bytes), in one run (CPU).

    python benchmarks/dense_weights.py [--shape qwen1.5b|demo|3b] [--rows 1,2,3,8,16,32,48,64,256,2048]

Every layer's matmuls (q/k/v, o, gate/up, down) of a model of `--shape`, random bf16 weights (values do not
change the time), for each batch size: ms for one pass over all layers in each layout, the speed of the layout
this CPU holds against the replaced one, and the fraction of this machine's bound it reaches (the weights'
bytes over the measured memory bandwidth, or FLOPs over the measured matmul peak, whichever is larger). Compute
is bf16 where the CPU has bf16 dot products, else fp32: then the plain rows stay bf16 and the replaced layout
held them in fp32 (and oneDNN packs fp32 only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from machine_bounds import best_seconds, describe, matmul_peak, memory_bandwidth  # noqa: E402

from kvserve.model.cpu_isa import native_bf16, selected_isa  # noqa: E402
from kvserve.model.cpu_kernels import cpu_kernels, packed_weights_are_faster  # noqa: E402
from kvserve.model.layers import PackedWeight, tensor_bytes  # noqa: E402
from kvserve.model.quant_weight import dense_weight  # noqa: E402

# (hidden, intermediate, attention heads, KV heads, head dim, layers)
SHAPES = {"demo": (576, 1536, 9, 3, 64, 30), "qwen1.5b": (1536, 8960, 12, 2, 128, 28),
          "3b": (3072, 8192, 24, 8, 128, 28)}


def layer_weights(shape: tuple[int, ...], generator: torch.Generator) -> list[torch.Tensor]:
    hidden, inter, heads, kv_heads, dim, _ = shape
    shapes = [((heads + 2 * kv_heads) * dim, hidden), (hidden, heads * dim), (2 * inter, hidden), (hidden, inter)]
    return [torch.randn(*s, generator=generator).to(torch.bfloat16) for s in shapes]


class PackedWithPlainCopy:
    """The replaced layout: 1-2 rows walk a plain copy (small_batch_linear), more rows oneDNN's packed form."""

    def __init__(self, weight: torch.Tensor, kernels) -> None:
        self.plain = weight
        self.packed = PackedWeight.of(weight)
        self.kernels = kernels

    def linear(self, x: torch.Tensor, packed_only: bool = False) -> torch.Tensor:
        if x.shape[0] <= 2 and not packed_only:
            return self.kernels.small_batch_linear(x, self.plain, torch.empty(0))
        return self.packed.linear(x)

    def nbytes(self) -> int:
        return tensor_bytes(self.plain) + self.packed.nbytes()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen1.5b")
    parser.add_argument("--rows", default="1,2,3,8,16,32,48,64,256,2048")
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("no CPU kernels built here")
    compute = torch.bfloat16 if native_bf16() else torch.float32
    packed_held = packed_weights_are_faster(compute)
    print(f"CPU family {selected_isa().label}, {describe()}; {compute} compute, AMX tiles: "
          f"{kernels.quant_linear_uses_amx()}; kvserve holds {'packed alone' if packed_held else 'plain rows'}")
    shape = SHAPES[args.shape]
    generator = torch.Generator().manual_seed(0)
    layers = [layer_weights(shape, generator) for _ in range(shape[-1])]
    held_once = [[dense_weight(w, kernels) for w in layer] for layer in layers]
    replaced = [[PackedWithPlainCopy(w.to(compute), kernels) for w in layer] for layer in layers]
    once_bytes = sum(w.nbytes() for layer in held_once for w in layer)
    replaced_bytes = sum(w.nbytes() for layer in replaced for w in layer)
    params = sum(w.numel() for layer in layers for w in layer)
    print(f"{args.shape}: {params / 1e6:.0f}M matmul parameters in {len(layers)} layers; held once "
          f"{once_bytes / 2**20:.0f} MiB, replaced (packed + plain copy) {replaced_bytes / 2**20:.0f} MiB "
          f"({replaced_bytes / once_bytes:.2f}x)")
    bandwidth, peak = memory_bandwidth(), matmul_peak(compute)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=generator).to(compute) for k in {w.shape[1] for w in layers[0]}}
        passes = 2 if rows >= 256 else 5
        plain = best_seconds(lambda: [w.linear(xs[w.in_features]) for layer in held_once for w in layer], passes)
        before = best_seconds(lambda: [w.linear(xs[w.plain.shape[1]]) for layer in replaced for w in layer], passes)
        packed = best_seconds(lambda: [w.linear(xs[w.plain.shape[1]], True) for layer in replaced for w in layer], passes)
        held = packed if packed_held else plain
        bound = max(once_bytes / bandwidth, 2 * rows * params / peak)
        print(f"  {rows:5d} rows: plain rows {plain * 1e3:8.2f} ms, packed alone {packed * 1e3:8.2f} ms, replaced "
              f"(packed + plain) {before * 1e3:8.2f} ms; held / replaced speed {before / held:.2f}x, "
              f"{bound / held:4.0%} of the bound")


if __name__ == "__main__":
    main()
