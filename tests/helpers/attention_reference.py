"""Dense attention references for the paged attention kernels' tests: the same K/V read slot by slot through the
block tables, in fp32."""

import torch

from kvserve.cache.storage.kv_storage import LayerKVCache, allocate_kv_storage


class Spec:
    def __init__(self, num_heads, num_kv_heads, head_dim, sliding_window=None):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.sliding_window = sliding_window


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


def quantized_cache(kv_dtype, num_blocks, kv_heads, head_dim, generator, block_size=16):
    """A quantized cache filled with random K/V, and the same K/V decoded into an fp32 cache (the reference)."""
    cache = allocate_kv_storage(1, num_blocks, block_size, kv_heads, head_dim, torch.float32, "cpu", kv_dtype)[0]
    if cache.key_tensor_scale is not None:  # fp8: scales other than 1, so the kernels must apply them
        cache.key_tensor_scale.fill_(0.02)
        cache.value_tensor_scale.fill_(0.01)
    slots = torch.arange(num_blocks * block_size)
    shape = (len(slots), kv_heads, head_dim)
    cache.write(slots, torch.randn(shape, generator=generator) * 2, torch.randn(shape, generator=generator))
    keys, values = cache.gather(slots, torch.float32)
    dense = LayerKVCache(keys.view(num_blocks, block_size, kv_heads, head_dim),
                         values.view(num_blocks, block_size, kv_heads, head_dim))
    return cache, dense
