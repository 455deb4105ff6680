"""The Triton kernels compile for a GPU (sm_90), not only run under the interpreter: a representative subset of
their launches (every kernel at an unquantized bf16 cache and at int4, int8 for the writer) through Triton's
NVIDIA backend and the ptxas its wheel ships, with no GPU. benchmarks/triton_compile_check.py (without --quick)
covers every specialization the engine launches.

tests/conftest.py chose the interpreter for this process (TRITON_INTERPRET=1, before triton was imported), under
which the kernels are interpreted functions that cannot compile: the check runs in a fresh process without it."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "triton_compile_check.py"


def _cannot_compile_for_cuda() -> str | None:
    """Why Triton cannot compile for CUDA here, or None (found without importing its backend in this process)."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    backends = importlib.util.find_spec("triton.backends")
    nvidia = None if backends is None else Path(next(iter(backends.submodule_search_locations))) / "nvidia"
    if nvidia is None or not (nvidia / "compiler.py").exists():
        return "this Triton has no NVIDIA backend"
    if not os.environ.get("TRITON_PTXAS_PATH") and not any((nvidia / "bin").glob("ptxas*")):
        return f"no ptxas in {nvidia / 'bin'} (and TRITON_PTXAS_PATH unset)"
    return None


def test_every_kernel_compiles_for_sm90(tmp_path):
    reason = _cannot_compile_for_cuda()
    if reason:
        pytest.skip(f"Triton cannot compile for CUDA here: {reason}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--arch", "90", "--jobs", "2", "--cache-dir",
                             str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=300)
    if result.returncode == 2:  # the script found no ptxas for the target
        pytest.skip(f"Triton cannot compile for CUDA here: {result.stderr.strip()}")
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    lines = [line for line in result.stdout.splitlines() if line.startswith(("OK ", "FAIL "))]
    kernels = {line.split()[1] for line in lines}
    assert kernels == {"_decode_parts", "_decode_shared_parts", "_merge_parts", "_prefill", "_write_vectors"}
    assert all(line.startswith("OK ") for line in lines), result.stdout
