"""The compiled CPU kernels (every ISA family this CPU runs: AVX2 on an AVX-512 machine too) and the portable
torch path compute the same attention over a paged cache."""

import pytest
import torch
from kernel_families import FAMILIES, kernels_for

from kvserve.cache.kv_storage import LayerKVCache
from kvserve.model.cpu_kernels import prefill_kernel
from kvserve.model.paged_attention import DecodeGroup, _decode_portable



class Spec:
    def __init__(self, num_heads, num_kv_heads, head_dim):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5


def reference(q, cache, tables, lens, spec, block_size, window):
    """Dense attention, one sequence at a time, from the cache's slots."""
    outs = []
    for seq in range(q.shape[0]):
        length = int(lens[seq])
        slots = [int(tables[seq, p // block_size]) * block_size + p % block_size for p in range(length)]
        if window:
            slots = slots[max(0, length - window):]
        k = cache.flat_key[slots].float().repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=1)
        v = cache.flat_value[slots].float().repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[seq].float(), k) * spec.scale
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(outs)


def decode_case(dtype, heads, kv_heads, head_dim, window, cache_dtype=None):
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks, num_seqs = 16, 64, 5
    cache = LayerKVCache(
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype or dtype),
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype or dtype),
    )
    lens = torch.tensor([1, 17, 40, 64, 100])
    max_blocks = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, heads, head_dim, generator=generator).to(dtype)
    return cache, tables, lens, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (14, 2, 64), (6, 2, 40)])
@pytest.mark.parametrize("window", [None, 20])
def test_portable_path_matches_dense_attention(dtype, heads, kv_heads, head_dim, window):
    cache, tables, lens, q = decode_case(dtype, heads, kv_heads, head_dim, window)
    num_seqs, block_size = q.shape[0], 16
    spec = Spec(heads, kv_heads, head_dim)
    expected = reference(q, cache, tables, lens, spec, block_size, window)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    group = DecodeGroup(tables, lens, int(lens.max()), block_size, window)
    portable = _decode_portable(spec, q.view(num_seqs, -1), cache, group).float()
    assert (portable - expected).abs().max().item() < tolerance
    # A gather bound of 250 tokens takes two sequences of the 100-token context at a time (three chunks).
    bounded = DecodeGroup(tables, lens, int(lens.max()), block_size, window, max_gather_tokens=250)
    assert bounded.rows_per_gather == 2
    assert torch.equal(_decode_portable(spec, q.view(num_seqs, -1), cache, bounded).float(), portable)


# (query dtype, cache dtype): the model's own, and an fp32 model's 16-bit cache (what --dtype auto keeps on a CPU
# without native bf16), which the kernels widen as they read.
DTYPE_PAIRS = pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16), (torch.float32, torch.float16)], ids=str)


@FAMILIES
@DTYPE_PAIRS
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (14, 2, 64), (6, 2, 40)])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_kernel_matches_dense_attention(isa, dtype, cache_dtype, heads, kv_heads, head_dim, window):
    kernels = kernels_for(isa)
    cache, tables, lens, q = decode_case(dtype, heads, kv_heads, head_dim, window, cache_dtype)
    spec = Spec(heads, kv_heads, head_dim)
    expected = reference(q, cache, tables, lens, spec, 16, window)
    got = kernels.paged_decode_attention(q, cache.key, cache.value, tables, lens, spec.scale, window or 0)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.view(q.shape[0], -1).float() - expected).abs().max().item() < tolerance



def dense_prefill(q, cache, tables, starts, pasts, spec, block_size, window):
    """Causal attention of each segment's queries over its whole context read from the cache's slots, in fp32."""
    group = spec.num_heads // spec.num_kv_heads
    outs = []
    for seg, past in enumerate(pasts):
        num_queries = starts[seg + 1] - starts[seg]
        context = past + num_queries
        slots = [tables[seg][p // block_size] * block_size + p % block_size for p in range(context)]
        k = cache.flat_key[slots].float().repeat_interleave(group, dim=1)
        v = cache.flat_value[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[starts[seg]:starts[seg + 1]].float(), k) * spec.scale
        query_pos = torch.arange(num_queries).unsqueeze(1) + past
        key_pos = torch.arange(context).unsqueeze(0)
        visible = key_pos <= query_pos
        if window:
            visible &= key_pos > query_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(num_queries, -1))
    return torch.cat(outs)


PREFILL_CASES = {
    # name: (heads, kv_heads, head_dim, new tokens per segment, cached past per segment, window)
    "one prompt, GQA 3": (9, 3, 64, [415], [0], None),
    "chunks continuing a past, across online-softmax chunks": (9, 3, 64, [1, 17, 300, 5], [0, 40, 700, 1000], None),
    "MHA, head_dim 128": (4, 4, 128, [33, 260], [15, 0], None),
    "sliding window": (8, 2, 64, [100, 600], [0, 37], 50),
    "window inside a long past, head_dim 256": (8, 1, 256, [70], [300], 100),
    "narrow heads (16), GQA 2": (4, 2, 16, [50, 3], [0, 280], None),
}


@FAMILIES
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16), (torch.float32, torch.float16)],
                         ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES)
