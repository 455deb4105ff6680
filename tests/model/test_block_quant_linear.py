"""Matmuls of one or two rows over GGUF blocks (csrc/block_quant_linear.cpp), in every ISA family this CPU runs,
against the values the blocks encode; and a GGUF model whose small batches read its blocks gives the logits of
the same model computed over its dequantized weights."""

import gguf
import numpy as np
import pytest
import torch
from gguf_fixtures import byte_level_tokenizer_spec, tiny_hf_model, write_model_gguf
from kernel_families import FAMILIES, kernels_for
from test_model_parity import kvserve_logits

from kvserve.model.gguf_file import split_blocks
from kvserve.model.layers import BlockQuantWeight, PackedWeight, linear, tensor_bytes, weight_packing_available
from kvserve.model.loader import load_model

Q = gguf.GGMLQuantizationType
BLOCK_TYPES = [Q.Q4_0, Q.Q4_1, Q.Q8_0]


def blocks_of(weight: np.ndarray, tensor_type) -> tuple[BlockQuantWeight, torch.Tensor]:
    """(the weight quantized as GGUF blocks and split for the kernel, what the blocks encode per ggml)."""
    stored = gguf.quants.quantize(weight, tensor_type)
    encoded = torch.from_numpy(gguf.quants.dequantize(stored, tensor_type).copy())
    return BlockQuantWeight(*split_blocks(torch.from_numpy(stored), tensor_type)), encoded


@pytest.mark.parametrize("tensor_type", BLOCK_TYPES, ids=lambda t: t.name)
def test_split_blocks_decode_as_ggml_decodes_them(tensor_type):
    weight = np.random.default_rng(0).standard_normal((48, 160)).astype(np.float32)
    blocks, encoded = blocks_of(weight, tensor_type)
    assert blocks.shape == (48, 160) and blocks.bits == (8 if tensor_type == Q.Q8_0 else 4)
    assert torch.equal(blocks.dequantize(), encoded)
    assert blocks.nbytes() == 48 * 160 // 32 * (34 if tensor_type == Q.Q8_0 else 20)  # Q4_0 gains a minimum


@FAMILIES
@pytest.mark.parametrize("tensor_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("in_features", [576, 1536, 32, 96])  # whole vectors of scales, and scalar tails
def test_matches_the_encoded_weights(isa, tensor_type, dtype, rows, in_features):
    kernels = kernels_for(isa)
    rng = np.random.default_rng(rows * 1000 + in_features)
    blocks, encoded = blocks_of(rng.standard_normal((333, in_features)).astype(np.float32), tensor_type)
    x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32)).to(dtype)
    bias = torch.from_numpy(rng.standard_normal(333).astype(np.float32)).to(dtype)
    for b in (None, bias):
        out = kernels.block_quant_linear(x, blocks.values, blocks.scales, blocks.mins, torch.empty(0) if b is None else b)
        assert out.dtype == dtype and out.shape == (rows, 333)
        # Reference in fp64 over the exact encoded values; the kernel accumulates in fp32 and rounds once.
        expected = x.double() @ encoded.double().T + (0 if b is None else b.double())
        tolerance = 1e-5 if dtype == torch.float32 else 2**-8
        assert (out.double() - expected).abs().max().item() <= tolerance * expected.abs().max().item()


@FAMILIES
def test_refuses_what_it_does_not_compute(isa):
    kernels = kernels_for(isa)
    blocks, _ = blocks_of(np.ones((4, 64), dtype=np.float32), Q.Q4_1)
    parts = (blocks.values, blocks.scales, blocks.mins, torch.empty(0))
    with pytest.raises(RuntimeError, match="1 to 2 rows"):
        kernels.block_quant_linear(torch.randn(3, 64), *parts)
    with pytest.raises(RuntimeError, match="whole blocks of 32"):
        kernels.block_quant_linear(torch.randn(1, 48), *parts)
    with pytest.raises(RuntimeError, match="neither 4-bit nor 8-bit"):
        kernels.block_quant_linear(torch.randn(1, 96), *parts)
    with pytest.raises(RuntimeError, match="mins"):
        kernels.block_quant_linear(torch.randn(1, 64), blocks.values, blocks.scales, torch.empty(0), torch.empty(0))


