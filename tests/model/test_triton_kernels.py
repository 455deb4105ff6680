"""The Triton attention kernels against dense references: decode (split contexts, shared prefixes, windows), prefill
over a cached past, and the K/V writer, for every KV format. On CPU they run under Triton's interpreter
(tests/conftest.py chooses it); with a GPU they compile and run on it."""

import pytest
import torch
from attention_reference import Spec, dense_prefill, quantized_cache, reference

from kvserve.cache.storage.kv_storage import LayerKVCache, allocate_kv_storage

pytest.importorskip("triton")

from kvserve.model.triton_kernels import decode_attention, prefill_attention, write_kv  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZE = 16
KV_DTYPES = [None, "fp8_e4m3", "fp8_e5m2", "int8", "int4"]


def make_cache(kv_dtype, num_blocks, kv_heads, head_dim, generator, dtype=torch.float32):
    """(the cache on DEVICE, the same K/V unquantized on CPU for the reference)."""
    if kv_dtype is None:
        shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
        keys = torch.randn(shape, generator=generator).to(dtype)
        values = torch.randn(shape, generator=generator).to(dtype)
        return LayerKVCache(keys.to(DEVICE), values.to(DEVICE)), LayerKVCache(keys.float().clone(), values.float().clone())
    cache, dense = quantized_cache(kv_dtype, num_blocks, kv_heads, head_dim, generator)
    moved = LayerKVCache(*(None if t is None else t.to(DEVICE) for t in (
        cache.key, cache.value)), cache.codec, *(None if t is None else t.to(DEVICE) for t in (
            cache.key_scales, cache.value_scales, cache.key_tensor_scale, cache.value_tensor_scale)))
    return moved, dense


def scattered_tables(context_lens, num_blocks, generator, holes=0):
    """Block tables of random blocks (so no two sequences' blocks are adjacent), padded with 0, and `holes`
    extra columns of unrelated blocks past every context (what a reader must not read)."""
    order = torch.randperm(num_blocks, generator=generator).tolist()
    needed = [-(-n // BLOCK_SIZE) for n in context_lens]
    width = max(needed) + holes
    tables, used = [], 0
    for count in needed:
        row = order[used:used + count]
        used += count
        row += [order[(used + i) % num_blocks] for i in range(width - count)]
        tables.append(row)
    return torch.tensor(tables, dtype=torch.long)


DECODE_CASES = {
    # name: (heads, kv_heads, head_dim, context lengths, window)
    "MHA, one-token and partial-block contexts": (4, 4, 32, [1, 17, 40, 16], 0),
    "GQA 4, head_dim 64": (8, 2, 64, [70, 3], 0),
    "GQA 7, narrow heads (16)": (7, 1, 16, [33, 90], 0),
    "GQA 4, window inside the context": (8, 2, 32, [90, 12, 49], 20),
    "head_dim 24 (padded tiles)": (6, 3, 24, [31, 50], 0),
}


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda d: d or "fp32")
@pytest.mark.parametrize("case", list(DECODE_CASES))
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_dense_attention(case, kv_dtype, num_splits):
    heads, kv_heads, head_dim, lens, window = DECODE_CASES[case]
    generator = torch.Generator().manual_seed(len(case) + num_splits)
    cache, dense = make_cache(kv_dtype, 24, kv_heads, head_dim, generator)
    tables = scattered_tables(lens, 24, generator, holes=2)
    q = torch.randn(len(lens), heads, head_dim, generator=generator)
    spec = Spec(heads, kv_heads, head_dim)
    out = decode_attention(q.to(DEVICE), cache, tables.to(DEVICE), torch.tensor(lens, device=DEVICE), spec.scale,
                           window, num_splits=num_splits)
    expected = reference(q, dense, tables, lens, spec, BLOCK_SIZE, window)
    assert out.shape == (len(lens), heads * head_dim)
    assert (out.cpu() - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv_dtype", [None, "int8", "int4"], ids=lambda d: d or "fp32")
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2), (7, 1)])
def test_decode_with_shared_prefixes_matches_dense_attention(heads, kv_heads, kv_dtype):
    """Two groups sharing their first blocks (read once for each group), and a decode sharing nothing."""
    generator = torch.Generator().manual_seed(heads)
    head_dim = 32
    cache, dense = make_cache(kv_dtype, 30, kv_heads, head_dim, generator)
    lens = [50, 70, 33, 40, 90, 20]
    tables = scattered_tables(lens, 30, generator)
    tables[1, :3] = tables[0, :3]  # group A: decodes 0, 1 and 3 share 2 blocks (3's third is its own)
    tables[3, :2] = tables[0, :2]
    tables[4, :1] = tables[2, :1]  # group B: decodes 2 and 4 share 1 block
    shared_lens = torch.tensor([32, 32, 16, 32, 16, 0])
    leaders = torch.tensor([0, 0, 2, 0, 2, 5])
    q = torch.randn(len(lens), heads, head_dim, generator=generator)
    spec = Spec(heads, kv_heads, head_dim)
    out = decode_attention(q.to(DEVICE), cache, tables.to(DEVICE), torch.tensor(lens, device=DEVICE), spec.scale, 0,
                           shared_prefixes=(shared_lens, leaders), num_splits=2)
    expected = reference(q, dense, tables, lens, spec, BLOCK_SIZE, 0)
    assert (out.cpu() - expected).abs().max().item() < 1e-4


