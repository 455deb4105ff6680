"""`kvserve plan --json`: plans as plain dicts, every byte figure exact (integers), with its arithmetic."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvserve.planner.advice import Fix
from kvserve.planner.compare import ReferenceRow
from kvserve.planner.plan import WITH_GPU, Figure, ModelCost, Plan
from kvserve.planner.specs import ModelSpec

JSON_SCHEMA_VERSION = 1


def plan_to_dict(plan: Plan, fixes: list[Fix] | None = None) -> dict[str, Any]:
    spec, request = plan.spec, plan.request
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "model": _model_dict(spec, plan.weights.total_params),
        "gpu": {"name": plan.gpu.name, "memory_bytes": plan.gpu.memory_bytes},
        "inputs": asdict(request) | {
            "max_model_len": plan.max_model_len,
            "target_concurrency": plan.target_concurrency,
            "resolved_dtype": plan.model_dtype,
            "resolved_kv_cache_dtype": plan.kv.name,
            "resolved_quantization": plan.weights.quant.label,
        },
        "kv_bytes_per_token": plan.kv_bytes_per_token,
        "kv_block_bytes": plan.block_bytes,
        "weights_bytes_per_gpu": plan.weights.per_gpu_bytes,
        "weights_bytes_total": plan.weights.total_bytes,
        "activation_reserve_bytes": plan.activation.bytes,
        "budget_bytes": plan.budget_bytes,
        "kv_pool_bytes": plan.pool_bytes,
        "num_blocks": plan.num_blocks,
        "tokens_in_pool": plan.tokens_in_pool,
        "figures": {f.key: _figure_dict(f) for f in plan.figures},
        "verdict": {
            "status": plan.verdict.status,
            "fits": plan.verdict.fits,
            "workload_fits": plan.verdict.workload_fits,
            "headline": plan.verdict.headline,
            "details": list(plan.verdict.details),
        },
        "fixes": [asdict(fix) for fix in fixes or []],
        "notes": list(plan.notes),
    }


def model_cost_to_dict(cost: ModelCost) -> dict[str, Any]:
    """A plan without a GPU: `gpu` is null and there is no pool, concurrency or verdict; `with_gpu` says what
    passing one adds."""
    request = cost.request
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "model": _model_dict(cost.spec, cost.weights.total_params),
        "gpu": None,
        "inputs": asdict(request) | {
            "max_model_len": cost.max_model_len,
            "resolved_dtype": cost.model_dtype,
            "resolved_quantization": cost.weights.quant.label,
        },
        "weights_bytes_per_gpu": cost.weights.per_gpu_bytes,
        "weights_bytes_total": cost.weights.total_bytes,
        "weights": _figure_dict(cost.weights_figure),
        "kv_cache_dtypes": [
            {
                "kv_cache_dtype": kv.kv_cache_dtype,
                "resolved_kv_cache_dtype": kv.kv.name,
                "kv_bytes_per_token": kv.per_token.value,
                "kv_bytes_per_request_at_max_model_len": kv.per_request.value,
                "kv_bytes_per_request_at_avg_context_len": kv.per_avg_request.value if kv.per_avg_request else None,
                "figures": {f.key: _figure_dict(f)
                            for f in (kv.per_token, kv.per_request, kv.per_avg_request, kv.pool_requests) if f},
            }
            for kv in cost.kv_costs
        ],
        "notes": list(cost.notes),
        "with_gpu": WITH_GPU,
    }


def _model_dict(spec: ModelSpec, params: int) -> dict[str, Any]:
    return {
        "name": spec.name,
        "source": spec.source,
        "architecture": spec.architecture,
        "num_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "attention": spec.attention_kind,
        "sliding_window": spec.sliding_window,
        "num_windowed_layers": len(spec.windowed_layers),
        "max_position_embeddings": spec.max_position_embeddings,
        "params": params,
    }


def _figure_dict(figure: Figure) -> dict[str, Any]:
    return {"label": figure.label, "value": figure.value, "text": figure.text, "formula": figure.formula}


def reference_to_dicts(rows: list[ReferenceRow]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]
