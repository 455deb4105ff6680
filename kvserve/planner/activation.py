"""Activation and graph reserve: the memory a serving engine needs besides weights and KV.

An engine measures this at startup (vLLM profiles one forward pass of `--max-num-batched-tokens` tokens and
one sampler pass of `--max-num-seqs` rows); a planner can only estimate it. The heuristic, per GPU:

  reserve = runtime overhead
          + tokens × (4 × hidden + max(MLP width, attention width)) × dtype bytes     (forward peak)
          + max-num-seqs × vocab × 8 B                                               (sampler)

- runtime overhead: 512 MiB for CUDA graphs, cuBLAS workspaces and allocator slack, plus 256 MiB of NCCL
  buffers when the model spans several GPUs. vLLM's logs show 0.3-1.5 GiB for these on current models.
- forward peak: at the widest point of a layer the residual stream, its normed copy, the layer output and a
  communication buffer (4 × hidden) coexist with the MLP intermediate (gate+up output and the activated
  product: 3 × intermediate / TP) or, for MoE, the fused-MoE caches (top_k × (3 × expert width / TP + hidden)).
- sampler: fp32 logits plus the fp32 probabilities derived from them, for every running sequence, over the
  full vocabulary (logits are gathered across TP ranks).

It errs on the generous side: a reserve that is too small shows up as an OOM under load, one that is too large
only as a slightly smaller pool. Override it with `--activation-reserve-gib` once you have the engine's figure.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.dtypes import DTYPE_BYTES
from kvserve.planner.specs import ModelSpec
from kvserve.planner.units import MiB, format_bytes, gib_to_bytes

RUNTIME_OVERHEAD_BYTES = 512 * MiB
MULTI_GPU_OVERHEAD_BYTES = 256 * MiB
_RESIDUAL_COPIES = 4
_SAMPLER_BYTES_PER_LOGIT = 8  # fp32 logits + fp32 probabilities


@dataclass(slots=True, frozen=True)
class ActivationReserve:
    bytes: int
    formula: str
    overridden: bool = False


def activation_reserve(
    spec: ModelSpec,
    model_dtype: str,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> ActivationReserve:
    dtype_bytes = DTYPE_BYTES[model_dtype]
    multi_gpu = tensor_parallel_size * pipeline_parallel_size > 1
    runtime = RUNTIME_OVERHEAD_BYTES + (MULTI_GPU_OVERHEAD_BYTES if multi_gpu else 0)
    width = _widest_intermediate(spec, tensor_parallel_size)
    per_token = _RESIDUAL_COPIES * spec.hidden_size + width
    forward = max_num_batched_tokens * per_token * dtype_bytes
    sampler = max_num_seqs * spec.vocab_size * _SAMPLER_BYTES_PER_LOGIT
    total = runtime + forward + sampler
    formula = (
        f"{format_bytes(runtime)} runtime + {max_num_batched_tokens:,} batched tokens × "
        f"(4 × {spec.hidden_size} + {width:,}) × {dtype_bytes} B + {max_num_seqs} seqs × "
        f"{spec.vocab_size:,} vocab × 8 B = {format_bytes(total)}  (heuristic; --activation-reserve-gib overrides)"
    )
    return ActivationReserve(total, formula)


def _widest_intermediate(spec: ModelSpec, tp: int) -> int:
    """Per-token elements of the widest transient inside one layer on one GPU."""
    attention = (spec.num_attention_heads + 2 * spec.num_kv_heads) * spec.head_dim // tp
    if spec.is_mla:
        attention = spec.num_attention_heads * (spec.qk_nope_head_dim + spec.qk_rope_head_dim + spec.v_head_dim) // tp
    dense = 3 * spec.intermediate_size // tp if spec.first_dense_layers or not spec.is_moe else 0
    moe = 0
    if spec.is_moe:
        moe = spec.num_experts_per_tok * (3 * spec.moe_intermediate_size // tp + spec.hidden_size)
    return max(attention, dense, moe)


def overridden_reserve(reserve_gib: float) -> ActivationReserve:
    reserve = gib_to_bytes(reserve_gib)
    return ActivationReserve(reserve, f"--activation-reserve-gib {reserve_gib:g} = {format_bytes(reserve)}", True)
