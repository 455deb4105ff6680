"""The compiled CPU kernels (every ISA family this CPU runs: AVX2 on an AVX-512 machine too) and the portable
torch path compute the same attention over a paged cache."""

import pytest
import torch
from attention_reference import PREFILL_CASES, Spec, check_prefill, reference
from kernel_families import FAMILIES, kernels_for

from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.model.cpu_kernels import prefill_kernel
from kvserve.model.paged_attention import DecodeGroup, _decode_portable

NONE = torch.empty(0, dtype=torch.long)  # no shared prefixes (tests/model/test_shared_prefix_decode.py has them)



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
    spec = Spec(heads, kv_heads, head_dim, window)
    expected = reference(q, cache, tables, lens, spec, block_size, window)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    group = DecodeGroup(tables, lens, int(lens.max()), block_size)
    portable = _decode_portable(spec, q.view(num_seqs, -1), cache, group).float()
    assert (portable - expected).abs().max().item() < tolerance
    # A gather bound of 250 tokens takes two sequences of the 100-token context at a time (three chunks).
    bounded = DecodeGroup(tables, lens, int(lens.max()), block_size, max_gather_tokens=250)
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
    got = kernels.paged_decode_attention(q, cache.key, cache.value, tables, lens, spec.scale, window or 0, NONE, NONE)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.view(q.shape[0], -1).float() - expected).abs().max().item() < tolerance



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
        got = kernel.paged_decode_attention(q, cache.key, cache.value, tables, lens, spec.scale, window or 0, NONE, NONE)
    finally:
        torch.set_num_threads(threads)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.view(2, -1).float() - expected).abs().max().item() < tolerance


@FAMILIES
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
                         ids=str)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (8, 2, 128), (14, 2, 64), (4, 4, 64)])
def test_decode_kernel_over_a_batch_of_sequences(isa, dtype, cache_dtype, heads, kv_heads, head_dim):
    """A decode batch as a busy server has it (48 sequences of 1-700 tokens): each sequence's heads are one
    thread's unit, read a tile at a time for all heads, in one part or in several (AMX builds cap a part at 512
    tokens). The result is the same attention."""
    kernel = kernels_for(isa)
    generator = torch.Generator().manual_seed(2)
    block_size, num_seqs, max_blocks = 16, 48, 44
    num_blocks = num_seqs * max_blocks
    cache = LayerKVCache(
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype),
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(cache_dtype),
    )
    lens = torch.randint(1, 701, (num_seqs,), generator=generator)
    lens[:3] = torch.tensor([1, 16, 700])
    tables = torch.randperm(num_blocks, generator=generator).view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, heads, head_dim, generator=generator).to(dtype)
    spec = Spec(heads, kv_heads, head_dim)
    expected = reference(q, cache, tables, lens, spec, block_size, None)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the units as a 2-core server plans them
        got = kernel.paged_decode_attention(q, cache.key, cache.value, tables, lens, spec.scale, 0, NONE, NONE)
    finally:
        torch.set_num_threads(threads)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert (got.view(num_seqs, -1).float() - expected).abs().max().item() < tolerance
