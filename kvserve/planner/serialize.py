"""`kvserve plan --json`: plans as plain dicts, every byte figure exact (integers), with its arithmetic."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvserve.planner.advice import Fix
from kvserve.planner.compare import ReferenceRow
from kvserve.planner.plan import Plan

JSON_SCHEMA_VERSION = 1


def plan_to_dict(plan: Plan, fixes: list[Fix] | None = None) -> dict[str, Any]:
    spec, request = plan.spec, plan.request
    return {
        "schema_version": JSON_SCHEMA_VERSION,
        "model": {
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
            "params": plan.weights.total_params,
        },
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
        "figures": {f.key: {"label": f.label, "value": f.value, "text": f.text, "formula": f.formula}
                    for f in plan.figures},
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


def reference_to_dicts(rows: list[ReferenceRow]) -> list[dict[str, Any]]:
    return [asdict(row) for row in rows]
