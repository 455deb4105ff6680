"""Writes DIR: serve.yaml, kustomization.yaml + the engine patch (an overlay of deploy/base), bench.sh."""

from __future__ import annotations

import os
import shlex
from dataclasses import fields
from pathlib import Path

from kvserve.planner.deployment.bench_script import bench_script
from kvserve.planner.deployment.gpu_nodes import GPU_PRODUCTS
from kvserve.planner.deployment.overlay import ENGINE_PATCH, engine_patch, kustomization
from kvserve.planner.deployment.serve_config import serve_yaml
from kvserve.planner.deployment.sizing import pod_sizing
from kvserve.planner.errors import PlannerError
from kvserve.planner.gpus import GPU_CATALOG
from kvserve.planner.plan import DOES_NOT_LOAD, STARTUP_ERROR, Plan, PlanRequest

# A checkout's deploy/ (next to an editable install), used when no deploy/base sits above DIR.
_CHECKOUT_DEPLOY = Path(__file__).resolve().parents[3] / "deploy"
# PlanRequest field -> `kvserve plan` flag, for the command line each file records.
_FLAGS = {"gpu": "--gpu", "gpu_memory_gib": "--gpu-memory", "tensor_parallel_size": "-tp",
          "pipeline_parallel_size": "-pp", "gpu_memory_utilization": "--gpu-memory-utilization",
          "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
          "max_num_batched_tokens": "--max-num-batched-tokens", "kv_cache_dtype": "--kv-cache-dtype",
          "dtype": "--dtype", "quantization": "--quantization", "block_size": "--block-size",
          "avg_context_len": "--avg-context-len", "target_concurrency": "--target-concurrency",
          "activation_reserve_gib": "--activation-reserve-gib"}


def plan_command(model_arg: str, request: PlanRequest) -> str:
    """The `kvserve plan` command that writes these files again (flags left at their defaults omitted)."""
    defaults = PlanRequest()
    words = ["kvserve", "plan", "--model", model_arg]
    for field in fields(PlanRequest):
        value = getattr(request, field.name)
        if value != getattr(defaults, field.name):
            words += [_FLAGS[field.name], str(value)]
    return shlex.join(words) + " --emit-config DIR"


def check_deployable(plan: Plan, out_dir: Path) -> None:
    """What kvserve serve could not start from, or an overlay with no base to point at, refused before anything
    is printed or written."""
    deploy_root(out_dir)
    if plan.verdict.status in (DOES_NOT_LOAD, STARTUP_ERROR):
        raise PlannerError(f"--emit-config: this plan cannot start ({plan.verdict.headline}); "
                           "change the flags until `kvserve plan` says it fits")
    if plan.request.pipeline_parallel_size > 1:
        raise PlannerError("--emit-config: kvserve serve has no pipeline parallelism; plan with -pp 1 (tensor "
                           "parallelism, -tp N, deploys as N GPUs per engine)")
    if plan.weights.quant.method not in ("none", "gguf"):  # GGUF files load (dequantized)
        raise PlannerError(f"--emit-config: kvserve serve does not load {plan.weights.quant.label} weights yet; "
                           "plan an unquantized checkpoint")
    catalog = {gpu.name for gpu in GPU_CATALOG}
    if plan.gpu.name in catalog and plan.gpu.name not in GPU_PRODUCTS:
        raise PlannerError(f"--emit-config: no NVIDIA node label for {plan.gpu.name}; the manifests ask for "
                           "nvidia.com/gpu")


def deploy_root(out_dir: Path) -> str:
    """The folder with base/ and components/, relative to DIR: the nearest one above DIR (deploy/overlays/NAME
    finds deploy/), else this checkout's deploy/."""
    out_dir = out_dir.resolve()
    for parent in out_dir.parents:
        if (parent / "base" / "kustomization.yaml").is_file() and (parent / "components").is_dir():
            return os.path.relpath(parent, out_dir)
    if (_CHECKOUT_DEPLOY / "base" / "kustomization.yaml").is_file():
        return os.path.relpath(_CHECKOUT_DEPLOY, out_dir)
    raise PlannerError(f"--emit-config {out_dir}: no deploy/base above it and no kvserve checkout to point at; "
                       "write it under a copy of kvserve's deploy/ (deploy/overlays/NAME)")


def emit_config(plan: Plan, model_arg: str, out_dir: Path) -> list[Path]:
    check_deployable(plan, out_dir)
    root = deploy_root(out_dir)
    sizing = pod_sizing(plan)
    header = [f"Written by: {plan_command(model_arg, plan.request)}",
              f"The plan: {plan.verdict.headline}"]
    files = {
        "serve.yaml": serve_yaml(plan, model_arg, sizing, header),
        "kustomization.yaml": kustomization(root, header + ["kubectl apply -k DIR (copy the checkpoint to the "
                                                            "kvserve-models volume first)"]),
        ENGINE_PATCH: engine_patch(plan, sizing, header),
        "bench.sh": bench_script(plan, header),
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        path = out_dir / name
        path.write_text(text)
        written.append(path)
    (out_dir / "bench.sh").chmod(0o755)
    return written
