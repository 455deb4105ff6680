"""Every ISA family of the CPU kernels that this CPU runs (AVX2 on an AVX-512 machine too), for kernel tests."""

import pytest

from kvserve.model.cpu_isa import runnable_isas
from kvserve.model.cpu_kernels import cpu_kernels

FAMILIES = pytest.mark.parametrize("isa", runnable_isas(), ids=str)


def kernels_for(isa):
    kernels = cpu_kernels(isa)
    if kernels is None:
        pytest.skip(f"no installed CPU kernels for {isa} (the warning above says why)")
    return kernels
