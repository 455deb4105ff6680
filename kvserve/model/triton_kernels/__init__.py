"""Triton kernels for attention over the paged KV pool, every KV format read in place: compiled on CUDA, run by
Triton's interpreter on CPU tensors (attention_backend.py chooses which before importing them)."""

from kvserve.model.triton_kernels.decode_attention import decode_attention
from kvserve.model.triton_kernels.kv_write import write_kv, writer_for
from kvserve.model.triton_kernels.prefill_attention import prefill_attention

__all__ = ["decode_attention", "prefill_attention", "write_kv", "writer_for"]
