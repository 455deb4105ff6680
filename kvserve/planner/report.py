"""Rich rendering of plans, comparisons and the reference table. Formatting only: every number comes from plan.py."""

from __future__ import annotations

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table

from kvserve.planner.activation import ActivationReserve
from kvserve.planner.advice import Fix
from kvserve.planner.compare import ReferenceRow
from kvserve.planner.gpus import GPU_CATALOG
from kvserve.planner.kv import format_bytes_exact
from kvserve.planner.plan import DOES_NOT_LOAD, FITS, OVERCOMMITTED, WITH_GPU, ModelCost, Plan, PlanRequest
from kvserve.planner.units import format_bytes, format_params

_VERDICT_STYLE = {FITS: "green", OVERCOMMITTED: "yellow", DOES_NOT_LOAD: "red"}


def render_plan(console: Console, plan: Plan, fixes: list[Fix]) -> None:
    console.print(_title(plan))
    table = Table(show_header=True, header_style="bold", expand=False)
    table.add_column("Figure", style="cyan", no_wrap=True)
    table.add_column("Value", justify="right", no_wrap=True)
    table.add_column("Arithmetic", overflow="fold")
    for figure in plan.figures:
        table.add_row(figure.label, figure.text, figure.formula)
    console.print(table)
    _render_verdict(console, plan)
    if fixes:
        _render_fixes(console, fixes)
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/dim]")
    if not plan.activation.overridden:
        console.print(f"[dim]note: {_reserve_note(plan.activation)}[/dim]")


def render_model_cost(console: Console, cost: ModelCost) -> None:
    """No GPU given: the model's own figures, one row per KV dtype, then what a GPU would add."""
    request, spec = cost.request, cost.spec
    console.print(
        f"[bold]{spec.name}[/bold] ({_parallel_text(request)}) · dtype {cost.model_dtype} · "
        f"weights {cost.weights.quant.label} · block {request.block_size} · max-model-len {cost.max_model_len:,}\n"
        f"[dim]source: {spec.source}; weights from {cost.weights.source}[/dim]"
    )
    weights = Table(show_header=True, header_style="bold", expand=False)
    weights.add_column("Figure", style="cyan", no_wrap=True)
    weights.add_column("Value", justify="right", no_wrap=True)
    weights.add_column("Arithmetic", overflow="fold")
    weights.add_row(cost.weights_figure.label, cost.weights_figure.text, cost.weights_figure.formula)
    console.print(weights)
    console.print(_kv_cost_table(cost))
    for note in cost.notes:
        console.print(f"[dim]note: {note}[/dim]")
    console.print(f"No GPU given: {WITH_GPU}.")


def _kv_cost_table(cost: ModelCost) -> Table:
    first = cost.kv_costs[0]
    table = Table(title="KV cache by --kv-cache-dtype (per GPU)", show_header=True, header_style="bold",
                  expand=False)
    table.add_column("KV dtype", style="cyan", no_wrap=True)
    table.add_column("KV/token", justify="right", no_wrap=True)
    table.add_column(first.per_request.label, justify="right", no_wrap=True)
    if first.per_avg_request is not None:
        table.add_column(first.per_avg_request.label, justify="right", no_wrap=True)
    if first.pool_requests is not None:
        table.add_column(first.pool_requests.label, justify="right", no_wrap=True)
    table.add_column("Arithmetic (per token)", overflow="fold")
    for kv in cost.kv_costs:
        name = kv.kv.name if kv.kv_cache_dtype == kv.kv.name else f"{kv.kv_cache_dtype} ({kv.kv.name})"
        row = [name, kv.per_token.text, kv.per_request.text]
        if kv.per_avg_request is not None:
            row.append(kv.per_avg_request.text)
        if kv.pool_requests is not None:
            row.append(kv.pool_requests.text)
        formula = kv.per_token.formula
        if kv.pool_requests is not None:
            formula += f"; pool: {kv.pool_requests.formula}"
        table.add_row(*row, formula)
    return table


def _parallel_text(request: PlanRequest) -> str:
    return f"TP {request.tensor_parallel_size}" + (
        f" × PP {request.pipeline_parallel_size}" if request.pipeline_parallel_size > 1 else "")


def _title(plan: Plan) -> str:
    request, spec = plan.request, plan.spec
    quant = plan.weights.quant.label
    return (
        f"[bold]{spec.name}[/bold] on [bold]{plan.gpu.name}[/bold] ({_parallel_text(request)}) · dtype {plan.model_dtype} · "
        f"KV {plan.kv.name} · weights {quant} · block {request.block_size} · "
        f"max-model-len {plan.max_model_len:,} · max-num-seqs {request.max_num_seqs}\n"
        f"[dim]source: {spec.source}; weights from {plan.weights.source}[/dim]"
    )


def _reserve_note(reserve: ActivationReserve) -> str:
    return ("the activation reserve is a heuristic (kvserve/planner/activation.py); pass the engine's measured "
            "figure with --activation-reserve-gib")


def _render_verdict(console: Console, plan: Plan) -> None:
    verdict = plan.verdict
    style = _VERDICT_STYLE.get(verdict.status, "red")
    lines = [f"[bold {style}]{verdict.headline}[/bold {style}]"]
    for detail in verdict.details:
        detail_style = "green" if verdict.workload_fits else "red"
        lines.append(f"[{detail_style}]{detail}[/{detail_style}]")
    console.print(Panel("\n".join(lines), title="OOM pre-check", expand=False))