def test_prefill_kernel_matches_dense_attention(isa, dtype, cache_dtype, case):
    """All prefill segments of a step in one call, reading K/V through block tables; rows outside the segments
    (the step's decodes) are left alone, and q may be a strided view of the fused qkv activation. bf16 runs
    where the family has bf16 dot products (AVX512-BF16), fp32 on AVX2 and AVX-512."""
    heads, kv_heads, head_dim, lengths, pasts, window = PREFILL_CASES[case]
    generator = torch.Generator().manual_seed(0)
    block_size = 16
    blocks_per_seq = [-(-(n + p) // block_size) for n, p in zip(lengths, pasts)]
    num_blocks = sum(blocks_per_seq) + 4
    cache = LayerKVCache(
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype),
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype),
    )
    kernel = prefill_kernel(kernels_for(isa), dtype, head_dim, cache)
    if kernel is None:
        pytest.skip(f"no {dtype} prefill kernel over a {cache_dtype} cache in the {isa} family")
    check_prefill(kernel, cache, dtype, heads, kv_heads, head_dim, lengths, pasts, window, generator, cache)


def check_prefill(kernel, cache, dtype, heads, kv_heads, head_dim, lengths, pasts, window, generator, dense_cache,
                  tolerance=None):
    """Runs the prefill kernel on `cache` and checks it against dense attention over `dense_cache` (the same K/V,
    unquantized)."""
    block_size, num_decode_rows = 16, 3
    blocks_per_seq = [-(-(n + p) // block_size) for n, p in zip(lengths, pasts)]
    num_blocks = cache.key.shape[0]
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, used = [], 0
    for count in blocks_per_seq:
        tables.append(order[used:used + count] + [0] * (max(blocks_per_seq) - count))
        used += count
    starts = [num_decode_rows]
    for length in lengths:
        starts.append(starts[-1] + length)
    qkv = torch.randn(starts[-1], (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    out = torch.full((starts[-1], heads * head_dim), 7.0, dtype=dtype)
    spec = Spec(heads, kv_heads, head_dim)
    kernel(q, cache, torch.tensor(tables), torch.tensor(starts), torch.tensor(pasts), spec.scale, window or 0, out)
    expected = dense_prefill(q, dense_cache, tables, starts, pasts, spec, block_size, window)
    tolerance = tolerance or (1e-5 if dtype == torch.float32 else 3e-2)
    assert (out[num_decode_rows:].float() - expected).abs().max().item() < tolerance
    assert (out[:num_decode_rows] == 7.0).all()


@FAMILIES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 600])
def test_decode_kernel_splits_few_long_contexts_and_merges_them(isa, dtype, window):
    """One or two sequences with long contexts: too few (sequence, KV head) tasks for the threads, so each
    context is cut into parts whose partial softmax sums are merged. The result is the same attention."""
    kernel = kernels_for(isa)
    generator = torch.Generator().manual_seed(1)
    block_size, num_blocks, heads, kv_heads, head_dim = 16, 200, 8, 1, 64
    cache = LayerKVCache(
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype),
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype),
    )
    lens = torch.tensor([1500, 900])
    tables = torch.randperm(num_blocks, generator=generator)[:2 * 94].view(2, 94)
    q = torch.randn(2, heads, head_dim, generator=generator).to(dtype)
    spec = Spec(heads, kv_heads, head_dim)
    expected = reference(q, cache, tables, lens, spec, block_size, window)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)  # 2 tasks for 4 threads: up to 4 parts each
        got = kernel.paged_decode_attention(q, cache.key, cache.value, tables, lens, spec.scale, window or 0)
    finally:
        torch.set_num_threads(threads)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.view(2, -1).float() - expected).abs().max().item() < tolerance
