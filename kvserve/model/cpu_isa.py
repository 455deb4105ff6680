"""What this CPU computes fast, and so which kernels and which `--dtype auto` kvserve picks on it.

x86 CPUs differ in ways that change the right choice, not only the speed: with AVX512-BF16 (or AMX) a bf16
dot product is one instruction and bf16 is the fast dtype; on AVX2-only CPUs (AMD Zen 3, many Intel client
parts) torch's bf16 matmuls run at a tenth of fp32's speed, so fp32 is. The C++ kernels are built once per ISA
family (the flags below, never -march=native), into a build cache keyed by that family, so a cache or an
image moved to another CPU builds the family that CPU runs instead of dying on an illegal instruction.

`KVSERVE_CPU_ISA=avx2` (or generic, avx512, avx512_bf16) caps the family: a machine with AVX-512 then runs,
and its test suite checks, what an AVX2-only machine runs.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ISA_ENV = "KVSERVE_CPU_ISA"


@dataclass(frozen=True, slots=True)
class CpuIsa:
    name: str  # the family's name, as KVSERVE_CPU_ISA spells it
    label: str  # for the start-up log
    required_flags: tuple[str, ...]  # /proc/cpuinfo flags the family needs
    compile_flags: tuple[str, ...]
    native_bf16: bool  # bf16 dot products in hardware: bf16 is the fast compute dtype

    def __str__(self) -> str:
        return self.name


_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")

# From least to most capable; each family's flags include the previous one's.
ISA_FAMILIES: tuple[CpuIsa, ...] = (
    CpuIsa("generic", "no AVX2", (), (), False),
    CpuIsa("avx2", "AVX2+FMA", ("avx2", "fma", "f16c"), _AVX2, False),
    CpuIsa("avx512", "AVX-512", ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"), _AVX512,
           False),
    # Every CPU with AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later) has AVX512-VNNI too: the int8
    # KV cache is scored with its integer dot products.
    CpuIsa("avx512_bf16", "AVX-512 with BF16",
           ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"),
           (*_AVX512, "-mavx512bf16", "-mavx512vnni"), True),
)
_BY_NAME = {isa.name: isa for isa in ISA_FAMILIES}


@cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is absent or not x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def detected_isa(flags: frozenset[str] | None = None) -> CpuIsa:
    """The most capable family whose instructions this CPU has."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISA_FAMILIES if set(isa.required_flags) <= flags][-1]


def has_amx_bf16(flags: frozenset[str] | None = None) -> bool:
    return "amx_bf16" in (cpu_flags() if flags is None else flags)


def selected_isa() -> CpuIsa:
    """The family kvserve runs: the detected one, capped by $KVSERVE_CPU_ISA (which cannot raise it)."""
    detected = detected_isa()
    cap = os.environ.get(ISA_ENV, "").strip().lower()
    if not cap:
        return detected
    if cap not in _BY_NAME:
        raise ValueError(f"${ISA_ENV}={cap!r}: expected one of {', '.join(_BY_NAME)}")
    capped = _BY_NAME[cap]
    return capped if ISA_FAMILIES.index(capped) <= ISA_FAMILIES.index(detected) else detected


def runnable_isas() -> list[CpuIsa]:
    """Every family this CPU can run, least capable first (the kernel tests check each)."""
    detected = detected_isa()
    return [isa for isa in ISA_FAMILIES[: ISA_FAMILIES.index(detected) + 1] if isa.name != "generic"]


def native_bf16() -> bool:
    """Whether bf16 is the fast compute dtype here (AVX512-BF16 or AMX, and not capped below it)."""
    isa = selected_isa()
    return isa.native_bf16 or (has_amx_bf16() and isa == detected_isa())
