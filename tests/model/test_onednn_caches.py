"""oneDNN's per-shape caches are capped (issue 33 item 11): a server sees a new matmul shape for nearly every
prefill length, and with oneDNN's defaults (1,024 entries in each of two caches) it kept them all."""

import os
import subprocess
import sys
import textwrap

import pytest

from kvserve.model.layers import ONEDNN_CACHE_CAPACITY, ONEDNN_CACHE_VARIABLES, bound_onednn_caches

# In a fresh process: the caches read their capacity once, and this test process may have used oneDNN already.
# Prints the bytes malloc holds after ONEDNN_CACHE_CAPACITY x 2 shapes minus after the first half of them.
MATMUL_SHAPES_PROBE = textwrap.dedent("""
    import ctypes
    import torch
    from kvserve.model.cpu_kernels import cpu_kernels, packed_weights_are_faster
    from kvserve.model.layers import PackedWeight, bound_onednn_caches, linear
    from kvserve.model.quant_weight import dense_weight

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                        "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2

    def malloc_in_use():
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd

    def run(row_counts):
        for num_rows in row_counts:
            linear(torch.zeros(num_rows, 576, dtype=dtype), weight)

    torch.set_num_threads(1)
    bound_onednn_caches()  # what load_model does first
    kernels = cpu_kernels()
    # a weight as the engine holds it: oneDNN's layout (AMX), a dense part the kernels read (torch's matmul past
    # 48 rows), or plain (no kernels)
    dtype = torch.bfloat16 if kernels is not None and kernels.small_batch_linear_has_bf16_dot() else torch.float32
    weight = torch.randn(1536, 576).to(dtype)
    if packed_weights_are_faster(dtype):
        weight = PackedWeight.of(weight)
    elif kernels is not None:
        weight = dense_weight(weight, kernels)
    run(range(3, 131))  # fills capped caches
    before = malloc_in_use()
    run(range(131, 259))  # as many new shapes again: prefills of new lengths
    print(malloc_in_use() - before)
""")


def glibc_malloc_info() -> bool:
    return sys.platform == "linux" and os.confstr("CS_GNU_LIBC_VERSION") is not None


@pytest.mark.skipif(not glibc_malloc_info(), reason="reads glibc's mallinfo2")
def test_new_matmul_shapes_do_not_grow_memory_once_the_caches_are_full():
    env = {k: v for k, v in os.environ.items() if k not in ONEDNN_CACHE_VARIABLES}
    result = subprocess.run([sys.executable, "-c", MATMUL_SHAPES_PROBE], capture_output=True, text=True,
                            timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    grown_mib = int(result.stdout.split()[-1]) / 2**20
    # Uncapped, these 128 shapes held 76 MiB (1536 x 576 bf16 weight); capped, under 0.1 MiB.
    assert grown_mib < 8, f"malloc holds {grown_mib:.1f} MiB more after 128 new matmul shapes"


def test_an_operators_capacity_wins(monkeypatch):
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "300")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    bound_onednn_caches()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "300"
    assert os.environ["LRU_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
