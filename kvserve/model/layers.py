"""Building blocks of a Llama-family decoder: matmuls, RMSNorm and the gated MLP.

Each block has a portable torch form and, on CPU when the C++ kernels are built, a fused form that does the
same arithmetic (same rounding points) in one pass and one Python dispatch instead of five to ten.

On CPU with the kernels every matmul weight is held once: a GGUF file's blocks or a 16-bit or fp32 checkpoint's
plain rows as a QuantWeight (quant_weight.py), read in place for every batch size by csrc/quant_linear.cpp; or,
where oneDNN's matmul over its own blocked layout is the fastest at every batch size (bf16 on CPUs with AMX,
cpu_kernels.packed_weights_are_faster), that layout alone (PackedWeight). The portable path, the GPU and
tensor-parallel embeddings keep plain tensors and F.linear.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from kvserve.model.quant_weight import QuantWeight


def empty_parameter(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    # Weights are always loaded from a checkpoint, so random initialisation would be wasted time.
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True, slots=True, eq=False)
class PackedWeight:
    """A CPU matmul weight held only in oneDNN's blocked layout (an mkldnn tensor): every batch size, one row to a
    prefill, multiplies it without reordering it. bf16 results are F.linear's exactly."""

    packed: torch.Tensor
    shape: tuple[int, int]  # [out, in], as the plain weight's

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedWeight:
        return cls(torch.ops.mkldnn._reorder_linear_weight(weight), tuple(weight.shape))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def nbytes(self) -> int:
        return tensor_bytes(self.packed)


def linear(x: torch.Tensor, weight: torch.Tensor | QuantWeight | PackedWeight, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x @ weight.T + bias, for plain weights or weights held as QuantWeight or PackedWeight."""
    if isinstance(weight, (QuantWeight, PackedWeight)):
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


@cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether this torch build packs `dtype` weights for oneDNN and gets F.linear's results with them (bf16:
    exactly)."""
    if dtype != torch.bfloat16:
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 40, generator=generator).to(dtype)
        x = torch.randn(3, 40, generator=generator).to(dtype)
        return torch.equal(PackedWeight.of(weight).linear(x), F.linear(x, weight))
    except (RuntimeError, AttributeError):
        return False


# oneDNN keeps the code it generates for each matmul shape in two caches, ideep's and its own, 1,024 entries each
# by default. Every prefill of a new length is a new shape and an entry holds a few hundred KiB, so a server's
# memory grew by ~0.7 MiB a request for the first thousand lengths (issue 33). Entries for the shapes that recur
# (decode batches) stay; a new shape costs a few ms to generate again.
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches() -> None:
    """Caps oneDNN's per-shape caches; they read these variables once, at their first use, so this runs before
    any oneDNN call (load_model calls it first). A value the operator set wins."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = empty_parameter(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 as the reference implementation does, then cast back before the weight.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor, kernels=None) -> torch.Tensor:
        """residual += x in place (the residual stream), then returns the norm of the updated residual."""
        if kernels is not None:
            return kernels.add_rms_norm_(x, residual, self.weight, self.eps)
        residual.add_(x)
        return self.forward(residual)


class GatedMLP(torch.nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = empty_parameter(2 * intermediate_size, hidden_size, dtype=dtype)
        self.down_proj = empty_parameter(hidden_size, intermediate_size, dtype=dtype)

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        gate_up = linear(x, self.gate_up_proj)
        if kernels is not None:
            return linear(kernels.silu_and_mul(gate_up), self.down_proj)
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return linear(F.silu(gate) * up, self.down_proj)
