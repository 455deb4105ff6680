"""GPU catalog: memory as CUDA reports it (`torch.cuda.mem_get_info()` total), which is what
`--gpu-memory-utilization` multiplies. That is a few hundred MiB below the marketing size (ECC and the driver
keep the rest): an "80 GB" A100 shows 79.15 GiB. Values can differ by ~0.5 GiB across drivers and board
variants; pass `--gpu-memory GIB` to plan against a number you measured.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass

from kvserve.planner.errors import PlannerError
from kvserve.planner.units import gib_to_bytes


@dataclass(slots=True, frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    nominal: str
    aliases: tuple[str, ...] = ()

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / 1024**3


def _gpu(name: str, gib: float, nominal: str, *aliases: str) -> GpuSpec:
    return GpuSpec(name, gib_to_bytes(gib), nominal, aliases)


GPU_CATALOG: tuple[GpuSpec, ...] = (
    _gpu("T4", 14.75, "16 GB GDDR6", "tesla-t4"),
    _gpu("A10", 22.19, "24 GB GDDR6", "a10g"),
    _gpu("L4", 22.16, "24 GB GDDR6"),
    _gpu("RTX-3090", 23.69, "24 GB GDDR6X", "3090", "geforce-rtx-3090"),
    _gpu("RTX-4090", 23.65, "24 GB GDDR6X", "4090", "geforce-rtx-4090"),
    _gpu("A100-40GB", 39.39, "40 GB HBM2", "a100-40g", "a100-sxm4-40gb"),
    _gpu("L40S", 44.42, "48 GB GDDR6"),
    _gpu("RTX-A6000", 47.54, "48 GB GDDR6", "a6000"),
    _gpu("A100-80GB", 79.15, "80 GB HBM2e", "a100-80g", "a100-sxm4-80gb"),
    _gpu("H100-80GB", 79.11, "80 GB HBM3", "h100", "h100-sxm", "h100-pcie", "h100-80g"),
    _gpu("H200", 139.81, "141 GB HBM3e", "h200-141gb", "h200-141g"),
    _gpu("B200", 178.35, "180 GB HBM3e", "b200-180gb", "b200-192gb"),
    _gpu("MI300X", 191.98, "192 GB HBM3", "amd-mi300x"),
)


def _normalize(name: str) -> str:
    key = re.sub(r"[^a-z0-9]", "", name.lower())
    for prefix in ("nvidia", "amd", "geforce", "instinct", "tesla"):
        key = key.removeprefix(prefix)
    return key.replace("gb", "g")


def _index() -> dict[str, GpuSpec]:
    index: dict[str, GpuSpec] = {}
    for gpu in GPU_CATALOG:
        for name in (gpu.name, *gpu.aliases):
            index[_normalize(name)] = gpu
    return index


_INDEX = _index()


def lookup_gpu(name: str) -> GpuSpec:
    gpu = _INDEX.get(_normalize(name))
    if gpu is not None:
        return gpu
    key = _normalize(name)
    prefixed = sorted({g.name for k, g in _INDEX.items() if key and k.startswith(key)})
    close = [_INDEX[k].name for k in difflib.get_close_matches(key, list(_INDEX), n=4, cutoff=0.5)]
    suggestions = list(dict.fromkeys(prefixed + close))
    hint = f"did you mean {' or '.join(suggestions)}? " if suggestions else ""
    catalog = ", ".join(g.name for g in GPU_CATALOG)
    raise PlannerError(f"unknown GPU {name!r}: {hint}catalog: {catalog}; or pass --gpu-memory GIB for any other card")


def custom_gpu(memory_gib: float) -> GpuSpec:
    if memory_gib <= 0:
        raise PlannerError(f"--gpu-memory must be positive, got {memory_gib}")
    return GpuSpec(f"{memory_gib:g} GiB GPU", gib_to_bytes(memory_gib), "--gpu-memory")


def resolve_gpu(name: str | None, memory_gib: float | None) -> GpuSpec:
    """`--gpu NAME` from the catalog; `--gpu-memory GIB` overrides the memory (and names an uncatalogued card)."""
    if memory_gib is not None:
        gpu = custom_gpu(memory_gib)
        if name:
            return GpuSpec(name, gpu.memory_bytes, "--gpu-memory")
        return gpu
    if not name:
        raise PlannerError("pass --gpu NAME (see `kvserve plan --list-gpus`) or --gpu-memory GIB")
    return lookup_gpu(name)
