"""`kvserve plan`: capacity planning with `kvserve serve`'s (vLLM's) flag names. Pure arithmetic, no torch."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console

from kvserve.planner.advice import suggest_fixes
from kvserve.planner.compare import compare_gpus, compare_kv_dtypes, reference_rows
from kvserve.planner.deployment.emit import check_deployable, emit_config
from kvserve.planner.dtypes import MODEL_DTYPE_CHOICES
from kvserve.planner.errors import PlannerError
from kvserve.planner.kv import KV_CACHE_DTYPES
from kvserve.planner.plan import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    PlanRequest,
    make_plan,
    model_cost,
)
from kvserve.planner.quant import QUANTIZATION_CHOICES
from kvserve.planner.report import (
    render_gpu_catalog,
    render_gpu_comparison,
    render_kv_comparison,
    render_model_cost,
    render_plan,
    render_reference,
)
from kvserve.planner.serialize import model_cost_to_dict, plan_to_dict, reference_to_dicts
from kvserve.planner.spec_loader import load_spec
from kvserve.planner.specs import ModelSpec
from kvserve.planner.units import parse_token_count

# Piped output (files, CI logs) gets a wide fixed width so the arithmetic column does not wrap into noise.
_PIPED_CONSOLE_WIDTH = 160


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("model and hardware")
    model.add_argument("--model", help="registry id (Qwen/Qwen2.5-14B-Instruct), local HF folder, config.json or .gguf")
    model.add_argument("--gpu", help="catalog GPU (A100-80GB, H100, L4, ...; see --list-gpus); without --gpu and "
                                     "--gpu-memory: the model's own figures (weights, KV per token and per request)")
    model.add_argument("--gpu-memory", type=float, metavar="GIB", help="memory per GPU in GiB, for any other card")
    model.add_argument("--kv-cache-memory", type=float, metavar="GIB",
                       help="without a GPU: the KV pool of a CPU server (kvserve serve's flag), adding each KV "
                            "dtype's requests it holds")
    model.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    model.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N")
    model.add_argument("--dtype", default="auto", choices=MODEL_DTYPE_CHOICES,
                       help="model dtype; auto follows the checkpoint (float32 checkpoints run in bfloat16)")
    model.add_argument("--quantization", "-q", choices=QUANTIZATION_CHOICES,
                       help="weight quantization (default: whatever the checkpoint is)")

    engine = parser.add_argument_group("engine limits (as `kvserve serve` / vLLM)")
    engine.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION,
                        metavar="FRACTION", help="share of total GPU memory the engine may use (default %(default)s)")
    engine.add_argument("--max-model-len", metavar="TOKENS",
                        help="default: the model's max_position_embeddings; 32768, 32k (x1000) or 32K (x1024)")
    engine.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS, metavar="N",
                        help="default %(default)s")
    engine.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS, metavar="N",
                        help="tokens per forward pass; sizes the activation reserve (default %(default)s)")
    engine.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    engine.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="TOKENS",
                        help="default %(default)s")
    engine.add_argument("--activation-reserve-gib", type=float, metavar="GIB",
                        help="replace the activation/graph reserve heuristic with a measured figure")

    workload = parser.add_argument_group("workload")
    workload.add_argument("--avg-context-len", metavar="TOKENS", help="typical prompt + output tokens per request")
    workload.add_argument("--target-concurrency", type=int, metavar="N",
                          help="requests in flight (default: --max-num-seqs)")

    output = parser.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="machine-readable output")
    output.add_argument("--compare", choices=("gpus", "kv-dtypes"), help="one table across GPUs or KV dtypes")
    output.add_argument("--table", action="store_true", help="KV reference table for the built-in registry")
    output.add_argument("--list-gpus", action="store_true", help="print the GPU catalog")
    output.add_argument("--check", action="store_true", help="exit 1 when the plan does not fit (for CI)")
    output.add_argument("--emit-config", type=Path, metavar="DIR",
                        help="also write the deployment: serve.yaml (kvserve serve --config), a kustomize overlay "
                             "of deploy/base for this GPU and bench.sh, the day-2 test against the endpoint")


def run(args: argparse.Namespace) -> int:
    console = _console()
    try:
        return _run(args, console)
    except PlannerError as exc:
        print(f"kvserve plan: error: {exc}", file=sys.stderr)
        return 2


def _console() -> Console:
    width = None if sys.stdout.isatty() else _PIPED_CONSOLE_WIDTH
    return Console(width=width, highlight=False, soft_wrap=False)


def _run(args: argparse.Namespace, console: Console) -> int:
    if args.list_gpus:
        render_gpu_catalog(console)
        return 0
    if args.table:
        rows = reference_rows()
        _emit_json(reference_to_dicts(rows)) if args.json else render_reference(console, rows)
        return 0
    if not args.model:
        raise PlannerError("--model is required (or use --table / --list-gpus)")
    spec = load_spec(args.model)
    request = request_from_args(args)
    if args.emit_config and (args.compare or (request.gpu is None and request.gpu_memory_gib is None)):
        raise PlannerError("--emit-config writes one plan's deployment: give --gpu NAME (or --gpu-memory GIB), "
                           "without --compare")
    if args.compare:
        return _run_comparison(args, console, spec, request)
    if request.gpu is None and request.gpu_memory_gib is None:
        return _run_without_gpu(args, console, spec, request)
    plan = make_plan(spec, request)
    if args.emit_config:
        check_deployable(plan, args.emit_config)  # before anything is printed: a refused plan writes nothing
    fixes = suggest_fixes(plan)
    _emit_json(plan_to_dict(plan, fixes)) if args.json else render_plan(console, plan, fixes)
    if args.emit_config:
        written = emit_config(plan, args.model, args.emit_config)
        print("\n".join(f"wrote {path}" for path in written), file=sys.stderr if args.json else sys.stdout)
    return 1 if args.check and not plan.verdict.fits else 0


def _run_without_gpu(args: argparse.Namespace, console: Console, spec: ModelSpec, request: PlanRequest) -> int:
    """The model's own figures: what it costs is known without a GPU; whether it fits is not."""
    if args.check:
        raise PlannerError("--check needs --gpu NAME or --gpu-memory GIB: without a GPU there is no verdict")
    cost = model_cost(spec, request)
    _emit_json(model_cost_to_dict(cost)) if args.json else render_model_cost(console, cost)
    return 0


def _run_comparison(args: argparse.Namespace, console: Console, spec: ModelSpec, request: PlanRequest) -> int:
    if args.compare == "gpus":
        plans = compare_gpus(spec, request)
        render = render_gpu_comparison
    else:
        plans = compare_kv_dtypes(spec, request)
        render = render_kv_comparison
    _emit_json([plan_to_dict(plan) for plan in plans]) if args.json else render(console, plans)
    return 1 if args.check and not any(plan.verdict.fits for plan in plans) else 0


def request_from_args(args: argparse.Namespace) -> PlanRequest:
    return PlanRequest(
        gpu=args.gpu,
        gpu_memory_gib=args.gpu_memory,
        kv_cache_memory_gib=args.kv_cache_memory,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=parse_token_count(args.max_model_len, "--max-model-len") if args.max_model_len else None,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_dtype=args.kv_cache_dtype,
        dtype=args.dtype,
        quantization=args.quantization,
        block_size=args.block_size,
        avg_context_len=parse_token_count(args.avg_context_len, "--avg-context-len") if args.avg_context_len else None,
        target_concurrency=args.target_concurrency,
        activation_reserve_gib=args.activation_reserve_gib,
    )


def _emit_json(payload: object) -> None:
    print(json.dumps(payload, indent=2))
