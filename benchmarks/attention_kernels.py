"""CPU attention kernels against the torch path they replace, measured in one run (SmolLM2's shape, in the dtype
`--dtype auto` picks on this CPU: bf16 with AVX512-BF16, fp32 otherwise; KVSERVE_CPU_ISA caps the family).

    python benchmarks/attention_kernels.py [--layers 30]

prefill: the paged prefill kernel (every segment of a step in one call, K/V read through block tables) vs
         torch's SDPA flash kernel per sequence (what the portable path runs), on 5 prompts of 415 tokens, and
         on a 64-token chunk continuing a 2,000-token cached past (which the portable path must gather first);
decode:  the paged decode kernel vs the portable path (one index_select gather + two matmuls per layer), at
         32 sequences x 450 tokens, cycling through `--layers` layers' caches so the KV comes from DRAM as in a
         real decode step, and at 8 x 1,024 tokens with Llama-3-8B's heads (4 query heads per KV head);
shared prefix: the decode kernel reading 32 sequences' shared 400-token prefix once for all of them (cascade)
         vs the same kernel reading each context alone (the "torch path" column);
quantized decode: the decode kernel over a 4,096-token context (8 sequences) with the cache in bf16, fp8_e4m3,
         int8 and int4 (--kv-cache-dtype), each against bf16: fewer bytes per token read from DRAM; in SmolLM2's
         shape and in Qwen2.5-1.5B's (12 query heads over 2 KV heads of 128). --quantized-only: just these.
Prints milliseconds per layer for each (the best of 3 rounds) and the ratio.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvserve.cache.storage.kv_storage import LayerKVCache, allocate_kv_storage
from kvserve.model.attention import Attention
from kvserve.model.cpu_isa import native_bf16, selected_isa
from kvserve.model.cpu_kernels import cpu_kernels, decode_kernel, prefill_kernel
from kvserve.model.paged_attention import DecodeGroup, _decode_portable

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
DTYPE = torch.bfloat16 if native_bf16() else torch.float32
CACHE_DTYPE = torch.bfloat16  # what auto keeps for the demo's bf16 weights, under either compute dtype


ROUNDS = 3  # each figure is the best of this many rounds: the machine's other load only ever adds time


def per_call_ms(fn, repeat: int, rounds: int = ROUNDS) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, (time.perf_counter() - started) / repeat)
    return best * 1e3


def paged_layers(num_layers: int, num_blocks: int, generator: torch.Generator, kv_heads: int = KV_HEADS,
                 head_dim: int = HEAD_DIM) -> list[LayerKVCache]:
    shape = (num_blocks, BLOCK, kv_heads, head_dim)
    return [LayerKVCache(torch.randn(shape, generator=generator).to(CACHE_DTYPE),
                         torch.randn(shape, generator=generator).to(CACHE_DTYPE)) for _ in range(num_layers)]


def block_tables(context_lens: list[int], num_blocks: int, generator: torch.Generator) -> torch.Tensor:
    per_seq = -(-max(context_lens) // BLOCK)
    return torch.randperm(num_blocks, generator=generator)[: len(context_lens) * per_seq].view(len(context_lens), per_seq)


def prefill_case(name: str, new_tokens: list[int], pasts: list[int], layers: int, kernels, generator) -> None:
    contexts = [n + p for n, p in zip(new_tokens, pasts)]
    num_blocks = len(contexts) * -(-max(contexts) // BLOCK) + 1
    caches = paged_layers(layers, num_blocks, generator)
    prefill_fn = prefill_kernel(kernels, DTYPE, HEAD_DIM, caches[0])
    tables = block_tables(contexts, num_blocks, generator)
    starts = [0]
    for n in new_tokens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=generator).to(DTYPE)
    out = torch.empty(starts[-1], HEADS * HEAD_DIM, dtype=DTYPE)
    attn = Attention(HEADS, KV_HEADS, HEAD_DIM, None)
    inputs = (tables, torch.tensor(starts), torch.tensor(pasts))
    slots = [(tables[s].unsqueeze(1) * BLOCK + torch.arange(BLOCK)).flatten()[:contexts[s]] for s in range(len(contexts))]
    # Without a past the portable path attends over the step's own new K/V rows: nothing to gather.
    new_kv = torch.randn(2, starts[-1], KV_HEADS, HEAD_DIM, generator=generator).to(DTYPE)
    layer = iter(range(10**9))

    def kernel() -> None:
        cache = caches[next(layer) % layers]
        prefill_fn(q, cache, *inputs, attn.scale, 0, out)

    def portable() -> None:  # what paged_attention's torch path does per segment
        cache = caches[next(layer) % layers]
        for s in range(len(contexts)):
            rows = slice(starts[s], starts[s + 1])
            if pasts[s]:
                keys = cache.flat_key.index_select(0, slots[s]).to(DTYPE)
                values = cache.flat_value.index_select(0, slots[s]).to(DTYPE)
            else:
                keys, values = new_kv[0, rows], new_kv[1, rows]
            out[rows] = attn.attend(q[rows], keys, values, pasts[s])

    ours, theirs = per_call_ms(kernel, 4 * layers), per_call_ms(portable, 2 * layers)
    print(f"{name:58} {ours:9.3f} {theirs:10.3f} {theirs / ours:7.2f}x")


def decode_case(label: str, layers: int, kernels, generator, num_seqs: int = 32, context: int = 450,
                heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> None:
    num_blocks = num_seqs * -(-context // BLOCK) + 1
    caches = paged_layers(layers, num_blocks, generator, kv_heads, head_dim)
    group = DecodeGroup(block_tables([context] * num_seqs, num_blocks, generator),
                        torch.full((num_seqs,), context), context, BLOCK, None)
    q = torch.randn(num_seqs, heads, head_dim, generator=generator).to(DTYPE)
    attn = Attention(heads, kv_heads, head_dim, None)
    layer = iter(range(10**9))
    decode_fn = decode_kernel(kernels, DTYPE, caches[0])

    def kernel() -> None:
        decode_fn(q, caches[next(layer) % layers], group.block_tables, group.context_lens, attn.scale, 0)

    def portable() -> None:
        _decode_portable(attn, q.view(num_seqs, -1), caches[next(layer) % layers], group)

    ours, theirs = per_call_ms(kernel, 4 * layers), per_call_ms(portable, 2 * layers)
    print(f"{label:58} {ours:9.3f} {theirs:10.3f} {theirs / ours:7.2f}x")


def shared_prefix_case(layers: int, kernels, generator, num_seqs: int = 32, shared: int = 400) -> None:
    """Workload (a)'s decode step: 32 sequences whose first 400 tokens are the same cached blocks, each with 30 to
    94 tokens of its own. The kernel reading the shared blocks once for the group (cascade; on CPUs with AMX its
    96 query rows per KV head multiply on tiles) vs the same kernel reading every context alone."""
    shared_blocks = shared // BLOCK
    own = [30 + (64 * s) // num_seqs for s in range(num_seqs)]
    lens = [shared + n for n in own]
    own_blocks = [-(-n // BLOCK) for n in lens]
    num_blocks = shared_blocks + sum(b - shared_blocks for b in own_blocks) + 1
    caches = paged_layers(layers, num_blocks, generator)
    order = torch.randperm(num_blocks, generator=generator).tolist()
    prefix, rest = order[:shared_blocks], iter(order[shared_blocks:])
    tables = [prefix + [next(rest) for _ in range(b - shared_blocks)] for b in own_blocks]
    width = max(own_blocks)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    context_lens = torch.tensor(lens)
    groups = (torch.full((num_seqs,), shared_blocks * BLOCK), torch.zeros(num_seqs, dtype=torch.long))
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=generator).to(DTYPE)
    decode_fn, layer = decode_kernel(kernels, DTYPE, caches[0]), iter(range(10**9))

    def cascade() -> None:
        decode_fn(q, caches[next(layer) % layers], tables, context_lens, HEAD_DIM**-0.5, 0, groups)

    def alone() -> None:
        decode_fn(q, caches[next(layer) % layers], tables, context_lens, HEAD_DIM**-0.5, 0)

    ours, theirs = per_call_ms(cascade, 4 * layers), per_call_ms(alone, 4 * layers)
    label = f"decode: {num_seqs} seqs sharing {shared} tokens, read once (vs alone)"
    print(f"{label:58} {ours:9.3f} {theirs:10.3f} {theirs / ours:7.2f}x")


def quantized_decode_case(layers: int, kernels, generator, shape: str = "", heads: int = HEADS,
                          kv_heads: int = KV_HEADS, head_dim: int = HEAD_DIM) -> None:
    """The decode kernel at 8 x 4,096 tokens, per KV format; each format's caches filled with the same K/V."""
    num_seqs, context = 8, 4096
    num_blocks = num_seqs * context // BLOCK
    tables = block_tables([context] * num_seqs, num_blocks, generator)
    lens = torch.full((num_seqs,), context)
    q = torch.randn(num_seqs, heads, head_dim, generator=generator).to(DTYPE)
    slots = torch.arange(num_blocks * BLOCK)
    kv = torch.randn(2, len(slots), kv_heads, head_dim, generator=generator)
    calls = {}
    for name in ("bfloat16", "fp8_e4m3", "int8", "int4"):
        caches = allocate_kv_storage(layers, num_blocks, BLOCK, kv_heads, head_dim, CACHE_DTYPE, "cpu", name)
        for cache in caches:
            cache.write(slots, kv[0], kv[1])
        decode_fn, layer = decode_kernel(kernels, DTYPE, caches[0]), iter(range(10**9))
        calls[name] = lambda fn=decode_fn, caches=caches, layer=layer: fn(
            q, caches[next(layer) % layers], tables, lens, head_dim**-0.5, 0)
    # The formats take turns, round after round, so a change in the machine's load moves them all alike.
    timings = dict.fromkeys(calls, float("inf"))
    for _ in range(ROUNDS):
        for name, call in calls.items():
            timings[name] = min(timings[name], per_call_ms(call, 4 * layers, rounds=1))
    for name, ms in timings.items():
        label = f"decode: 8 x 4,096 tokens{shape}, {name} KV (vs bf16)"
        print(f"{label:58} {ms:9.3f} {timings['bfloat16']:10.3f} {timings['bfloat16'] / ms:7.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=30, help="caches cycled through (30 = SmolLM2's depth)")
    parser.add_argument("--quantized-only", action="store_true", help="only the quantized decode cases")
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the CPU kernels did not build here: nothing to compare")
    generator = torch.Generator().manual_seed(0)
    print(f"{selected_isa().label} kernels, {str(DTYPE).removeprefix('torch.')} over a "
          f"{str(CACHE_DTYPE).removeprefix('torch.')} cache, {HEADS} heads / {KV_HEADS} KV heads x {HEAD_DIM}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; ms per layer")
    print(f"{'case':58} {'kernel':>9} {'torch path':>10} {'ratio':>8}")
    if not args.quantized_only:
        torch_path_cases(args, kernels, generator)
    quantized_decode_case(min(args.layers, 8), kernels, generator)
    quantized_decode_case(min(args.layers, 8), kernels, generator, ", Qwen2.5-1.5B heads (12/2 x 128)",
                          heads=12, kv_heads=2, head_dim=128)


def torch_path_cases(args: argparse.Namespace, kernels, generator) -> None:
    prefill_case("prefill: 5 prompts x 415 tokens, no past", [415] * 5, [0] * 5, args.layers, kernels, generator)
    prefill_case("prefill: 64-token chunk over a 2,000-token cached past", [64], [2000], args.layers, kernels, generator)
    decode_case("decode: 32 seqs x 450 tokens, KV from DRAM", args.layers, kernels, generator)
    shared_prefix_case(args.layers, kernels, generator)
    # GQA groups wider than the values pass's registers hold (4 query rows per KV head here, 7 in Qwen2.5-7B)
    decode_case("decode: 8 x 1,024 tokens, Llama-3-8B heads (32/8 x 128)", min(args.layers, 8), kernels, generator,
                num_seqs=8, context=1024, heads=32, kv_heads=8, head_dim=128)


if __name__ == "__main__":
    main()