def tiny_gguf(tmp_path, arch: str, tensor_type, tied: bool = False):
    spec = byte_level_tokenizer_spec("gpt2")
    model = tiny_hf_model(arch, seed=3, tie_word_embeddings=tied, vocab_size=len(spec.tokens))
    path = tmp_path / f"{arch}-{tensor_type.name}.gguf"
    return write_model_gguf(path, model, arch=arch, tensor_type=tensor_type, tokenizer=spec)


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])  # permuted q/k rows; biases, tied head
@pytest.mark.parametrize("tensor_type", BLOCK_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_batches_read_the_files_blocks(tmp_path, arch, tied, tensor_type, dtype):
    if not weight_packing_available(getattr(torch, dtype)):
        pytest.skip("this torch build cannot pack these weights for oneDNN")
    path = tiny_gguf(tmp_path, arch, tensor_type, tied)
    loaded = load_model(str(path), dtype=dtype)
    if loaded.model.fused_kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    model = loaded.model
    reference = load_model(str(path), dtype="float32")  # unpacked: F.linear over the dequantized weights
    reference.model.use_fused_kernels(False)
    # Every matmul weight, fused ones (qkv, gate_up) and the tied head included, kept as the file's blocks, in
    # the rows and order of the model's own weights.
    assert sorted(model.block_weights) == sorted(
        ["embed_tokens" if tied else "lm_head"]
        + [f"layers.{i}.{name}" for i in range(2)
           for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")])
    qkv_blocks = model.block_weights["layers.1.self_attn.qkv_proj"]
    assert torch.equal(qkv_blocks.dequantize(), reference.model.layers[1].self_attn.qkv_proj.float())
    loaded_bytes = loaded.weights_bytes
    freed = sum(tensor_bytes(w) for w in (getattr(m, n) for m, n in model._matmul_weights()) if w is not None)
    assert model.pack_weights_for_cpu()
    assert model.block_weights == {}
    weights = [getattr(m, n) for m, n in model._matmul_weights()]
    assert all(isinstance(w, PackedWeight) and isinstance(w.plain, BlockQuantWeight) for w in weights)
    # No plain copies: the matmul parameters are freed; the blocks and the packed weights are held instead.
    assert loaded.weights_bytes == loaded_bytes - freed + sum(w.packed.numel() * w.packed.element_size() + w.plain.nbytes()
                                                      for w in weights)
    # A one-token forward (every matmul through the blocks) against the unpacked fp32 model.
    ours = kvserve_logits(loaded, [5]).float()
    theirs = kvserve_logits(reference, [5]).float()
    tolerance = 1e-4 if dtype == "float32" else 3e-2  # bf16 rounds every layer's output
    assert (ours - theirs).abs().max().item() <= tolerance * theirs.abs().max().item()
    # Three rows go through oneDNN's packed weights (the dequantized values in the model dtype), as before.
    x = torch.randn(3, 64).to(model.dtype)
    qkv = model.layers[1].self_attn.qkv_proj
    assert torch.allclose(linear(x[:2], qkv).float(), linear(x, qkv)[:2].float(), rtol=3e-2, atol=3e-2)


def test_mixed_and_unsupported_block_types_keep_plain_copies(tmp_path):
    """A Q5_0 file (a type the kernel does not read) loads as before: plain copies for small batches."""
    path = tiny_gguf(tmp_path, "llama", Q.Q5_0)
    loaded = load_model(str(path), dtype="float32")
    if loaded.model.fused_kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    assert loaded.model.block_weights == {}
    assert loaded.model.pack_weights_for_cpu()
    plain = loaded.model.layers[0].mlp.down_proj.plain
    assert isinstance(plain, torch.Tensor) and plain.dtype == torch.float32
