"""Matmuls of 1 to 8 rows over plain weights (csrc/small_batch_linear.cpp), in every ISA family this CPU
runs, against fp64 over the same values (models using them: test_dense_weights.py)."""

import pytest
import torch
from kernel_families import FAMILIES, kernels_for


@FAMILIES
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", [1, 2, 3, 8])  # pairs of rows, and one left over
@pytest.mark.parametrize("in_features", [576, 1536, 100, 7])  # multiples of the vector widths, and tails
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp64(isa, dtype, weight_dtype, rows, in_features, with_bias):
    kernels = kernels_for(isa)
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(333, in_features, generator=generator).to(weight_dtype)
    bias = torch.randn(333, generator=generator).to(dtype) if with_bias else None
    out = kernels.small_batch_linear(x, weight, torch.empty(0) if bias is None else bias)
    assert out.dtype == dtype and out.shape == (rows, 333)
    # Reference in fp64 over the same (already rounded) inputs; the kernel rounds once, at the end.
    expected = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    tolerance = 1e-5 if dtype == torch.float32 else 2**-8  # bf16 keeps 8 bits
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= tolerance * scale


@FAMILIES
def test_refuses_what_it_does_not_compute(isa):
    kernels = kernels_for(isa)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        kernels.small_batch_linear(torch.randn(9, 8), torch.randn(4, 8), torch.empty(0))
    with pytest.raises(RuntimeError, match="bf16 x with bf16 weights"):
        kernels.small_batch_linear(torch.randn(1, 8).bfloat16(), torch.randn(4, 8), torch.empty(0))
