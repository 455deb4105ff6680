"""The kustomize overlay for one GPU class: the base, the GPU component, serve.yaml in the engines' ConfigMap,
and a patch with the GPU, its node pool and the pod's sizes."""

from __future__ import annotations

import yaml

from kvserve.planner.deployment.gpu_nodes import GPU_RESOURCE, node_selector_expression
from kvserve.planner.deployment.sizing import PodSizing
from kvserve.planner.plan import Plan

ENGINE_PATCH = "engine-gpu-class.yaml"
ENGINE_STATEFULSET = "kvserve-engine"
ENGINE_CONFIG_MAP = "kvserve-engine-config"


def kustomization(deploy_root: str, header: list[str]) -> str:
    """deploy_root: the folder holding base/ and components/, relative to the overlay."""
    document = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [f"{deploy_root}/base"],
        "components": [f"{deploy_root}/components/gpu"],
        "patches": [{"path": ENGINE_PATCH}],
        "configMapGenerator": [{"name": ENGINE_CONFIG_MAP, "behavior": "replace", "files": ["serve.yaml"]}],
    }
    return _with_header(header, document)


def engine_patch(plan: Plan, sizing: PodSizing, header: list[str]) -> str:
    memory = f"{sizing.memory_gib}Gi"
    gpus = plan.request.tensor_parallel_size  # one per tensor-parallel rank, in the same pod
    document = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": ENGINE_STATEFULSET},
        "spec": {
            "template": {"spec": {
                "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [node_selector_expression(plan.gpu.name)]}]}}},
                "containers": [{
                    "name": "engine",
                    # Memory: the host KV tier + the weights on their way to the GPU + CUDA and Python.
                    "resources": {
                        "requests": {"cpu": str(sizing.cpus), "memory": memory, GPU_RESOURCE: gpus},
                        "limits": {"memory": memory, GPU_RESOURCE: gpus},
                    },
                    "startupProbe": {"failureThreshold": sizing.startup_failure_threshold},
                }],
            }},
            "volumeClaimTemplates": [{
                "metadata": {"name": "kv-disk"},
                "spec": {"accessModes": ["ReadWriteOnce"],
                         "resources": {"requests": {"storage": f"{sizing.volume_gib}Gi"}}},
            }],
        },
    }
    notes = [f"{plan.gpu.name}: {gpus} GPU{'s' if gpus > 1 else ''} per engine on nodes labelled {node_selector_expression(plan.gpu.name)['key']};",
             f"startup budget {sizing.startup_budget_s} s (the weights from the models volume, CUDA, profiling);",
             f"volume: the {sizing.disk_tier_gib} GiB disk tier and room; memory: the {sizing.host_tier_gib} GiB "
             f"host tier + {sizing.memory_gib - sizing.host_tier_gib} GiB (the weights while they load, CUDA, Python)."]
    return _with_header(header + notes, document)


def _with_header(header: list[str], document: dict) -> str:
    comments = "".join(f"# {line}\n" for line in header)
    return comments + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)
