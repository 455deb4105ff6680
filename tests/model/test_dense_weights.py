"""Matmul weights of 16-bit and fp32 checkpoints are held once, as the checkpoint's rows, and read in place for
every batch size (quant_linear's dense parts): the kernel against fp64 over the same values in every ISA family
this CPU runs, and models holding them against the portable path (F.linear over plain parameters)."""

import json

import pytest
import torch
from gguf import GGMLQuantizationType
from kernel_families import FAMILIES, kernels_for
from test_model_parity import kvserve_logits
from test_quant_weights import tiny_gguf
from tiny_models import build_model, build_tokenizer

from kvserve.model import loader
from kvserve.model.gguf_file import gguf_parameter_bytes
from kvserve.model.layers import PackedWeight, onednn_packs
from kvserve.model.loader import load_model
from kvserve.model.quant_weight import DENSE_TYPES, QuantWeight, dense_weight

# 1-8: small_batch_linear's walk; 9-48 of bf16 x: AMX tiles where the CPU has them, else torch's matmul (or
# widened slices when x's dtype is not the weight's); past 48: torch's matmul or slices.
ROWS = [1, 2, 3, 8, 9, 16, 33, 48, 49, 300]
DTYPE_PAIRS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float16),
               (torch.bfloat16, torch.bfloat16)]