def test_decode_of_a_padded_row_is_zero_and_touches_nothing_else():
    """A context length of 0 is a padded row of a replayed CUDA graph: zeros, the other rows unchanged."""
    generator = torch.Generator().manual_seed(5)
    cache, dense = make_cache(None, 8, 2, 32, generator)
    tables = scattered_tables([40, 16], 8, generator)
    q = torch.randn(2, 4, 32, generator=generator)
    spec = Spec(4, 2, 32)
    out = decode_attention(q.to(DEVICE), cache, tables.to(DEVICE), torch.tensor([40, 0], device=DEVICE), spec.scale, 0)
    expected = reference(q[:1], dense, tables[:1], [40], spec, BLOCK_SIZE, 0)
    assert (out[0].cpu() - expected[0]).abs().max().item() < 1e-4
    assert (out[1] == 0).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_and_prefill_in_16_bit_are_close_to_fp32(dtype):
    generator = torch.Generator().manual_seed(6)
    cache, dense = make_cache(None, 16, 2, 64, generator, dtype)
    lens = [45, 100]
    tables = scattered_tables(lens, 16, generator)
    q = torch.randn(2, 8, 64, generator=generator).to(dtype)
    spec = Spec(8, 2, 64)
    out = decode_attention(q.to(DEVICE), cache, tables.to(DEVICE), torch.tensor(lens, device=DEVICE), spec.scale, 0)
    assert out.dtype == dtype
    assert (out.float().cpu() - reference(q, dense, tables, lens, spec, BLOCK_SIZE, 0)).abs().max().item() < 2e-2
    check_prefill(q_dtype=dtype, cache=cache, dense=dense, heads=8, kv_heads=2, head_dim=64, lengths=[20, 37],
                  pasts=[25, 0], window=0, generator=generator, tolerance=2e-2)


PREFILL_CASES = {
    # name: (heads, kv_heads, head_dim, new tokens per sequence, cached past per sequence, window)
    "empty pasts, MHA": (4, 4, 32, [23, 5], [0, 0], 0),
    "continuing a past, one-token chunks, GQA 4": (8, 2, 32, [1, 40, 1], [30, 17, 0], 0),
    "GQA 7, narrow heads": (7, 1, 16, [50], [9], 0),
    "sliding window over a past": (8, 2, 32, [30, 45], [0, 40], 24),
    "head_dim 24, a tile boundary inside a block": (6, 3, 24, [70], [3], 0),
}


def check_prefill(q_dtype, cache, dense, heads, kv_heads, head_dim, lengths, pasts, window, generator,
                  tolerance=1e-4):
    """Runs the kernel on rows after 3 decode rows (which it must leave alone) and checks it against dense
    causal attention over the same K/V."""
    num_blocks = cache.key.shape[0]
    tables = scattered_tables([n + p for n, p in zip(lengths, pasts)], num_blocks, generator, holes=1)
    starts = [3]
    for length in lengths:
        starts.append(starts[-1] + length)
    q = torch.randn(starts[-1], heads, head_dim, generator=generator).to(q_dtype)
    out = torch.full((starts[-1], heads * head_dim), 7.0, dtype=q_dtype, device=DEVICE)
    spec = Spec(heads, kv_heads, head_dim)
    prefill_attention(q.to(DEVICE), cache, tables.to(DEVICE), torch.tensor(starts), torch.tensor(pasts), spec.scale,
                      window, out)
    expected = dense_prefill(q, dense, tables.tolist(), starts, pasts, spec, BLOCK_SIZE, window or None)
    assert (out[3:].float().cpu() - expected).abs().max().item() < tolerance
    assert (out[:3] == 7.0).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=lambda d: d or "fp32")
