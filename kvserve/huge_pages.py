"""Large host tensors on transparent huge pages: the KV pool and the weights, which decode steps read from end to
end. With 4 KiB pages, reading a pool block here and a weight panel there misses the TLB every few pages, and each
miss walks the page tables; a 2 MiB page covers 512 times the bytes with one entry. Linux backs memory with huge
pages where it was asked to by madvise(MADV_HUGEPAGE), when its THP mode is `always` or `madvise` (the usual
default). Anywhere else (another OS, THP off, a GPU tensor, a small tensor) these are plain torch allocations.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20


def full(shape: tuple[int, ...], fill_value: float | int, dtype: torch.dtype,
         device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.full, on huge pages when it is a host tensor of at least one huge page. Every page is written (as
    torch.full writes them), so the memory is resident from the start, as the planner counted it."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not _worth_huge_pages(torch.device(device), nbytes):
        return torch.full(shape, fill_value, dtype=dtype, device=device)
    return _mapped(shape, dtype, nbytes).fill_(fill_value)


def cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Host tensors joined along dim 0 into a contiguous tensor that owns its bytes (one tensor: a copy), on huge
    pages when it is large enough; written in place, with no intermediate copy."""
    first = tensors[0]
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    nbytes = math.prod(shape) * first.element_size()
    if not _worth_huge_pages(first.device, nbytes):
        return torch.cat(tensors) if len(tensors) > 1 else first.clone(memory_format=torch.contiguous_format)
    return torch.cat(tensors, out=_mapped(shape, first.dtype, nbytes))


def _worth_huge_pages(device: torch.device, nbytes: int) -> bool:
    return device.type == "cpu" and nbytes >= HUGE_PAGE_BYTES and hasattr(mmap, "MADV_HUGEPAGE")


def _mapped(shape: tuple[int, ...], dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    # Private anonymous memory (a shared mapping would be shmem, whose huge pages are another setting), zeroed and
    # unbacked until written: the advice must come before the first write, which is when the kernel picks the page
    # size. One huge page more than asked for, so the tensor can start on a huge page's boundary; only its whole
    # huge pages are advised, so its last part stays in small pages and it holds no more memory than it asks for
    # (the pages around it are never written, so never resident). The tensor keeps the mapping alive and unmaps it
    # when freed.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES)
    return raw[start : start + nbytes].view(dtype).view(shape)
