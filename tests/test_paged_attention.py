"""The compiled CPU decode kernel and the portable torch path compute the same attention over a paged cache."""

import pytest
import torch

from kvserve.cache.kv_storage import LayerKVCache
from kvserve.model.cpu_kernels import cpu_kernels
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (8, 2, 128), (6, 2, 40)])
@pytest.mark.parametrize("window", [None, 20])
def test_kernel_and_portable_path_match_dense_attention(dtype, heads, kv_heads, head_dim, window):
    generator = torch.Generator().manual_seed(0)
    block_size, num_blocks, num_seqs = 16, 64, 5
    cache = LayerKVCache(
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype),
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(dtype),
    )
    lens = torch.tensor([1, 17, 40, 64, 100])
    max_blocks = -(-int(lens.max()) // block_size)
    tables = torch.randperm(num_blocks, generator=generator)[: num_seqs * max_blocks].view(num_seqs, max_blocks)
    q = torch.randn(num_seqs, heads, head_dim, generator=generator).to(dtype)
    spec = Spec(heads, kv_heads, head_dim)
    expected = reference(q, cache, tables, lens, spec, block_size, window)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    group = DecodeGroup(tables, lens, block_size, window, use_kernel=False)
    portable = _decode_portable(spec, q.view(num_seqs, -1), cache, group).float()
    assert (portable - expected).abs().max().item() < tolerance
    kernel = cpu_kernels()
    if kernel is None:
        pytest.skip("the CPU kernel could not be built here")
    got = kernel.paged_decode_attention(q, cache.key, cache.value, tables, lens, spec.scale, window or 0)
    assert (got.view(num_seqs, -1).float() - expected).abs().max().item() < tolerance