@pytest.mark.parametrize("case", list(PREFILL_CASES))
def test_prefill_over_a_cached_past_matches_dense_attention(case, kv_dtype):
    heads, kv_heads, head_dim, lengths, pasts, window = PREFILL_CASES[case]
    generator = torch.Generator().manual_seed(len(case))
    num_blocks = sum(-(-(n + p) // BLOCK_SIZE) for n, p in zip(lengths, pasts)) + 3
    cache, dense = make_cache(kv_dtype, num_blocks, kv_heads, head_dim, generator)
    check_prefill(torch.float32, cache, dense, heads, kv_heads, head_dim, lengths, pasts, window, generator)


@pytest.mark.parametrize("kv_dtype", [None, "fp8_e4m3", "fp8_e5m2", "int8"], ids=lambda d: d or "model dtype")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writer_is_bit_identical_to_the_torch_encoders(kv_dtype, dtype):
    """Every pool tensor (data and scales) equal to what LayerKVCache.write's torch ops store; slot -1 is skipped."""
    generator = torch.Generator().manual_seed(7)
    head_dim, kv_heads = 40, 3
    ours = allocate_kv_storage(1, 6, 4, kv_heads, head_dim, dtype, DEVICE, kv_dtype)[0]
    torchs = allocate_kv_storage(1, 6, 4, kv_heads, head_dim, dtype, "cpu", kv_dtype)[0]
    if ours.key_tensor_scale is not None:  # fp8: scales other than 1, and values past e4m3's range
        for cache in (ours, torchs):
            cache.key_tensor_scale.fill_(0.37)
            cache.value_tensor_scale.fill_(2.5)
    # Magnitudes from 1e-7 (fp8 subnormals) to 1e3; values that round up into the next binade.
    keys = torch.randn(7, kv_heads, head_dim, generator=generator) * torch.logspace(-7, 3, 7).view(7, 1, 1)
    keys[0, 0, :4] = torch.tensor([125.47, -127.59, -31.28, 0.0])
    values = torch.randn(7, kv_heads, head_dim, generator=generator) * 3
    keys, values = keys.to(dtype), values.to(dtype)
    slots = torch.tensor([3, 0, 22, -1, 7, 9, 14])
    write_kv(ours, slots.to(DEVICE), keys.to(DEVICE), values.to(DEVICE))
    written = slots >= 0
    torchs.write(slots[written], keys[written], values[written])
    for got, want in zip(ours.tensors(), torchs.tensors()):
        assert torch.equal(got.cpu(), want)


def test_decode_and_prefill_never_read_blocks_released_before_the_window():
    """A sliding-window group gives back the blocks no query can see; its table then holds block 0 there
    (RELEASED_BLOCK), whose contents belong to others: NaN here, so any read of it would show."""
    generator = torch.Generator().manual_seed(8)
    cache, dense = make_cache(None, 12, 2, 32, generator)
    cache.key[0] = cache.value[0] = float("nan")
    lens, window = [70, 50], 20
    tables = scattered_tables(lens, 11, generator) + 1  # blocks 1..11
    kept = tables[0, 2].item()
    tables[0, :3] = 0  # tokens 0..47 of 70: wholly before the window of the last query (50..69)
    tables[1, :1] = 0  # tokens 0..15 of 50 (window 30..49)
    q = torch.randn(2, 8, 32, generator=generator)
    spec = Spec(8, 2, 32)
    out = decode_attention(q.to(DEVICE), cache, tables.to(DEVICE), torch.tensor(lens, device=DEVICE), spec.scale,
                           window, num_splits=2)
    assert (out.cpu() - reference(q, dense, tables, lens, spec, BLOCK_SIZE, window)).abs().max().item() < 1e-4
    # A prefill chunk of the last 10 tokens of each: its first query sees back to position 41 (and 21), so
    # only the blocks before those stay released.
    tables[0, 2] = kept
    starts, pasts = [0, 10, 20], [60, 40]
    q = torch.randn(20, 8, 32, generator=generator)
    out = torch.zeros(20, 8 * 32, device=DEVICE)
    prefill_attention(q.to(DEVICE), cache, tables.to(DEVICE), torch.tensor(starts), torch.tensor(pasts), spec.scale,
                      window, out)
    expected = dense_prefill(q, dense, tables.tolist(), starts, pasts, spec, BLOCK_SIZE, window)
    assert (out.cpu() - expected).abs().max().item() < 1e-4
