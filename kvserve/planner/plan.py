"""One capacity plan: every figure for a model on a GPU, each with the arithmetic that produced it, and the verdict.

kvserve preallocates its KV pool like vLLM, so "does not fit" has three distinct meanings, checked in order:
the weights and activation reserve exceed the budget (the model does not load); one request of
--max-model-len does not fit in the pool (startup error, as vLLM raises); or --max-num-seqs requests of
--max-model-len tokens exceed the pool (overcommitted: under full load the scheduler preempts requests and
recomputes them later; slower, but not an OOM).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.planner.activation import ActivationReserve, activation_reserve, overridden_reserve
from kvserve.planner.budget import kv_pool_bytes, memory_budget_bytes, num_blocks_for_pool
from kvserve.planner.dtypes import resolve_model_dtype
from kvserve.planner.errors import PlannerError
from kvserve.planner.gpus import GpuSpec, resolve_gpu
from kvserve.planner.kv import (
    COMPARED_KV_DTYPES,
    KVFormat,
    explain_kv_bytes_per_token,
    format_bytes_exact,
    kv_block_bytes,
    kv_bytes_per_token,
    kv_format,
    kv_key_staging_bytes,
    kv_layout,
)
from kvserve.planner.kv_groups import KVCacheLayout
from kvserve.planner.parallel import validate_parallelism
from kvserve.planner.quant import quant_from_flag
from kvserve.planner.specs import ModelSpec
from kvserve.planner.units import GiB, format_bytes, format_count
from kvserve.planner.weights import WeightEstimate, estimate_weights

# vLLM's defaults (online serving on GPUs under 70 GiB; vLLM raises them to 8192/1024 on larger non-A100 GPUs).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
DEFAULT_BLOCK_SIZE = 16
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

FITS = "fits"
OVERCOMMITTED = "overcommitted"
STARTUP_ERROR = "startup_error"
DOES_NOT_LOAD = "does_not_load"


@dataclass(slots=True, frozen=True)
class PlanRequest:
    """The inputs of a plan, named like `kvserve serve`'s (vLLM's) flags."""

    gpu: str | None = None
    gpu_memory_gib: float | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_model_len: int | None = None
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    quantization: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    avg_context_len: int | None = None
    target_concurrency: int | None = None
    activation_reserve_gib: float | None = None
    kv_cache_memory_gib: float | None = None  # a CPU server's pool (kvserve serve --kv-cache-memory), no GPU


@dataclass(slots=True, frozen=True)
class Figure:
    key: str
    label: str
    value: float
    text: str
    formula: str


@dataclass(slots=True, frozen=True)
class Verdict:
    status: str
    headline: str
    details: tuple[str, ...] = ()
    workload_fits: bool | None = None

    @property
    def fits(self) -> bool:
        return self.status == FITS and self.workload_fits is not False


@dataclass(slots=True)
class Plan:
    spec: ModelSpec
    request: PlanRequest
    gpu: GpuSpec
    model_dtype: str
    kv: KVFormat
    max_model_len: int
    target_concurrency: int
    kv_bytes_per_token: int
    block_bytes: int  # one pool block (kv.kv_block_bytes with the layout)
    layout: KVCacheLayout
    weights: WeightEstimate
    activation: ActivationReserve
    budget_bytes: int
    pool_bytes: int
    num_blocks: int
    figures: list[Figure] = field(default_factory=list)
    verdict: Verdict | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_in_pool(self) -> int:
        return self.num_blocks * self.request.block_size

    def blocks_per_request(self, context_len: int) -> int:
        """Pool blocks one request of `context_len` tokens holds (window groups: only their window's)."""
        return self.layout.blocks_per_request(context_len, self.request.block_size)

    def concurrency(self, context_len: int) -> float:
        return max(self.num_blocks, 0) / self.blocks_per_request(context_len)

    def requests_held(self, context_len: int) -> int:
        """Whole requests of `context_len` tokens the pool holds at once."""
        return max(self.num_blocks, 0) // self.blocks_per_request(context_len)

    def longest_context(self, num_seqs: int) -> int:
        """The longest context of which `num_seqs` requests fit together (0 when not even one token does)."""
        fits, too_long = 0, self.spec.max_position_embeddings + 1
        while too_long - fits > 1:  # blocks per request grow with the context: bisect
            middle = (fits + too_long) // 2
            fits, too_long = (middle, too_long) if self.requests_held(middle) >= num_seqs else (fits, middle)
        return fits

    def figure(self, key: str) -> Figure:
        return next(f for f in self.figures if f.key == key)


# What a GPU adds to a model's own figures (ModelCost): said wherever those are shown without one.
WITH_GPU = ("pass --gpu NAME (see --list-gpus) or --gpu-memory GIB to add the KV pool left after weights and the "
            "activation reserve, how many requests fit at once (at max-model-len, and at --avg-context-len), and "
            "whether --max-num-seqs of them fit (the verdict, and what to change when they do not)")


@dataclass(slots=True, frozen=True)
class KVCost:
    """What the KV cache of this model costs in one --kv-cache-dtype, whatever the GPU."""

    kv_cache_dtype: str  # as the flag takes it ("auto", "fp8", ...)
    kv: KVFormat
    per_token: Figure
    per_request: Figure  # one request at --max-model-len
    per_avg_request: Figure | None  # one request at --avg-context-len, when given
    pool_requests: Figure | None = None  # requests a --kv-cache-memory pool holds at avg-context-len (or max-model-len)


@dataclass(slots=True)
class ModelCost:
    """A plan without a GPU: the model's own figures (weights, and KV per token and per request in each KV dtype),
    the same figures a plan shows, before a GPU's memory turns them into a pool, a concurrency and a verdict."""

    spec: ModelSpec
    request: PlanRequest
    model_dtype: str
    max_model_len: int
    weights: WeightEstimate
    weights_figure: Figure
    kv_costs: list[KVCost]
    notes: list[str] = field(default_factory=list)


def model_cost(spec: ModelSpec, request: PlanRequest) -> ModelCost:
    """The model dtype's KV, fp8, int8 and int4 (and --kv-cache-dtype, if it is none of those)."""
    _validate_request(spec, request)
    model_dtype = resolve_model_dtype(request.dtype, spec.dtype)
    max_model_len = _resolve_max_model_len(spec, request.max_model_len)
    weights = estimate_weights(spec, model_dtype, quant_from_flag(request.quantization),
                               request.tensor_parallel_size, request.pipeline_parallel_size)
    dtypes = list(COMPARED_KV_DTYPES)
    compared = {kv_format(dtype, model_dtype) for dtype in dtypes}
    if kv_format(request.kv_cache_dtype, model_dtype) not in compared:
        dtypes.append(request.kv_cache_dtype)
    costs = [_kv_cost(spec, request, dtype, model_dtype, max_model_len) for dtype in dtypes]
    return ModelCost(spec, request, model_dtype, max_model_len, weights, _weights_figure(weights), costs,
                     _notes(spec, request))


def _kv_cost(spec: ModelSpec, request: PlanRequest, kv_cache_dtype: str, model_dtype: str,
             max_model_len: int) -> KVCost:
    tp, pp, bs = request.tensor_parallel_size, request.pipeline_parallel_size, request.block_size
    per_token = kv_bytes_per_token(spec, kv_cache_dtype, model_dtype, tp, pp, bs)
    layout = kv_layout(spec, pp)
    block_bytes = kv_block_bytes(spec, bs, kv_cache_dtype, model_dtype, tp, pp, layout)
    fmt = kv_format(kv_cache_dtype, model_dtype)
    avg = request.avg_context_len
    pool = None
    if request.kv_cache_memory_gib:
        staging = kv_key_staging_bytes(spec, bs, request.max_num_seqs, kv_cache_dtype, model_dtype, tp, pp)
        pool = _cpu_pool_figure(request.kv_cache_memory_gib, staging, block_bytes, layout, avg or max_model_len, bs)
    return KVCost(
        kv_cache_dtype, fmt, _per_token_figure(spec, fmt, per_token, tp, pp),
        _request_figure("kv_per_request", "max-model-len", max_model_len, layout.blocks_per_request(max_model_len, bs),
                        block_bytes),
        _request_figure("kv_per_avg_request", "avg-context-len", avg, layout.blocks_per_request(avg, bs), block_bytes)
        if avg else None,
        pool,
    )


def _cpu_pool_figure(gib: float, staging_bytes: int, block_bytes: int, layout: KVCacheLayout, context_len: int,
                     block_size: int) -> Figure:
    """What the CPU engine does with --kv-cache-memory (engine/pool_sizing.py): whole blocks of the pool less int4's
    key staging, and the requests of `context_len` tokens they hold."""
    num_blocks = num_blocks_for_pool(int(gib * GiB) - staging_bytes, block_bytes)
    per_request = layout.blocks_per_request(context_len, block_size)
    value = num_blocks / per_request
    return Figure("cpu_pool_requests", f"Requests at {context_len:,} in {gib:g} GiB", value, f"{value:,.2f}",
                  f"{num_blocks:,} blocks ÷ {per_request:,} blocks per request = {value:,.2f}")


def make_plan(spec: ModelSpec, request: PlanRequest) -> Plan:
    _validate_request(spec, request)
    gpu = resolve_gpu(request.gpu, request.gpu_memory_gib)
    model_dtype = resolve_model_dtype(request.dtype, spec.dtype)
    fmt = kv_format(request.kv_cache_dtype, model_dtype)
    tp, pp = request.tensor_parallel_size, request.pipeline_parallel_size
    max_model_len = _resolve_max_model_len(spec, request.max_model_len)
    per_token = kv_bytes_per_token(spec, request.kv_cache_dtype, model_dtype, tp, pp, request.block_size)
    layout = kv_layout(spec, pp)
    block_bytes = kv_block_bytes(spec, request.block_size, request.kv_cache_dtype, model_dtype, tp, pp, layout)
    weights = estimate_weights(spec, model_dtype, quant_from_flag(request.quantization), tp, pp)
    reserve = _activation(spec, request, model_dtype)
    budget = memory_budget_bytes(gpu.memory_bytes, request.gpu_memory_utilization)
    pool = kv_pool_bytes(gpu.memory_bytes, request.gpu_memory_utilization, weights.per_gpu_bytes, reserve.bytes)
    pool -= kv_key_staging_bytes(spec, request.block_size, request.max_num_seqs, request.kv_cache_dtype, model_dtype,
                                 tp, pp)
    plan = Plan(
        spec=spec,
        request=request,
        gpu=gpu,
        model_dtype=model_dtype,
        kv=fmt,
        max_model_len=max_model_len,
        target_concurrency=request.target_concurrency or request.max_num_seqs,
        kv_bytes_per_token=per_token,
        block_bytes=block_bytes,
        layout=layout,
        weights=weights,
        activation=reserve,
        budget_bytes=budget,
        pool_bytes=pool,
        num_blocks=num_blocks_for_pool(pool, block_bytes),
    )
    plan.figures = _figures(plan)
    plan.verdict = _verdict(plan)
    plan.notes = _notes(spec, request)
    return plan


def _validate_request(spec: ModelSpec, request: PlanRequest) -> None:
    sizes = {
        "--max-num-seqs": request.max_num_seqs,
        "--max-num-batched-tokens": request.max_num_batched_tokens,
        "--block-size": request.block_size,
        "--max-model-len": request.max_model_len,
        "--avg-context-len": request.avg_context_len,
        "--target-concurrency": request.target_concurrency,
    }
    for flag, value in sizes.items():
        if value is not None and value <= 0:
            raise PlannerError(f"{flag} must be positive, got {value}")
    if request.activation_reserve_gib is not None and request.activation_reserve_gib < 0:
        raise PlannerError(f"--activation-reserve-gib must be >= 0, got {request.activation_reserve_gib}")
    if not 0 < request.gpu_memory_utilization <= 1:
        raise PlannerError(f"--gpu-memory-utilization must be in (0, 1], got {request.gpu_memory_utilization}")
    validate_parallelism(spec, request.tensor_parallel_size, request.pipeline_parallel_size)
    max_len = _resolve_max_model_len(spec, request.max_model_len)
    if request.avg_context_len is not None and request.avg_context_len > max_len:
        raise PlannerError(f"--avg-context-len {request.avg_context_len} exceeds --max-model-len {max_len}")


def _resolve_max_model_len(spec: ModelSpec, max_model_len: int | None) -> int:
    if max_model_len is None:
        return spec.max_position_embeddings
    if max_model_len > spec.max_position_embeddings:
        raise PlannerError(
            f"--max-model-len {max_model_len} exceeds {spec.name}'s max_position_embeddings "
            f"{spec.max_position_embeddings} (vLLM refuses this too)"
        )
    return max_model_len


def _activation(spec: ModelSpec, request: PlanRequest, model_dtype: str) -> ActivationReserve:
    if request.activation_reserve_gib is not None:
        return overridden_reserve(request.activation_reserve_gib)
    return activation_reserve(
        spec,
        model_dtype,
        request.max_num_batched_tokens,
        request.max_num_seqs,
        request.tensor_parallel_size,
        request.pipeline_parallel_size,
    )


def _figures(plan: Plan) -> list[Figure]:
    request, bs = plan.request, plan.request.block_size
    per_token_text = format_bytes_exact(plan.kv_bytes_per_token)
    figures = [
        _per_token_figure(plan.spec, plan.kv, plan.kv_bytes_per_token, request.tensor_parallel_size,
                          request.pipeline_parallel_size),
        _block_figure(plan, per_token_text),
        _request_figure("kv_per_request", "max-model-len", plan.max_model_len,
                        plan.blocks_per_request(plan.max_model_len), plan.block_bytes),
        Figure("gpu_memory", f"GPU memory ({plan.gpu.name})", plan.gpu.memory_bytes,
               format_bytes(plan.gpu.memory_bytes), f"{plan.gpu.nominal}, as CUDA reports it"),
        Figure("budget", "Memory budget", plan.budget_bytes, format_bytes(plan.budget_bytes),
               f"{request.gpu_memory_utilization:g} (--gpu-memory-utilization) × "
               f"{format_bytes(plan.gpu.memory_bytes)} = {format_bytes(plan.budget_bytes)}"),
        _weights_figure(plan.weights),
        Figure("activation", "Activation & graph reserve", plan.activation.bytes,
               format_bytes(plan.activation.bytes), plan.activation.formula),
        Figure("kv_pool", "KV pool per GPU", plan.pool_bytes, format_bytes(plan.pool_bytes),
               f"{format_bytes(plan.budget_bytes)} − {format_bytes(plan.weights.per_gpu_bytes)} − "
               f"{format_bytes(plan.activation.bytes)} = {format_bytes(plan.pool_bytes)}"),
        Figure("num_blocks", "KV blocks", plan.num_blocks, format_count(plan.num_blocks),
               f"⌊{format_bytes(max(plan.pool_bytes, 0))} ÷ {format_bytes(plan.block_bytes)}⌋ = "
               f"{plan.num_blocks:,} blocks"),
        Figure("tokens_in_pool", "Tokens in the pool", plan.tokens_in_pool, f"{plan.tokens_in_pool:,}",
               f"{plan.num_blocks:,} blocks × {bs} = {plan.tokens_in_pool:,} tokens"),
        _concurrency_figure(plan, "concurrency_at_max_model_len", "max-model-len", plan.max_model_len),
    ]
    if request.avg_context_len:
        figures.append(_concurrency_figure(plan, "concurrency_at_avg_context_len", "avg-context-len",
                                           request.avg_context_len))
    figures.append(_demand_figure(plan, "worst_case_demand", "max-num-seqs × max-model-len",
                                  request.max_num_seqs, plan.max_model_len))
    if request.avg_context_len:
        figures.append(_demand_figure(plan, "workload_demand", "target-concurrency × avg-context-len",
                                      plan.target_concurrency, request.avg_context_len))
    return figures


def _per_token_figure(spec: ModelSpec, fmt: KVFormat, per_token: int, tensor_parallel_size: int,
                      pipeline_parallel_size: int) -> Figure:
    return Figure("kv_bytes_per_token", "KV cache per token (per GPU)", per_token, format_bytes_exact(per_token),
                  explain_kv_bytes_per_token(spec, fmt, tensor_parallel_size, pipeline_parallel_size))


def _weights_figure(weights: WeightEstimate) -> Figure:
    return Figure("weights", "Weights per GPU", weights.per_gpu_bytes, format_bytes(weights.per_gpu_bytes),
                  weights.formula)


def _block_figure(plan: Plan, per_token_text: str) -> Figure:
    bs, layout = plan.request.block_size, plan.layout
    formula = f"{bs} tokens × {per_token_text} = {format_bytes(plan.block_bytes)}"
    if layout.is_hybrid:
        formula = (f"{bs} tokens of one group's {layout.num_slots} layers (of {len(layout.groups)} groups: full "
                   f"attention and sliding windows, one block table each) = {format_bytes(plan.block_bytes)}")
    return Figure("kv_block_bytes", f"KV block of {bs} tokens", plan.block_bytes, format_bytes(plan.block_bytes),
                  formula)


def _request_figure(key: str, flag: str, context_len: int, blocks: int, block_bytes: int) -> Figure:
    """One request's KV in whole blocks, as the pool allocates it."""
    request_bytes = blocks * block_bytes
    return Figure(key, f"One request at {flag} {context_len:,}", request_bytes, format_bytes(request_bytes),
                  f"{blocks:,} blocks × {format_bytes(block_bytes)} = {format_bytes(request_bytes)}")


def _concurrency_figure(plan: Plan, key: str, flag: str, context_len: int) -> Figure:
    blocks = plan.blocks_per_request(context_len)
    value = plan.concurrency(context_len)
    return Figure(key, f"Requests in the pool at {flag} {context_len:,}", value, f"{value:,.1f}",
                  f"{plan.num_blocks:,} blocks ÷ {blocks:,} blocks per request = {value:,.2f}")


def _demand_figure(plan: Plan, key: str, label: str, num_seqs: int, context_len: int) -> Figure:
    blocks = num_seqs * plan.blocks_per_request(context_len)
    demand = blocks * plan.block_bytes
    pool = max(plan.pool_bytes, 0)
    ratio = f"{demand / pool:.1f}× the pool" if pool else "no pool"
    per_request = f"{context_len:,} tokens × {format_bytes_exact(plan.kv_bytes_per_token)}"
    if plan.layout.is_hybrid or plan.spec.has_windowed_layers:
        per_request = f"{plan.blocks_per_request(context_len):,} blocks × {format_bytes(plan.block_bytes)}"
    return Figure(key, label, demand, format_bytes(demand), f"{num_seqs:,} × {per_request} = {format_bytes(demand)} ({ratio})")


def _verdict(plan: Plan) -> Verdict:
    request = plan.request
    workload = _workload_check(plan)
    cannot_serve = False if request.avg_context_len else None
    if plan.pool_bytes <= 0:
        short = -plan.pool_bytes
        return Verdict(DOES_NOT_LOAD, f"DOES NOT LOAD: weights + activation reserve exceed the budget by "
                       f"{format_bytes(short)}", (), cannot_serve)
    one_request = plan.blocks_per_request(plan.max_model_len)
    if plan.num_blocks < one_request:
        return Verdict(STARTUP_ERROR, f"FAILS AT STARTUP: one {plan.max_model_len:,}-token request needs "
                       f"{format_bytes(one_request * plan.block_bytes)} of KV, the pool holds "
                       f"{format_bytes(plan.num_blocks * plan.block_bytes)} (vLLM refuses to start)", (), cannot_serve)
    worst_blocks = request.max_num_seqs * one_request
    details = (workload[1],) if workload[1] else ()
    if worst_blocks <= plan.num_blocks:
        return Verdict(FITS, f"FITS: {request.max_num_seqs} × {plan.max_model_len:,} tokens "
                       f"({format_bytes(worst_blocks * plan.block_bytes)}) fit in the "
                       f"{format_bytes(plan.pool_bytes)} pool; no preemption even at full load", details, workload[0])
    full_length = plan.concurrency(plan.max_model_len)
    return Verdict(OVERCOMMITTED, f"OVERCOMMITTED {worst_blocks / plan.num_blocks:.1f}×: {request.max_num_seqs} × "
                   f"{plan.max_model_len:,} tokens need {format_bytes(worst_blocks * plan.block_bytes)}, the pool "
                   f"holds {format_bytes(plan.pool_bytes)}. Beyond {full_length:.1f} full-length requests the "
                   f"scheduler preempts and recomputes (slower, not an OOM: the pool is preallocated)",
                   details, workload[0])


def _workload_check(plan: Plan) -> tuple[bool | None, str]:
    avg = plan.request.avg_context_len
    if not avg:
        return None, ""
    fits_now = plan.concurrency(avg)
    target = plan.target_concurrency
    if fits_now >= target:
        return True, (f"Workload fits: {target} concurrent {avg:,}-token requests need "
                      f"{target / fits_now:.0%} of the pool (room for {fits_now:.1f})")
    return False, (f"Workload does NOT fit: {target} concurrent {avg:,}-token requests need "
                   f"{target / fits_now if fits_now else float('inf'):.1f}× the pool; it holds {fits_now:.1f}")


def _notes(spec: ModelSpec, request: PlanRequest) -> list[str]:
    notes = []
    if spec.has_windowed_layers:
        notes.append(f"{len(spec.windowed_layers)} of {spec.num_layers} layers use a {spec.sliding_window:,}-token "
                     "sliding window: their blocks hold only the window's tokens (blocks out of it are freed), so a "
                     "request's KV is less than its tokens × the per-token figure")
    if spec.is_mla and request.tensor_parallel_size > 1:
        notes.append("MLA's latent KV is replicated on every TP rank: TP does not shrink KV bytes per token")
    if not spec.is_mla and spec.num_kv_heads < request.tensor_parallel_size:
        notes.append(f"{spec.num_kv_heads} KV heads < TP {request.tensor_parallel_size}: KV heads are "
                     "replicated, one per GPU")
    if spec.quantization_note:
        notes.append(spec.quantization_note)
    if spec.extra_params:
        notes.append(f"weights include a {spec.extra_params_note}")
    if spec.num_mtp_layers:
        notes.append(f"{spec.num_mtp_layers} multi-token-prediction layer(s) not counted: loaded only for "
                     "speculative decoding")
    return notes
