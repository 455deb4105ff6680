"""What the install compiles for the CPU kernels, read by setup.py (which builds them) and by cpu_kernels.py
(which loads them): the sources, the flags, one module per ISA family, and the record each build leaves beside
its module.

A new kernel source file goes into SOURCES, here and nowhere else: every family's module then compiles it,
and an install built before it was added reads as stale at start-up instead of running old kernels.

Standard library only: setup.py imports this before kvserve's dependencies are installed.
"""

from __future__ import annotations

import hashlib
import json
import platform
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path

from kvserve.model.cpu_isa import ISA_FAMILIES, CpuIsa

PACKAGE = "kvserve.model"
KERNELS_DIR = Path(__file__).parent  # where the install puts the modules (in place for `pip install -e .`)
CSRC = KERNELS_DIR / "csrc"

# Compiled together into each family's module; the headers they include live beside them in csrc/.
SOURCES = ("module.cpp", "paged_attention.cpp", "prefill_attention.cpp", "prefill_attention_fp32.cpp",
           "kv_quantize.cpp", "small_batch_linear.cpp", "quant_linear.cpp", "argmax.cpp")

# -fopenmp: at::parallel_for is header code that runs serially unless OpenMP is on at compile time. The
# family's own flags come after these (never -march=native: a module must run on every CPU of its family).
COMPILE_FLAGS = ("-O3", "-ffast-math", "-fopenmp")
LINK_FLAGS = ("-fopenmp",)

REBUILD_HINT = "reinstall kvserve where a C++ compiler is installed (from a checkout: pip install -e .)"


def module_name(isa: CpuIsa) -> str:
    """The family's module, by its full name (its `__name__` once loaded)."""
    return f"{PACKAGE}._cpu_kernels_{isa.name}"


def buildable_isas(machine: str | None = None) -> list[CpuIsa]:
    """The families an install builds: all of them on x86-64 (the install may move to another x86 CPU), only
    the one without x86 flags elsewhere."""
    machine = (machine or platform.machine()).lower()
    if machine in ("x86_64", "amd64"):
        return list(ISA_FAMILIES)
    return [isa for isa in ISA_FAMILIES if not isa.compile_flags]


def compile_flags(isa: CpuIsa) -> list[str]:
    return [*COMPILE_FLAGS, *isa.compile_flags]


def source_paths(csrc: Path = CSRC) -> list[Path]:
    return [csrc / name for name in SOURCES]


def sources_digest(isa: CpuIsa, csrc: Path = CSRC) -> str:
    """What a family's module is built from: the sources, the headers beside them, and the flags."""
    digest = hashlib.sha256(" ".join(compile_flags(isa)).encode())
    for path in [*source_paths(csrc), *sorted(csrc.glob("*.h"))]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def record_path(isa: CpuIsa, folder: Path = KERNELS_DIR) -> Path:
    return folder / f"{module_name(isa).rpartition('.')[2]}.build.json"


def write_record(isa: CpuIsa, folder: Path, torch_version: str, error: str | None = None,
                 csrc: Path = CSRC) -> Path:
    """What the install did for `isa`: the sources and torch it built against, or why it could not build."""
    path = record_path(isa, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"family": isa.name, "sources_digest": sources_digest(isa, csrc), "torch": torch_release(torch_version),
              "error": error}
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def module_file(isa: CpuIsa, folder: Path = KERNELS_DIR) -> Path | None:
    stem = module_name(isa).rpartition(".")[2]
    return next((folder / (stem + suffix) for suffix in EXTENSION_SUFFIXES if (folder / (stem + suffix)).exists()),
                None)


def torch_release(version: str) -> str:
    """2.13.0 for 2.13.0+cpu: CPU and CUDA wheels of one release share the C++ ABI the modules use."""
    return version.partition("+")[0]


def install_problem(isa: CpuIsa, torch_version: str, folder: Path) -> str | None:
    """Why the installed module for `isa` must not be loaded, or None when it may."""
    path = record_path(isa, folder)
    if not path.exists():
        return "not built when kvserve was installed"
    record = json.loads(path.read_text())
    if record["error"]:
        return f"failed to build when kvserve was installed ({record['error']})"
    if record["torch"] != torch_release(torch_version):
        return f"built against torch {record['torch']}, this is torch {torch_version}"
    if record["sources_digest"] != sources_digest(isa):
        return f"built from other sources than {CSRC} holds now"
    if module_file(isa, folder) is None:
        return f"its module is missing from {folder}"
    return None