def _render_fixes(console: Console, fixes: list[Fix]) -> None:
    table = Table(title="What to change", show_header=True, header_style="bold", expand=False)
    table.add_column("Change", style="cyan", no_wrap=True)
    table.add_column("Effect", overflow="fold")
    table.add_column("Solves it", justify="center")
    for fix in fixes:
        table.add_row(fix.change, fix.effect, "[green]yes[/green]" if fix.fits else "[red]no[/red]")
    console.print(table)


def verdict_label(plan: Plan) -> str:
    status, workload = plan.verdict.status, plan.verdict.workload_fits
    label = status.replace("_", " ")
    if status == OVERCOMMITTED:
        demand = plan.request.max_num_seqs * plan.max_model_len
        label = f"overcommitted {demand / max(plan.tokens_in_pool, 1):.1f}×"
    if status in (FITS, OVERCOMMITTED) and workload is not None:
        label += " · workload fits" if workload else " · workload does not fit"
    return label


def _comparison_table(title: str, first_column: str, plan: Plan) -> Table:
    table = Table(title=title, show_header=True, header_style="bold", expand=False)
    table.add_column(first_column, style="cyan", no_wrap=True)
    for name in ("KV/token", "Weights/GPU", "KV pool", "Tokens", f"@ {plan.max_model_len:,}"):
        table.add_column(name, justify="right")
    if plan.request.avg_context_len:
        table.add_column(f"@ {plan.request.avg_context_len:,}", justify="right")
    table.add_column("Verdict")
    return table


def _comparison_row(label: str, plan: Plan) -> list[str]:
    row = [label, format_bytes_exact(plan.kv_bytes_per_token), format_bytes(plan.weights.per_gpu_bytes),
           format_bytes(plan.pool_bytes), f"{plan.tokens_in_pool:,}", f"{plan.concurrency(plan.max_model_len):.1f}"]
    if plan.request.avg_context_len:
        row.append(f"{plan.concurrency(plan.request.avg_context_len):.1f}")
    style = "green" if plan.verdict.fits else "yellow" if plan.verdict.status in (FITS, OVERCOMMITTED) else "red"
    row.append(f"[{style}]{verdict_label(plan)}[/{style}]")
    return row


def render_gpu_comparison(console: Console, plans: list[Plan]) -> None:
    first = plans[0]
    title = (f"{first.spec.name} across the GPU catalog · TP {first.request.tensor_parallel_size} · "
             f"KV {first.kv.name} · requests in the pool at each context length")
    table = _comparison_table(title, "GPU", first)
    for plan in plans:
        table.add_row(*_comparison_row(f"{plan.gpu.name} ({plan.gpu.memory_gib:.1f} GiB)", plan))
    console.print(table)


def render_kv_comparison(console: Console, plans: list[Plan]) -> None:
    first = plans[0]
    title = f"{first.spec.name} on {first.gpu.name} · TP {first.request.tensor_parallel_size} · by --kv-cache-dtype"
    table = _comparison_table(title, "KV dtype", first)
    for plan in plans:
        table.add_row(*_comparison_row(plan.kv.name, plan))
    console.print(table)


def render_reference(console: Console, rows: list[ReferenceRow]) -> None:
    table = Table(title="KV cache per request (TP 1; every layer at full length, except the Windowed column)",
                  box=box.SIMPLE_HEAVY, header_style="bold", pad_edge=False)
    for name in ("Model", "Params", "Layers", "Attention", "Window", "KV/token bf16", "KV/token fp8", "Context",
                 "At ctx bf16", "At ctx fp8", "Windowed bf16"):
        table.add_column(name, justify="left" if name in ("Model", "Attention", "Window") else "right", no_wrap=True)
    for row in rows:
        windowed = format_bytes(row.kv_16bit_windowed_at_context) if row.kv_16bit_windowed_at_context else "—"
        table.add_row(row.repo_id, format_params(row.params), str(row.layers), row.attention, row.window,
                      format_bytes(row.kv_16bit_per_token), format_bytes(row.kv_fp8_per_token),
                      f"{row.context_len:,}", format_bytes(row.kv_16bit_at_context),
                      format_bytes(row.kv_fp8_at_context), windowed)
    _print_unclipped(console, table)


def _print_unclipped(console: Console, table: Table) -> None:
    """Wide reference tables print at their natural width rather than truncating numbers to the terminal."""
    natural = Measurement.get(console, console.options.update(max_width=10_000), table).maximum
    width = console.width
    console.width = max(width, natural)
    try:
        console.print(table)
    finally:
        console.width = width


def render_gpu_catalog(console: Console) -> None:
    table = Table(title="GPU catalog (memory as CUDA reports it)", show_header=True, header_style="bold")
    table.add_column("--gpu", style="cyan")
    table.add_column("Memory", justify="right")
    table.add_column("Nominal")
    table.add_column("Also accepted")
    for gpu in GPU_CATALOG:
        table.add_row(gpu.name, f"{gpu.memory_gib:.2f} GiB", gpu.nominal, ", ".join(gpu.aliases))
    console.print(table)