@FAMILIES
@pytest.mark.parametrize("x_dtype, weight_dtype", DTYPE_PAIRS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("in_features", [576, 96, 40])  # 40: not whole tile rows (no AMX)
def test_dense_linear_matches_fp64(isa, x_dtype, weight_dtype, rows, in_features):
    kernels = kernels_for(isa)
    generator = torch.Generator().manual_seed(rows * 1000 + in_features)
    weight = torch.randn(70, in_features, generator=generator).to(weight_dtype)
    x = torch.randn(rows, in_features, generator=generator).to(x_dtype)
    bias = torch.randn(70, generator=generator).to(x_dtype)
    held = dense_weight(weight, kernels)
    assert held.parts[0].blocks.data_ptr() == weight.data_ptr()  # the weight's own storage, not a copy
    out = held.linear(x, bias)
    assert out.dtype == x_dtype and out.shape == (rows, 70)
    # fp64 over the values the kernel multiplies (bf16 x: the weights as bf16, as torch's bf16 matmul takes them)
    expected = x.double() @ weight.to(x_dtype).double().T + bias.double()
    tolerance = 1e-5 if x_dtype == torch.float32 else 2**-7  # bf16 out keeps 8 bits; the bias adds after sums
    assert (out.double() - expected).abs().max().item() <= tolerance * expected.abs().max().item()


@FAMILIES
@pytest.mark.parametrize("weight_dtype", list(DENSE_TYPES))
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dense_rows_lookup_is_the_embedding(isa, weight_dtype, out_dtype):
    kernels = kernels_for(isa)
    table = torch.randn(50, 96, generator=torch.Generator().manual_seed(1)).to(weight_dtype)
    ids = torch.tensor([7, 0, 49, 7])
    assert torch.equal(dense_weight(table, kernels).lookup(ids, out_dtype), table[ids].to(out_dtype))


def _held(model) -> dict[str, object]:
    """The model's matmul weights and embedding, by name."""
    names = [f"layers.{i}.{m}" for i in range(len(model.layers))
             for m in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
    names += ["embed_tokens"] + ([] if model.lm_head is None else ["lm_head"])
    held = {}
    for name in names:
        owner, _, attribute = name.rpartition(".")
        held[name] = getattr(model.get_submodule(owner) if owner else model, attribute)
    return held


def _bf16_checkpoint(kind: str, folder):
    build_model(kind, 0).to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    build_tokenizer(folder)
    return folder


# (checkpoint dtype, --dtype, layout): plain rows everywhere; oneDNN's layout alone where bf16 computes (on CPUs
# with AMX by default, forced here on any CPU whose torch packs bf16).
CASES = [("float32", "float32", "plain"), ("float32", "bfloat16", "plain"), ("bfloat16", "float32", "plain"),
         ("bfloat16", "bfloat16", "plain"), ("bfloat16", "bfloat16", "packed"), ("float32", "bfloat16", "packed")]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # untied head; tied head with q/k/v biases
@pytest.mark.parametrize("checkpoint, dtype, layout", CASES, ids=["-".join(case) for case in CASES])
def test_checkpoint_weights_are_held_once_and_give_the_portable_logits(kind, checkpoint, dtype, layout,
                                                                       tiny_model_dir, tmp_path, monkeypatch):
    if layout == "packed" and not onednn_packs(torch.bfloat16):
        pytest.skip("this torch build cannot pack bf16 weights for oneDNN")
    monkeypatch.setattr(loader, "packed_weights_are_faster", lambda compute: layout == "packed")
    folder = tiny_model_dir(kind)[0] if checkpoint == "float32" else _bf16_checkpoint(kind, tmp_path)
    loaded = load_model(str(folder), dtype=dtype)
    if loaded.model.fused_kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    with monkeypatch.context() as portable:
        portable.setenv("KVSERVE_CPU_KERNELS", "0")
        reference = load_model(str(folder), dtype=dtype)
    # Every matmul weight once: one dense part each, in the checkpoint's 16-bit dtype where the model computes in
    # fp32 (else the compute dtype), or oneDNN's layout alone; the embedding a dense part (lookups read its rows).
    weight_dtype = torch.bfloat16 if "bfloat16" in (checkpoint, dtype) else torch.float32
    held = _held(loaded.model)
    embedding = held.pop("embed_tokens")
    assert isinstance(embedding, QuantWeight) and embedding.parts[0].ggml_type == DENSE_TYPES[weight_dtype]
    if layout == "packed":
        assert all(isinstance(w, PackedWeight) for w in held.values()), held
    else:
        assert all(isinstance(w, QuantWeight) and len(w.parts) == 1 for w in held.values()), held
        assert {w.parts[0].ggml_type for w in held.values()} == {DENSE_TYPES[weight_dtype]}
    assert all(p.dim() == 1 for p in loaded.model.parameters())  # norms, biases
    if weight_dtype == loaded.model.dtype and layout == "plain":
        assert loaded.weights_bytes == reference.weights_bytes
    elif weight_dtype == loaded.model.dtype:  # oneDNN's layout pads a little at most
        assert reference.weights_bytes <= loaded.weights_bytes <= 1.05 * reference.weights_bytes
    else:  # 16-bit weights, fp32 compute: half the portable path's fp32 matrices
        assert loaded.weights_bytes < 0.55 * reference.weights_bytes
    # One token and three (small_batch_linear), 37 (a prefill)
    for tokens in ([5], [5, 6, 7], list(range(3, 40))):
        ours = kvserve_logits(loaded, tokens).float()
        theirs = kvserve_logits(reference, tokens).float()
        scale = theirs.abs().max().item()
        if loaded.model.dtype == torch.float32:
            assert (ours - theirs).abs().max().item() <= 1e-4 * scale
        else:  # two bf16 computations, each rounding every layer's output
            assert (ours - theirs).abs().max().item() <= 3e-2 * scale


@pytest.mark.parametrize("tensor_type", [GGMLQuantizationType.F16, GGMLQuantizationType.BF16], ids=lambda t: t.name)
def test_a_16_bit_gguf_computed_in_fp32_keeps_its_matrices_16_bit(tmp_path, monkeypatch, tensor_type):
    path = tiny_gguf(tmp_path, "qwen2", tensor_type, tied=True)
    loaded = load_model(str(path), dtype="float32")
    if loaded.model.fused_kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    with monkeypatch.context() as portable:
        portable.setenv("KVSERVE_CPU_KERNELS", "0")
        reference = load_model(str(path), dtype="float32")
    assert {w.parts[0].ggml_type for w in _held(loaded.model).values()} == {int(tensor_type)}
    assert loaded.weights_bytes <= 1.05 * gguf_parameter_bytes(str(path))  # the file's bytes, not fp32's twice
    for tokens in ([5], list(range(3, 40))):
        ours, theirs = kvserve_logits(loaded, tokens).float(), kvserve_logits(reference, tokens).float()
        assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()


def test_the_stored_dtype_is_read_from_the_safetensors_not_the_config(tmp_path):
    """A config.json that names another dtype than its tensors' (float16 over bf16 tensors) must not make fp32
    compute narrow the bf16 matrices to fp16."""
    folder = _bf16_checkpoint("llama", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"torch_dtype": "float16", "dtype": "float16"}))
    loaded = load_model(str(folder), dtype="float32")
    if loaded.model.fused_kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    assert {w.parts[0].ggml_type for w in _held(loaded.model).values()} == {DENSE_TYPES[torch.bfloat16]}
