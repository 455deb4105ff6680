"""Which kernels --attention-backend runs, and the errors a user gets for a choice that cannot run."""

import pytest
import torch

from kvserve.cache.storage.kv_storage import allocate_kv_storage
from kvserve.config import EngineConfig
from kvserve.model.attention_backend import attention_kernels
from kvserve.model.cpu_kernels import cpu_kernels

CPU = torch.device("cpu")


def cache(kv_cache_dtype=None):
    return allocate_kv_storage(1, 4, 16, 2, 64, torch.float32, CPU, kv_cache_dtype)[0]


def test_auto_on_cpu_runs_the_cpu_kernels_or_the_portable_path_without_them():
    chosen = attention_kernels("auto", CPU, torch.float32, 64, cache())
    assert chosen.name == ("cpu" if cpu_kernels() is not None else "torch")
    assert not chosen.graph_safe


def test_torch_is_the_portable_path_for_every_part():
    chosen = attention_kernels("torch", CPU, torch.float32, 64, cache("int8"))
    assert (chosen.name, chosen.decode, chosen.prefill, chosen.writer(cache("int8"))) == ("torch", None, None, None)


def test_triton_writes_every_format_but_int4_in_a_kernel():
    pytest.importorskip("triton")
    chosen = attention_kernels("triton", CPU, torch.float32, 64, cache())
    assert chosen.name == "triton" and chosen.graph_safe
    assert chosen.decode is not None and chosen.prefill is not None
    assert all(chosen.writer(cache(fmt)) is not None for fmt in (None, "fp8_e4m3", "fp8_e5m2", "int8"))
    assert chosen.writer(cache("int4")) is None  # per-block key requantization stays torch's


def test_cpu_kernels_are_refused_on_cuda():
    with pytest.raises(ValueError, match="--attention-backend cpu runs the CPU kernels"):
        attention_kernels("cpu", torch.device("cuda"), torch.bfloat16, 64, cache())


def test_an_unknown_backend_is_refused_before_anything_loads():
    with pytest.raises(ValueError, match="--attention-backend must be one of auto, cpu, triton, torch"):
        EngineConfig.from_kwargs(attention_backend="flash")
