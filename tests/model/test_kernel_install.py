"""The CPU kernels come from the install: loading them compiles nothing, and a family the install did not
build (or built from other sources, or for another torch) is named at start-up and the portable path runs."""

import json
import logging
import os
import shutil
import subprocess
import sys

import torch

from kvserve.model import cpu_kernels as kernels_module
from kvserve.model import kernel_build
from kvserve.model.cpu_isa import ISA_FAMILIES, runnable_isas
from kvserve.model.cpu_kernels import load_installed

AVX2 = ISA_FAMILIES[1]

LOAD_EVERY_FAMILY = """
import sys
from kvserve.model.cpu_kernels import cpu_kernels
from kvserve.model.cpu_isa import runnable_isas
for isa in runnable_isas():
    assert cpu_kernels(isa) is not None, isa
assert "torch.utils.cpp_extension" not in sys.modules, "the runtime imported torch's extension builder"
print("loaded", *[isa.name for isa in runnable_isas()])
"""


def test_the_install_built_every_family_and_loading_them_compiles_nothing(tmp_path):
    """In a fresh process, as `kvserve serve` starts: every family this CPU runs loads, torch's builder is
    never imported, and torch's extension cache stays empty."""
    cache = tmp_path / "torch_extensions"
    cache.mkdir()
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(cache)}
    env.pop("KVSERVE_CPU_ISA", None)
    env.pop("KVSERVE_CPU_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", LOAD_EVERY_FAMILY], capture_output=True, text=True, env=env,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["loaded", *[isa.name for isa in runnable_isas()]]
    assert "unavailable" not in result.stderr
    assert list(cache.iterdir()) == []
    for isa in kernel_build.buildable_isas():
        assert kernel_build.install_problem(isa, torch.__version__, kernel_build.KERNELS_DIR) is None, isa


def test_a_family_the_install_did_not_build_is_named_and_the_portable_path_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(kernel_build, "KERNELS_DIR", tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvserve.model"):
        assert kernels_module._load.__wrapped__(AVX2) is None
    assert caplog.messages == [
        "CPU kernels for AVX2+FMA unavailable: not built when kvserve was installed; using the portable torch "
        "path. To build them, reinstall kvserve where a C++ compiler is installed (from a checkout: pip install -e .)"]


def test_a_family_that_failed_to_build_at_install_says_why(tmp_path):
    kernel_build.write_record(AVX2, tmp_path, torch.__version__, error="command 'c++' failed: No such file")
    assert load_installed(AVX2, tmp_path) == (
        None, "failed to build when kvserve was installed (command 'c++' failed: No such file)")


def installed_copy(isa, folder):
    """The install's module and record for `isa`, copied into `folder`."""
    shutil.copy(kernel_build.module_file(isa), folder)
    shutil.copy(kernel_build.record_path(isa), folder)


def test_kernels_built_from_other_sources_are_stale_and_not_loaded(tmp_path):
    """After editing csrc/ without rebuilding, the old kernels must not run as if they were the new ones."""
    edited = tmp_path / "csrc"
    shutil.copytree(kernel_build.CSRC, edited)
    with open(edited / kernel_build.SOURCES[0], "a") as source:
        source.write("\n// edited after the install\n")
    installed = tmp_path / "installed"
    installed.mkdir()
    installed_copy(AVX2, installed)
    assert kernel_build.install_problem(AVX2, torch.__version__, installed) is None
    kernel_build.write_record(AVX2, installed, torch.__version__, csrc=edited)
    assert load_installed(AVX2, installed) == (None, f"built from other sources than {kernel_build.CSRC} holds now")


def test_kernels_built_against_another_torch_are_not_loaded(tmp_path):
    kernel_build.write_record(AVX2, tmp_path, "2.12.1+cpu")
    assert load_installed(AVX2, tmp_path) == (None, f"built against torch 2.12.1, this is torch {torch.__version__}")


def test_a_record_without_its_module_is_not_loaded(tmp_path):
    kernel_build.write_record(AVX2, tmp_path, torch.__version__)
    assert load_installed(AVX2, tmp_path) == (None, f"its module is missing from {tmp_path}")


def test_the_record_says_what_the_build_used(tmp_path):
    path = kernel_build.write_record(AVX2, tmp_path, "2.13.0+cpu")
    assert json.loads(path.read_text()) == {"family": "avx2", "sources_digest": kernel_build.sources_digest(AVX2),
                                            "torch": "2.13.0", "error": None}
    assert kernel_build.sources_digest(AVX2) != kernel_build.sources_digest(ISA_FAMILIES[2])


def test_every_family_is_built_on_x86_and_only_the_portable_one_elsewhere():
    assert kernel_build.buildable_isas("x86_64") == list(ISA_FAMILIES)
    assert [isa.name for isa in kernel_build.buildable_isas("aarch64")] == ["generic"]
