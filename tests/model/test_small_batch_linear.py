"""Matmuls of one or two rows over plain weights (csrc/small_batch_linear.cpp), in every ISA family this CPU
runs, against torch's; and the model that uses them for small batches gives the logits oneDNN's packed
weights give."""

import pytest
import torch
from kernel_families import FAMILIES, kernels_for
from test_model_parity import kvserve_logits

from kvserve.model.layers import PackedWeight, linear, weight_packing_available
from kvserve.model.loader import load_model



@FAMILIES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("in_features", [576, 1536, 100, 7])  # multiples of the vector widths, and tails
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_torch(isa, dtype, rows, in_features, with_bias):
    kernels = kernels_for(isa)
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=generator).to(dtype)
    weight = torch.randn(333, in_features, generator=generator).to(dtype)
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
    with pytest.raises(RuntimeError, match="1 to 2 rows"):
        kernels.small_batch_linear(torch.randn(3, 8), torch.randn(4, 8), torch.empty(0))
    with pytest.raises(RuntimeError, match="both fp32 or bf16"):
        kernels.small_batch_linear(torch.randn(1, 8), torch.randn(4, 8).bfloat16(), torch.empty(0))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied head; tied head with q/k/v biases
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_small_batches_read_the_plain_weights_and_match_packed_ones(kind, dtype, tiny_model_dir):
    if not weight_packing_available(getattr(torch, dtype)):
        pytest.skip("this torch build cannot pack these weights for oneDNN")
    folder, _ = tiny_model_dir(kind)
    loaded = load_model(str(folder), dtype=dtype)
    if loaded.model.fused_kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    plain_bytes = loaded.weights_bytes
    assert loaded.model.pack_weights_for_cpu()
    qkv = loaded.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, PackedWeight) and qkv.plain is not None and qkv.max_rows == 2
    head = loaded.model.lm_head
    if loaded.config.tie_word_embeddings:
        assert head.plain is loaded.model.embed_tokens  # the head's plain form is the embedding, not a copy
    # The plain weights stay (no longer parameters, still counted); each packed form adds its bytes; the tied
    # head's plain form is the embedding, counted once.
    packed = [getattr(m, n) for m, n in loaded.model._matmul_weights()]
    assert loaded.weights_bytes == plain_bytes + sum(w.packed.numel() * w.packed.element_size() for w in packed)
    # One and two rows go through small_batch_linear, three through oneDNN; the logits agree either way.
    x = torch.randn(3, qkv.plain.shape[1]).to(qkv.plain.dtype)
    packed_only = PackedWeight(qkv.packed)
    for rows in (1, 2, 3):
        ours, theirs = linear(x[:rows], qkv), linear(x[:rows], packed_only)
        assert torch.allclose(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2)
    # A one-token forward (every matmul through small_batch_linear) against the unpacked model (F.linear).
    reference = load_model(str(folder), dtype=dtype)
    ours, theirs = kvserve_logits(loaded, [5]).float(), kvserve_logits(reference, [5]).float()
    tolerance = 1e-4 if dtype == "float32" else 3e-2  # two bf16 computations, each rounding every layer's output
    assert (ours - theirs).abs().max().item() <= tolerance * theirs.abs().max().item()
    assert ours.argmax().item() == theirs.argmax().item() or dtype == "bfloat16"


def test_packing_twice_changes_nothing(tiny_model_dir):
    if not weight_packing_available(torch.float32):
        pytest.skip("this torch build cannot pack these weights for oneDNN")
    folder, _ = tiny_model_dir("qwen2")
    loaded = load_model(str(folder), dtype="float32")
    assert loaded.model.pack_weights_for_cpu()
    packed_bytes, head = loaded.weights_bytes, loaded.model.lm_head
    assert loaded.model.pack_weights_for_cpu()
    assert loaded.weights_bytes == packed_bytes and loaded.model.lm_head is head
