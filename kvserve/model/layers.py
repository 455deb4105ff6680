"""Building blocks of a Llama-family decoder: matmuls, RMSNorm and the gated MLP.

Each block has a portable torch form and, on CPU when the C++ kernels are built, a fused form that does the
same arithmetic (same rounding points) in one pass and one Python dispatch instead of five to ten.

Matmul weights may be packed for CPU (`pack_weight`): oneDNN then reads them in its own blocked layout instead
of reordering them on every call. bf16 results are bit-identical to F.linear, and bf16 matmuls get 1.2-2x
faster at decode batch sizes (1-32 rows), where that per-call reorder is a large share of the work. fp32 (the
compute dtype of CPUs without native bf16) is packed too: at 32 rows packed fp32 ran 1.2-3x F.linear's speed
on an AMD EPYC (the tied head, 49152 x 576: 13.9 against 44.6 ms), and only oneDNN's code can be capped to AVX2
to measure an AVX2 CPU on a bigger one; fp32 results differ from F.linear's by rounding (another summation
order).

Batches of one or two rows (a single stream's decode) are a walk over the weights, which oneDNN's packed GEMV
makes slower than it need be; where there is room, a packed weight keeps its plain row-major form beside it
and `small_batch_linear` (csrc/small_batch_linear.cpp) walks that one instead: 1.4x faster matmuls for a single
stream. The plain copy costs the weights' bytes again, so it is kept only while the matmul weights are at most
SMALL_BATCH_COPY_LIMIT_BYTES (models up to ~1B parameters in bf16); a tied head's plain form is the embedding,
kept anyway, so it costs nothing.

A weight loaded from GGUF blocks of a type csrc/quant_linear.cpp reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
Q5_K, Q6_K) is neither packed nor copied: it stays the file's blocks (quant_weight.QuantWeight), read in place
for every batch size.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from kvserve.model.quant_weight import QuantWeight


def empty_parameter(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    # Weights are always loaded from a checkpoint, so random initialisation would be wasted time.
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


SMALL_BATCH_COPY_LIMIT_BYTES = 2 * 2**30


@dataclass(frozen=True, slots=True, eq=False)
class PackedWeight:
    """A CPU matmul weight packed for oneDNN, with its plain form for batches of up to `max_rows` rows when
    kept."""

    packed: torch.Tensor  # oneDNN's blocked layout (an mkldnn tensor)
    plain: torch.Tensor | None = None  # [out, in] row-major, read by small batches
    small_batch_linear: Callable | None = None  # (x, plain, bias or empty) -> x @ plain.T + bias
    max_rows: int = 0

    def extra_bytes(self) -> int:
        """Bytes held besides the model's parameters (a plain copy that is itself a parameter is not counted)."""
        plain = 0 if self.plain is None or isinstance(self.plain, torch.nn.Parameter) else tensor_bytes(self.plain)
        return tensor_bytes(self.packed) + plain


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_NO_BIAS = torch.empty(0)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight | QuantWeight, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """x @ weight.T + bias, for plain, packed or GGUF-block weights."""
    if isinstance(weight, QuantWeight):
        return weight.linear(x, bias)
    if isinstance(weight, PackedWeight):
        if weight.plain is not None and 0 < x.shape[0] <= weight.max_rows:
            return weight.small_batch_linear(x, weight.plain, _NO_BIAS if bias is None else bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


PACKABLE_DTYPES = (torch.bfloat16, torch.float32)

# oneDNN keeps the code it generates for each matmul shape in two caches, ideep's and its own, 1,024 entries each
# by default. Every prefill of a new length is a new shape and an entry holds a few hundred KiB, so a server's
# memory grew by ~0.7 MiB a request for the first thousand lengths (issue 33). Entries for the shapes that recur
# (decode batches) stay; a new shape costs a few ms to generate again.
ONEDNN_CACHE_CAPACITY = 64
ONEDNN_CACHE_VARIABLES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches() -> None:
    """Caps oneDNN's per-shape caches; they read these variables once, at their first use, so this runs before
    any oneDNN call. A value the operator set wins."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_CAPACITY))


@cache
def weight_packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build packs `dtype` weights for oneDNN and gets F.linear's results with them (exactly
    for bf16, within fp32 rounding for fp32). The first oneDNN call kvserve makes, so it caps oneDNN's caches."""
    bound_onednn_caches()
    if dtype not in PACKABLE_DTYPES:
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(24, 40, generator=generator).to(dtype)
        x = torch.randn(3, 40, generator=generator).to(dtype)
        packed = PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight))
        if dtype == torch.bfloat16:
            return torch.equal(linear(x, packed), F.linear(x, weight))
        return torch.allclose(linear(x, packed), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    except (RuntimeError, AttributeError):
        return False


def pack_weight(module: torch.nn.Module, name: str, kernels=None, plain: torch.Tensor | None = None) -> None:
    """Replaces the CPU matmul weight `module.<name>` by its packed form (once). With `kernels` (the C++ module),
    small batches read `plain` (default: the weight itself, then kept instead of freed) through
    small_batch_linear; without, the plain weight is freed."""
    weight = getattr(module, name)
    if isinstance(weight, PackedWeight):
        return
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
    delattr(module, name)
    if kernels is None:
        setattr(module, name, PackedWeight(packed))
    else:
        plain = weight.detach() if plain is None else plain
        setattr(module, name, PackedWeight(packed, plain, kernels.small_batch_linear,
                                           kernels.small_batch_linear_max_rows()))


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
