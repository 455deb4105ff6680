"""Concrete fixes when a plan does not fit: each one a flag change, re-planned with the same arithmetic."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvserve.planner.errors import PlannerError
from kvserve.planner.gpus import GPU_CATALOG
from kvserve.planner.parallel import valid_tp_sizes
from kvserve.planner.plan import DOES_NOT_LOAD, FITS, OVERCOMMITTED, STARTUP_ERROR, Plan, make_plan
from kvserve.planner.units import format_bytes

_KV_DTYPE_FIXES = ("fp8", "int4")
_QUANT_FIXES = ("fp8", "awq")
_MAX_TP = 8
# Below this a --max-model-len "fix" would technically fit but serve nothing useful.
_SHORTEST_USEFUL_MAX_MODEL_LEN = 512


@dataclass(slots=True, frozen=True)
class Fix:
    """One flag change. `fits`: whether it solves the failing check (the workload when that is what failed,
    otherwise the --max-num-seqs × --max-model-len worst case)."""

    change: str
    effect: str
    fits: bool


def suggest_fixes(plan: Plan) -> list[Fix]:
    """Nothing when the plan fits; otherwise the flag changes that would make it fit, and what each buys."""
    if plan.verdict is None or plan.verdict.fits:
        return []
    if plan.verdict.status == DOES_NOT_LOAD:
        return _loading_fixes(plan)
    fixes = _limit_fixes(plan)
    kv_fixes = [fix for dtype in _KV_DTYPE_FIXES if (fix := _replan_fix(plan, f"--kv-cache-dtype {dtype}",
                                                                         kv_cache_dtype=dtype))]
    fixes += kv_fixes
    tp = _next_tensor_parallel_size(plan)
    tp_fix = _replan_fix(plan, f"--tensor-parallel-size {tp}", tensor_parallel_size=tp) if tp else None
    if tp_fix:
        fixes.append(tp_fix)
    if tp_fix and not tp_fix.fits and not any(fix.fits for fix in kv_fixes[:1]):
        # Neither fp8 KV nor more GPUs alone is enough: say whether both together are.
        fixes.append(_replan_fix(plan, f"--kv-cache-dtype fp8 --tensor-parallel-size {tp}", kv_cache_dtype="fp8",
                                 tensor_parallel_size=tp))
    return [fix for fix in fixes if fix] + _gpu_fixes(plan)


def _solves(candidate: Plan, original: Plan) -> bool:
    """Does `candidate` pass the check that `original` failed? The workload when that failed; else loading and
    starting when those failed; else the --max-num-seqs × --max-model-len worst case."""
    runs = candidate.verdict.status in (FITS, OVERCOMMITTED)
    if original.verdict.workload_fits is False:
        return runs and candidate.verdict.workload_fits is True
    if original.verdict.status in (DOES_NOT_LOAD, STARTUP_ERROR):
        return runs
    return candidate.verdict.fits


def _limit_fixes(plan: Plan) -> list[Fix]:
    """Shrink the limits to what this pool holds: the largest --max-model-len and --max-num-seqs that fit."""
    request, fixes = plan.request, []
    if plan.verdict.status == STARTUP_ERROR:
        longest = plan.longest_context(1)
        if longest >= request.block_size:
            fixes.append(Fix(f"--max-model-len {longest}", "the longest request this pool holds: the server starts, "
                             "one request at a time at that length", plan.verdict.workload_fits is not False))
    solves_worst_case = plan.verdict.workload_fits is not False
    if plan.verdict.status != FITS:
        max_len = min(plan.longest_context(request.max_num_seqs), plan.max_model_len)
        if max_len >= _SHORTEST_USEFUL_MAX_MODEL_LEN:
            effect = f"{request.max_num_seqs} × {max_len:,} tokens fit; longer prompts are rejected"
            fixes.append(Fix(f"--max-model-len {max_len}", effect, solves_worst_case))
        seqs = plan.requests_held(plan.max_model_len)
        if seqs >= 1:
            fixes.append(Fix(f"--max-num-seqs {seqs}",
                             f"{seqs} × {plan.max_model_len:,} tokens fit; more requests queue instead of "
                             "being preempted", solves_worst_case))
    if plan.verdict.workload_fits is False and plan.num_blocks:
        avg = request.avg_context_len
        seqs_at_avg = plan.requests_held(avg)
        if seqs_at_avg >= 1:
            fixes.append(Fix(f"--max-num-seqs {seqs_at_avg}",
                             f"what this pool holds at {avg:,} tokens: {seqs_at_avg} of the "
                             f"{plan.target_concurrency} requests run, the rest queue", False))
    return fixes


def _replan_fix(plan: Plan, change: str, **overrides: object) -> Fix | None:
    request = replace(plan.request, **overrides)
    if request == plan.request:
        return None
    try:
        candidate = make_plan(plan.spec, request)
    except PlannerError as exc:
        return Fix(change, f"not possible: {exc}", False)
    return Fix(change, _summary(candidate), _solves(candidate, plan))


def _summary(plan: Plan) -> str:
    if plan.pool_bytes <= 0:
        return f"still does not load ({plan.verdict.headline.split(': ', 1)[-1]})"
    held = f"{plan.num_blocks:,} blocks" if plan.layout.is_hybrid else f"{plan.tokens_in_pool:,} tokens"
    parts = [f"pool {format_bytes(plan.pool_bytes)} = {held}",
             f"{plan.concurrency(plan.max_model_len):.1f} requests at {plan.max_model_len:,}"]
    if plan.request.avg_context_len:
        parts.append(f"{plan.concurrency(plan.request.avg_context_len):.1f} at {plan.request.avg_context_len:,}")
    worst = plan.verdict.status.replace("_", " ")
    if plan.verdict.workload_fits is None:
        return f"{'; '.join(parts)} → {worst}"
    workload = "workload fits" if plan.verdict.workload_fits else "workload does not fit"
    return f"{'; '.join(parts)} → {workload}; worst case {worst}"


def _next_tensor_parallel_size(plan: Plan) -> int | None:
    """The next valid TP size (usually double), up to 8 GPUs."""
    tp = plan.request.tensor_parallel_size
    return next((size for size in valid_tp_sizes(plan.spec, _MAX_TP) if size > tp), None)


def _gpu_fixes(plan: Plan) -> list[Fix]:
    """The smallest catalog GPU (at the current TP) on which the plan fits."""
    tp = plan.request.tensor_parallel_size
    for gpu in sorted(GPU_CATALOG, key=lambda g: g.memory_bytes):
        if gpu.memory_bytes <= plan.gpu.memory_bytes:
            continue
        candidate = make_plan(plan.spec, replace(plan.request, gpu=gpu.name, gpu_memory_gib=None))
        if _solves(candidate, plan):
            return [Fix(f"--gpu {gpu.name}", f"smallest catalog GPU that fits at TP {tp}: {_summary(candidate)}",
                        True)]
    return [Fix("--gpu (larger)", f"no catalog GPU fits this at TP {tp}; combine the changes above", False)]


def _loading_fixes(plan: Plan) -> list[Fix]:
    fixes = [fix for method in _QUANT_FIXES
             if plan.weights.quant.method == "none"
             and (fix := _replan_fix(plan, f"--quantization {method}", quantization=method))]
    tp = plan.request.tensor_parallel_size
    for size in valid_tp_sizes(plan.spec, _MAX_TP):
        if size <= tp:
            continue
        candidate = make_plan(plan.spec, replace(plan.request, tensor_parallel_size=size))
        if candidate.pool_bytes > 0:
            fixes.append(Fix(f"--tensor-parallel-size {size}", f"smallest TP that loads: {_summary(candidate)}",
                             _solves(candidate, plan)))
            break
    return fixes + _gpu_fixes(plan)
