"""The KV pool and GGUF weights on transparent huge pages (kvserve/huge_pages.py): same contents as the torch
allocations they replace, aligned to huge pages, and backed by them where Linux offers them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from kvserve import huge_pages
from kvserve.cache.storage.kv_storage import allocate_kv_storage

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_offered() -> bool:
    return sys.platform == "linux" and THP_MODE.exists() and "[never]" not in THP_MODE.read_text()


def _fallbacks() -> int:
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


def _huge_kib_of(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds the tensor's first byte (/proc/self/smaps)."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(part, 16) for part in first.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def test_pool_tensors_are_zeroed_aligned_and_writable():
    layers = allocate_kv_storage(2, num_blocks=700, block_size=16, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    for layer in layers:
        for tensor in (layer.key, layer.value):
            assert tensor.shape == (700, 16, 3, 64) and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
            assert tensor.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
            assert not tensor.any()
    layers[0].key[699, 15, 2, 63] = 3.0
    assert layers[0].key.flatten()[-1].item() == 3.0 and not layers[1].key.any()  # each tensor its own memory


def test_int4_values_keep_their_fill_byte():
    layers = allocate_kv_storage(1, num_blocks=4000, block_size=16, num_kv_heads=2, head_dim=128,
                                 dtype=torch.bfloat16, kv_cache_dtype="int4")
    values = layers[0].value
    assert values.numel() * values.element_size() >= huge_pages.HUGE_PAGE_BYTES
    assert values.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    assert bool((values == 0x88).all())  # two int4 zeros a byte, as torch.full gave them


def test_small_tensors_stay_plain_torch_allocations():
    tensor = huge_pages.full((8, 16), 1.5, torch.float32)
    assert tensor.shape == (8, 16) and bool((tensor == 1.5).all())
    copied = huge_pages.cat([torch.arange(6).view(2, 3).t()])
    assert copied.is_contiguous() and copied.tolist() == [[0, 3], [1, 4], [2, 5]]


def test_cat_joins_rows_into_bytes_of_its_own():
    whole = torch.arange(3 << 20, dtype=torch.int32).view(-1, 1024)
    parts = [whole[:1000, :1000], whole[1000:, :1000]]  # strided views, as a mapped file's rows can be
    joined = huge_pages.cat(parts)
    assert joined.is_contiguous() and torch.equal(joined, whole[:, :1000])
    assert joined.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0
    whole[0, 0] = -1
    assert joined[0, 0].item() == 0
    assert torch.equal(huge_pages.cat(parts[1:]), whole[1000:, :1000])


@pytest.mark.skipif(not _thp_offered(), reason="this kernel offers no transparent huge pages")
def test_large_tensors_are_backed_by_huge_pages():
    fallbacks = _fallbacks()
    tensor = huge_pages.full((5 << 20,), 0, torch.uint8)  # two whole huge pages and a part of one
    if _fallbacks() > fallbacks:
        pytest.skip("the kernel had no free huge page at this moment (thp_fault_fallback grew)")
    assert _huge_kib_of(tensor) == 4096  # the two whole ones; the last part stays in small pages
