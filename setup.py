"""Compiles the CPU kernels when kvserve installs: one module per ISA family, every family this architecture
has (kvserve/model/kernel_build.py: the sources, flags and families), so runtime never compiles.

A family that fails to build (no C++ compiler, a flag this compiler lacks) does not fail the install: its
record says why, and kvserve runs the portable torch path on CPUs of that family, saying so at start-up.
pip hides a build's output unless it fails, so progress goes to the terminal when there is one.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

from setuptools import setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, str(Path(__file__).parent))
from kvserve.model import kernel_build  # noqa: E402

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension
except ImportError:  # only without build isolation, into an environment without torch
    torch = None
    BuildExtension = build_ext


def say(line: str) -> None:
    """One progress line where the user sees it: the terminal pip runs in, else stderr (shown by pip -v)."""
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(f"\r\n{line}\n")
    except OSError:
        print(line, file=sys.stderr, flush=True)


def kernel_extensions() -> list:
    if torch is None:
        say("kvserve: torch is not importable at build time; no CPU kernels built (the portable torch path runs)")
        return []
    csrc = Path("kvserve/model/csrc")
    # -g0: setuptools compiles with Python's own CFLAGS, whose -g makes each compiler slower and larger over
    # torch's headers (torch's runtime builder, which these modules replace, adds no -g either).
    return [CppExtension(kernel_build.module_name(isa), [str(path) for path in kernel_build.source_paths(csrc)],
                         include_dirs=[str(csrc)], extra_compile_args=[*kernel_build.compile_flags(isa), "-g0"],
                         extra_link_args=list(kernel_build.LINK_FLAGS), optional=True)
            for isa in kernel_build.buildable_isas()]


FAMILIES = {kernel_build.module_name(isa): isa for isa in kernel_build.buildable_isas()}


class BuildKernels(BuildExtension):
    """torch's extension build, with the families compiled side by side, each in its own temporary folder
    (they share source paths, so one folder would mix their objects), and a failed family recorded, not
    fatal."""

    def finalize_options(self) -> None:
        super().finalize_options()
        cores = os.cpu_count() or 1
        if self.parallel is None or self.parallel is True:  # not set with -j
            self.parallel = max(1, min(len(self.extensions), cores))
        # ninja's jobs per family, so the families together run one compiler per core.
        os.environ.setdefault("MAX_JOBS", str(max(1, cores // self.parallel)))

    def run(self) -> None:
        if self.extensions:
            say(f"kvserve: compiling the CPU kernels for {len(self.extensions)} CPU families "
                f"({', '.join(isa.name for isa in FAMILIES.values())}), {self.parallel} at a time")
        started = time.monotonic()
        super().run()
        if self.extensions:
            built = [ext for ext in self.extensions if not json.loads(self._record(ext).read_text())["error"]]
            say(f"kvserve: CPU kernels built for {len(built)} of {len(self.extensions)} families "
                f"in {time.monotonic() - started:.0f} s")

    def build_extensions(self) -> None:
        for ext in self.extensions:  # a record left by an earlier build in the same folder
            self._record(ext).unlink(missing_ok=True)
        try:
            super().build_extensions()
        except Exception as exc:  # torch checks the compiler before building any family: none usable here
            for ext in self.extensions:
                if not self._record(ext).exists():
                    self._failed(ext, exc)

    def build_extension(self, ext) -> None:
        isa = FAMILIES[ext.name]
        family = copy.copy(self)  # the families build in threads: each gets its own temporary folder
        family.build_temp = os.path.join(self.build_temp, isa.name)
        started = time.monotonic()
        try:
            super(BuildKernels, family).build_extension(ext)
        except Exception as exc:  # a compiler error: the install goes on without this family
            self._failed(ext, exc)
            return
        kernel_build.write_record(isa, self._record(ext).parent, torch.__version__)
        say(f"kvserve: built the {isa.name} kernels in {time.monotonic() - started:.0f} s")

    def _record(self, ext) -> Path:
        return kernel_build.record_path(FAMILIES[ext.name], Path(self.get_ext_fullpath(ext.name)).parent)

    def _failed(self, ext, exc: Exception) -> None:
        isa = FAMILIES[ext.name]
        error = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        kernel_build.write_record(isa, self._record(ext).parent, torch.__version__, error=error)
        say(f"kvserve: the {isa.name} kernels failed to build ({error}); "
            f"CPUs of that family will run the portable torch path")

    def copy_extensions_to_source(self) -> None:
        super().copy_extensions_to_source()
        for built, in_place in self._record_mapping():
            if os.path.exists(built):
                self.copy_file(built, in_place, level=self.verbose)

    def _get_output_mapping(self):
        yield from super()._get_output_mapping()
        if self.inplace:
            yield from self._record_mapping()

    def get_outputs(self) -> list[str]:
        if self.inplace:
            return super().get_outputs()
        return [*super().get_outputs(), *(built for built, _ in self._record_mapping())]

    def _record_mapping(self):
        """(the record in the build folder, the record in the source tree) per family."""
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            in_place, built = self._get_inplace_equivalent(build_py, ext)
            isa = FAMILIES[ext.name]
            yield (str(kernel_build.record_path(isa, Path(built).parent)),
                   str(kernel_build.record_path(isa, Path(in_place).parent)))


setup(ext_modules=kernel_extensions(), cmdclass={"build_ext": BuildKernels})
