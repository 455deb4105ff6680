"""Which kernels attention runs (`--attention-backend`, vLLM's flag): all behind one interface.

- `cpu`: the C++ kernels (cpu_kernels.py), CPU tensors only.
- `triton`: the Triton kernels (triton_kernels/), compiled on CUDA; on CPU tensors they run under Triton's
  interpreter, which is how the tests prove them without a GPU (slow: for tests only).
- `torch`: the portable path of paged_attention.py (gathers, then matmuls or SDPA), the fallback and reference.
- `auto`: `cpu` on CPU (the portable path where the kernels did not build), `triton` on CUDA when Triton is
  installed, else `torch`.

Each backend gives the same three things: a decode kernel, a prefill kernel and a writer of new K/V per layer;
None for any of them means the portable torch code does that part.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.config import ATTENTION_BACKENDS
from kvserve.model import cpu_kernels as cpu

logger = logging.getLogger("kvserve.model")

@dataclass(frozen=True, slots=True)
class AttentionKernels:
    name: str  # the backend that runs: cpu, triton or torch
    decode: Callable | None  # fn(q, cache, block_tables, context_lens, scale, window, shared_prefixes=None) -> out
    prefill: Callable | None  # fn(q, cache, block_tables, query_starts, num_past, scale, window, out)
    writer: Callable[[LayerKVCache], Callable | None]  # a layer's LayerKVCache.writer
    graph_safe: bool = False  # whether a decode step through them can be captured as a CUDA graph


PORTABLE = AttentionKernels("torch", None, None, lambda cache: None)


def attention_kernels(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                      cache: LayerKVCache) -> AttentionKernels:
    """The kernels `backend` runs for this device, model dtype and cache format."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {backend!r}")
    if backend == "auto":
        backend = "cpu" if device.type == "cpu" else "triton" if triton_installed() else "torch"
    if backend == "torch":
        return PORTABLE
    if backend == "cpu":
        if device.type != "cpu":
            raise ValueError(f"--attention-backend cpu runs the CPU kernels, not on {device}: use auto or triton")
        return _cpu(dtype, head_dim, cache)
    return _triton(device)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def _cpu(dtype: torch.dtype, head_dim: int, cache: LayerKVCache) -> AttentionKernels:
    kernels = cpu.cpu_kernels()
    if kernels is None:
        return PORTABLE
    return AttentionKernels("cpu", cpu.decode_kernel(kernels, dtype, cache),
                            cpu.prefill_kernel(kernels, dtype, head_dim, cache),
                            lambda layer: cpu.kv_writer(kernels, layer))


def _triton(device: torch.device) -> AttentionKernels:
    if not triton_installed():
        raise ValueError("--attention-backend triton needs Triton: pip install triton (CUDA builds of torch bring it)")
    _choose_interpreter(device)
    from kvserve.model.triton_kernels import decode_attention, prefill_attention, writer_for

    return AttentionKernels("triton", decode_attention, prefill_attention, writer_for, graph_safe=True)


def _choose_interpreter(device: torch.device) -> None:
    """Triton decides when a function is defined whether it compiles or interprets it, its own library's too, so
    CPU tensors need the interpreter chosen before triton is first imported."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    if device.type == "cuda":
        if interpreting:
            raise ValueError("--attention-backend triton on CUDA: unset TRITON_INTERPRET (it runs kernels on the CPU)")
        return
    if interpreting:
        return
    if "triton" in sys.modules:
        raise ValueError("--attention-backend triton on CPU tensors runs under Triton's interpreter, which must be "
                         "chosen before triton is imported: set TRITON_INTERPRET=1 when the process starts")
    logger.warning("--attention-backend triton on CPU: the kernels run under Triton's interpreter "
                   "(TRITON_INTERPRET=1), which is for tests and very slow; the CPU kernels are --attention-backend cpu")
    os.environ["TRITON_INTERPRET"] = "1"
