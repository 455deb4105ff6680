"""GPU catalog lookups and errors."""

import pytest

from kvserve.planner import PlannerError
from kvserve.planner.gpus import GPU_CATALOG, lookup_gpu, resolve_gpu

REQUIRED = ("A10", "L4", "L40S", "A100-40GB", "A100-80GB", "H100-80GB", "H200", "B200", "RTX-3090", "RTX-4090",
            "MI300X")


def test_catalog_has_the_issue_gpus():
    names = {gpu.name for gpu in GPU_CATALOG}
    assert set(REQUIRED) <= names
    for gpu in GPU_CATALOG:
        assert 10 < gpu.memory_gib < 200


@pytest.mark.parametrize(
    ("query", "name"),
    [("A100-80GB", "A100-80GB"), ("a100 80g", "A100-80GB"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
     ("h100", "H100-80GB"), ("H100-PCIe", "H100-80GB"), ("nvidia-geforce-rtx-4090", "RTX-4090"), ("4090", "RTX-4090"),
     ("a10g", "A10"), ("mi300x", "MI300X"), ("L40S", "L40S")],
)
def test_lookup_accepts_common_spellings(query, name):
    assert lookup_gpu(query).name == name


def test_ambiguous_a100_suggests_both_sizes():
    with pytest.raises(PlannerError, match="A100-40GB or A100-80GB"):
        lookup_gpu("A100")


def test_unknown_gpu_lists_catalog_and_gpu_memory():
    with pytest.raises(PlannerError, match="unknown GPU 'Z9000'.*catalog: .*H200.*--gpu-memory"):
        lookup_gpu("Z9000")


def test_gpu_memory_overrides_and_must_be_positive():
    assert resolve_gpu(None, 40).memory_bytes == 40 * 1024**3
    named = resolve_gpu("A100-80GB", 81.0)
    assert named.name == "A100-80GB" and named.memory_gib == 81.0
    with pytest.raises(PlannerError, match="positive"):
        resolve_gpu(None, -1)
    with pytest.raises(PlannerError, match="--gpu"):
        resolve_gpu(None, None)
