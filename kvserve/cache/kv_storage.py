"""The tensors behind the block pool: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, head_dim].

`cache/` owns these tensors; the model's attention writes new K/V through a slot mapping (slot = block id x
block_size + offset) and reads context through block tables. Quantized formats will keep their scales beside
the data in the same object, so the scheduler and the runner never see the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LayerKVCache:
    key: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    value: torch.Tensor

    @property
    def flat_key(self) -> torch.Tensor:
        """[num_blocks * block_size, kv_heads, head_dim]: a view addressed by slot."""
        return self.key.view(-1, *self.key.shape[2:])

    @property
    def flat_value(self) -> torch.Tensor:
        return self.value.view(-1, *self.value.shape[2:])

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        self.flat_key.index_copy_(0, slot_mapping, key.to(self.key.dtype))
        self.flat_value.index_copy_(0, slot_mapping, value.to(self.value.dtype))


def allocate_kv_storage(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> list[LayerKVCache]:
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    # zeros, not empty: padded block-table entries read block contents that attention then masks out,
    # and NaN garbage times a zero weight would still be NaN.
    return [
        LayerKVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
