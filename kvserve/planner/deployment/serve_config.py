"""serve.yaml: the plan's flags as `kvserve serve --config` reads them (kvserve/server/config_file.py)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath

import yaml

from kvserve.planner.deployment.sizing import PodSizing
from kvserve.planner.plan import Plan

MODELS_DIR = "/models"  # where components/gpu mounts the kvserve-models volume
SHUTDOWN_TIMEOUT_S = 30  # below the base's terminationGracePeriodSeconds (90)


def model_path(model_arg: str) -> str:
    """The checkpoint's path inside the pod: its folder (or .gguf) name under the models volume."""
    return str(PurePosixPath(MODELS_DIR) / PurePosixPath(model_arg.rstrip("/")).name)


def served_name(model_arg: str) -> str:
    """What clients send as `model`: a registry id as given; a local checkpoint by its name, not this machine's
    path (a .gguf without the suffix, as kvserve names the demo model)."""
    path = Path(model_arg)
    if not path.exists():
        return model_arg
    return path.name.removesuffix(".gguf")


def serve_options(plan: Plan, model_arg: str, sizing: PodSizing) -> list[tuple[str, object, str]]:
    """(flag, value, why) in the order a reader wants them."""
    request = plan.request
    return [
        ("model", model_path(model_arg), "copy the checkpoint there: the kvserve-models volume"),
        ("served-model-name", [served_name(model_arg)], "the name clients send"),
        ("device", "cuda", ""),
        ("dtype", plan.model_dtype, ""),
        ("gpu-memory-utilization", request.gpu_memory_utilization, ""),
        *([("tensor-parallel-size", request.tensor_parallel_size, "one GPU per rank, in this pod")]
          if request.tensor_parallel_size > 1 else []),
        ("max-model-len", plan.max_model_len, ""),
        ("max-num-seqs", request.max_num_seqs, ""),
        ("max-num-batched-tokens", request.max_num_batched_tokens, ""),
        ("block-size", request.block_size, ""),
        ("kv-cache-dtype", request.kv_cache_dtype, f"stored as {plan.kv.name}"),
        ("enable-prefix-caching", True, ""),
        ("prefix-caching-hash-algo", "sha256", "tenants share the engine: block hashes no one can collide"),
        ("kv-offloading-size", sizing.host_tier_gib, "GiB of host memory: one pool's worth of idle sessions"),
        ("kv-disk-size", sizing.disk_tier_gib, "GiB on the engine's volume (--kv-disk-path is in the manifest)"),
        ("shutdown-timeout", SHUTDOWN_TIMEOUT_S, "seconds of draining on SIGTERM"),
        ("disable-uvicorn-access-log", True, ""),
    ]


def serve_yaml(plan: Plan, model_arg: str, sizing: PodSizing, header: list[str]) -> str:
    lines = [f"# {line}" for line in header]
    for key, value, why in serve_options(plan, model_arg, sizing):
        text = yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()
        lines.append(f"{key}: {text}" + (f"  # {why}" if why else ""))
    return "\n".join(lines) + "\n"
