"""The install's kernel build (setup.py, kvserve/model/kernel_build.py): every source is compiled, against the
torch kvserve runs, and an install without a C++ compiler still succeeds and records why."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from kvserve.model import kernel_build

ROOT = Path(__file__).resolve().parents[2]


def torch_pin(requirements: list[str]) -> str:
    return next(req for req in requirements if req.replace(" ", "").startswith("torch=="))


def test_the_build_compiles_against_the_torch_kvserve_runs():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert torch_pin(project["build-system"]["requires"]) == torch_pin(project["project"]["dependencies"])


def test_every_kernel_source_in_csrc_is_compiled():
    """A .cpp added to csrc/ but not to kernel_build.SOURCES would never be built."""
    assert sorted(kernel_build.SOURCES) == sorted(path.name for path in kernel_build.CSRC.glob("*.cpp"))


def test_without_a_compiler_the_install_succeeds_and_records_each_family_as_not_built(tmp_path):
    """setup.py's kernel build, as pip runs it (no terminal: progress on stderr) on a machine without g++."""
    env = {**os.environ, "CXX": "kvserve-no-such-compiler", "CC": "kvserve-no-such-compiler"}
    result = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", str(tmp_path / "lib"),
                             "--build-temp", str(tmp_path / "temp")],
                            cwd=ROOT, capture_output=True, text=True, env=env, timeout=300, start_new_session=True)
    assert result.returncode == 0, result.stderr
    built = tmp_path / "lib" / "kvserve" / "model"
    for isa in kernel_build.buildable_isas():
        record = json.loads(kernel_build.record_path(isa, built).read_text())
        assert record["error"], record
        assert kernel_build.module_file(isa, built) is None
        assert f"kvserve: the {isa.name} kernels failed to build" in result.stderr
    assert f"kvserve: CPU kernels built for 0 of {len(kernel_build.buildable_isas())} families" in result.stderr
