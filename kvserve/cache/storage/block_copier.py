"""Moves whole blocks between the pool's tensors and flat byte payloads, in the pool's own format.

A block's payload is every per-block tensor of every layer (K and V data, and their scales for int8/int4)
concatenated as bytes: quantized blocks leave and come back exactly as they are, and the tiers see bytes, never
formats. Copies are batched: one index_select (or index_copy_) per pool tensor moves all the blocks of a call,
not one small copy per block and layer.
"""

from __future__ import annotations

import torch

from kvserve.cache.storage.kv_storage import LayerKVCache


class BlockCopier:
    def __init__(self, layers: list[LayerKVCache]) -> None:
        # Layers of different KV cache groups share a slot's tensors: each is moved once.
        self.tensors = list({id(tensor): tensor for layer in layers for tensor in layer.tensors()}.values())
        self.block_bytes_per_tensor = [tensor[0].numel() * tensor.element_size() for tensor in self.tensors]
        self.payload_bytes = sum(self.block_bytes_per_tensor)
        self.shards = 1  # tensor-parallel ranks whose parts a payload holds (see engine/tp_group.py)

    def read(self, block_ids: list[int]) -> list[torch.Tensor]:
        """The payloads ([payload_bytes] uint8 CPU tensors, one per block) of `block_ids`."""
        if not block_ids:
            return []
        return [row.clone() for row in self.read_joined(block_ids)]  # each payload owns its bytes (a tier frees them one by one)

    def read_joined(self, block_ids: list[int]) -> torch.Tensor:
        """[len(block_ids), payload_bytes] uint8 on the CPU: the blocks' payloads, one row each."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.tensors[0].device)
        parts = [tensor.index_select(0, index).reshape(len(block_ids), -1).view(torch.uint8)
                 for tensor in self.tensors]
        return torch.cat(parts, dim=1).cpu()

    def write(self, block_ids: list[int], payloads: list[torch.Tensor]) -> None:
        """Fills `block_ids` with `payloads` (as read returned them)."""
        if not block_ids:
            return
        assert all(p.numel() == self.payload_bytes for p in payloads), "payload from another layout"
        self.write_joined(block_ids, torch.stack(payloads))

    def write_joined(self, block_ids: list[int], joined: torch.Tensor) -> None:
        """Fills `block_ids` from [len(block_ids), payload_bytes] uint8 rows (as read_joined returned them)."""
        device = self.tensors[0].device
        joined = joined.to(device)
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        start = 0
        for tensor, size in zip(self.tensors, self.block_bytes_per_tensor):
            chunk = joined[:, start:start + size].contiguous().view(tensor.dtype).view(len(block_ids), *tensor.shape[1:])
            tensor.index_copy_(0, index, chunk)
            start += size
