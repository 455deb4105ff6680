"""Plans side by side: one model across the GPU catalog or across KV dtypes, and the registry reference table."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.planner.gpus import GPU_CATALOG
from kvserve.planner.kv import COMPARED_KV_DTYPES, kv_bytes_per_request, kv_bytes_per_token
from kvserve.planner.plan import Plan, PlanRequest, make_plan
from kvserve.planner.registry import REGISTRY, registry_spec
from kvserve.planner.specs import ModelSpec
from kvserve.planner.weights import total_params


def compare_gpus(spec: ModelSpec, request: PlanRequest) -> list[Plan]:
    """The same request on every catalog GPU, smallest first."""
    gpus = sorted(GPU_CATALOG, key=lambda gpu: gpu.memory_bytes)
    return [make_plan(spec, replace(request, gpu=gpu.name, gpu_memory_gib=None)) for gpu in gpus]


def compare_kv_dtypes(spec: ModelSpec, request: PlanRequest) -> list[Plan]:
    """The same request with the KV cache in the model dtype, fp8, int8 and int4."""
    return [make_plan(spec, replace(request, kv_cache_dtype=dtype)) for dtype in COMPARED_KV_DTYPES]


@dataclass(slots=True, frozen=True)
class ReferenceRow:
    repo_id: str
    params: int
    layers: int
    attention: str
    window: str
    kv_16bit_per_token: int
    kv_fp8_per_token: int
    context_len: int
    kv_16bit_at_context: int
    kv_fp8_at_context: int
    kv_16bit_windowed_at_context: int | None


def reference_rows() -> list[ReferenceRow]:
    """Per-token and full-context KV for every registry model, at 16-bit and fp8, TP 1."""
    return [_reference_row(registry_spec(entry.repo_id)) for entry in REGISTRY]


def _reference_row(spec: ModelSpec) -> ReferenceRow:
    context = spec.max_position_embeddings
    kv16 = kv_bytes_per_token(spec, "bfloat16")
    kv8 = kv_bytes_per_token(spec, "fp8")
    windowed = kv_bytes_per_request(spec, context, "bfloat16") if spec.has_windowed_layers else None
    return ReferenceRow(spec.name, total_params(spec), spec.num_layers, attention_summary(spec),
                        window_summary(spec), kv16, kv8, context, kv16 * context, kv8 * context, windowed)


def attention_summary(spec: ModelSpec) -> str:
    if spec.is_mla:
        return f"MLA {spec.kv_lora_rank}+{spec.qk_rope_head_dim}"
    return f"{spec.attention_kind} {spec.num_attention_heads}/{spec.num_kv_heads}×{spec.head_dim}"


def window_summary(spec: ModelSpec) -> str:
    """`21/42 × 4096`: how many layers slide, and their window."""
    if not spec.has_windowed_layers:
        return "—"
    return f"{len(spec.windowed_layers)}/{spec.num_layers} × {spec.sliding_window}"

