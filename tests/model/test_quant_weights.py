"""Weights held as GGUF blocks (quant_weight.py, csrc/quant_linear.cpp): matmuls for every block type, batch
size and ISA family against gguf's own decoding and an fp64 matmul; embedding lookups; and GGUF models that
hold their weights as blocks, at their file's size, giving the logits of the same model over dequantized
weights (the portable path, which still dequantizes at load)."""

import gguf
import numpy as np
import pytest
import torch
from gguf_fixtures import byte_level_tokenizer_spec, random_k_quant, tiny_hf_model, write_model_gguf
from kernel_families import FAMILIES, kernels_for
from test_model_parity import kvserve_logits

from kvserve.model.cpu_isa import has_amx_bf16
from kvserve.model.loader import load_model
from kvserve.model.quant_weight import DENSE_TYPES, QUANT_LINEAR_TYPES, QuantPart, QuantWeight

Q = gguf.GGMLQuantizationType
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K]
K_QUANTS = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The walk (1-8 rows; over the 32-value types with bf16 dot products and no AMX, int8 panels from 5); with bf16
# x on a CPU with AMX, tiles decoded in L1 (9-48 rows: one, three partial and three whole tiles of x's rows);
# then decoded slices through torch's matmul, or int8 panels.
BATCH_ROWS = (1, 2, 3, 5, 8, 9, 33, 48, 49, 300)
WALK_ROWS = 8
# The walk's int8 activations move these random models' logits by 0.6-1.5% of their largest (llama.cpp's decode
# rounds the same way); a slip in a block's decoding moves them by far more.
ACTIVATION_ROUNDING_TOLERANCE = 0.03


def quant_part(rows: int, cols: int, tensor_type, seed: int) -> QuantPart:
    if tensor_type in K_QUANTS:
        data = random_k_quant((rows, cols), tensor_type, seed)
    else:
        weight = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
        data = gguf.quants.quantize(weight, tensor_type)
    return QuantPart(int(tensor_type), torch.from_numpy(np.ascontiguousarray(data)))


def activation_rounding(x: torch.Tensor, reference: torch.Tensor, group: int) -> torch.Tensor:
    """How far the walk's int8 activations can move x @ reference.T: each group of x rounds to steps of
    max|x| / 127, so by half a step times the weights' magnitudes over the group, summed."""
    steps = x.double().reshape(x.shape[0], -1, group).abs().amax(-1) / 127
    magnitudes = reference.abs().reshape(reference.shape[0], -1, group).sum(-1)
    return steps / 2 @ magnitudes.T


def rounds_x(weight: QuantWeight, rows: int, dtype: torch.dtype) -> bool:
    """Whether the kernels round x to int8: up to 8 rows (the walk), and more rows where the family multiplies
    this block type on int8 panels (bf16 x where AMX does not take it; fp32 x without bf16 dot products)."""
    bf16 = dtype == torch.bfloat16
    return rows <= WALK_ROWS or all(weight.kernels.quant_linear_int8_batches(part.ggml_type, bf16)
                                    for part in weight.parts)


def check_linear(weight: QuantWeight, reference: torch.Tensor, dtype: torch.dtype, seed: int) -> None:
    """weight.linear against x @ reference.T + bias in fp64, for every batch size, with and without bias; where
    x is rounded to int8 (rounds_x), by up to half a step per group as llama.cpp rounds it (K-quants: groups of 256)."""
    group = 256 if any(part.ggml_type in K_QUANTS for part in weight.parts) else 32
    rng = np.random.default_rng(seed)
    out_features, in_features = weight.shape
    bias = torch.from_numpy(rng.standard_normal(out_features).astype(np.float32)).to(dtype)
    for rows in BATCH_ROWS:
        x = torch.from_numpy(rng.standard_normal((rows, in_features)).astype(np.float32)).to(dtype)
        for b in (None, bias):
            out = weight.linear(x, b)
            assert out.dtype == dtype and out.shape == (rows, out_features)
            expected = x.double() @ reference.T + (0 if b is None else b.double())
            # bf16 compute rounds the decoded weights and the result to bf16, as the dequantized model did.
            scale = x.double().abs() @ reference.abs().T + (0 if b is None else b.double().abs())
            tolerance = 1e-5 if dtype == torch.float32 else 2**-7
            rounding = activation_rounding(x, reference, group) if rounds_x(weight, rows, dtype) else 0
            assert ((out.double() - expected).abs() <= tolerance * scale + rounding + 1e-6).all(), (rows, b is None)


@FAMILIES
@pytest.mark.parametrize("tensor_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_linear_matches_the_encoded_weights(isa, tensor_type, dtype):
    kernels = kernels_for(isa)
    # 77 outputs: not a multiple of the 32-row tile; K: more than one 256-value chunk, and for blocks of 32 a
    # last chunk of fewer.
    cols = 768 if tensor_type in K_QUANTS else 576
    part = quant_part(77, cols, tensor_type, seed=int(tensor_type))
    weight = QuantWeight((part,), cols, kernels)
    reference = part.dequantize().double()
    assert weight.shape == (77, cols) and weight.nbytes() == part.blocks.numel()
    check_linear(weight, reference, dtype, seed=1)


@FAMILIES
def test_int8_panels_take_the_batches_they_were_measured_faster_on(isa):
    """Past 8 rows: K-quants on int8 panels with fp32 x where there are no bf16 dot products, the 32-value types
    with bf16 x where there are but AMX is absent (Q8_0 only with VNNI), and Q4_K and Q5_K with bf16 x where
    there are bf16 dot products but no AMX; elsewhere slices or AMX tiles."""
    ints = kernels_for(isa).quant_linear_int8_batches
    simd, amx = isa.name != "generic", isa.native_bf16 and has_amx_bf16()
    vnni = "-mavx512vnni" in isa.compile_flags
    for k_quant in K_QUANTS:
        assert ints(int(k_quant), False) == (simd and not isa.native_bf16)
        assert ints(int(k_quant), True) == (k_quant != Q.Q6_K and isa.native_bf16 and not amx)
    for block32 in (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1):
        assert ints(int(block32), True) == (simd and not amx)
        assert not ints(int(block32), False)
    assert ints(int(Q.Q8_0), True) == (simd and not amx and vnni)
    assert not any(ints(dense, bf16) for dense in DENSE_TYPES.values() for bf16 in (False, True))


@FAMILIES
def test_batched_decode_runs_on_amx_tiles_where_the_cpu_has_them(isa):
    """9-48 rows of bf16 x run on AMX tiles exactly where the family is AVX512-BF16 and the CPU has AMX (the
    slices elsewhere), so the matmul tests above check that path there."""
    expected = isa.native_bf16 and has_amx_bf16()
    assert kernels_for(isa).quant_linear_uses_amx() == expected


@FAMILIES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_weight_of_mixed_types_writes_each_parts_columns(isa, dtype):
    """A fused weight as a Q4_K_M file makes it: Q4_K rows (q, k) over Q6_K rows (v), then Q4_K again."""
    kernels = kernels_for(isa)
    parts = (quant_part(40, 512, Q.Q4_K, 1), quant_part(24, 512, Q.Q6_K, 2), quant_part(9, 512, Q.Q4_K, 3))
    weight = QuantWeight(parts, 512, kernels)
    reference = torch.cat([part.dequantize() for part in parts]).double()
    check_linear(weight, reference, dtype, seed=2)


@FAMILIES
@pytest.mark.parametrize("tensor_type", TYPES, ids=lambda t: t.name)
def test_lookup_decodes_the_rows_asked_for(isa, tensor_type):
    kernels = kernels_for(isa)
    part = quant_part(50, 512, tensor_type, seed=5)
    weight = QuantWeight((part,), 512, kernels)
    reference = part.dequantize()
    ids = torch.tensor([3, 0, 49, 3])
    assert torch.allclose(weight.lookup(ids, torch.float32), reference[ids], rtol=1e-6, atol=1e-7)
    # The same rounding to bf16 as the loader's dequantized weights (one step apart at most: the fp32 values
    # may differ in their last bit, fused multiply-add or not).
    assert torch.allclose(weight.lookup(ids, torch.bfloat16).float(), reference[ids], rtol=2**-8, atol=1e-7)


@FAMILIES
def test_refuses_what_it_does_not_read(isa):
    kernels = kernels_for(isa)
    assert {t for t in range(40) if kernels.quant_linear_reads(t)} == QUANT_LINEAR_TYPES | set(DENSE_TYPES.values())
    part = quant_part(4, 256, Q.Q4_K, 0)
    out = torch.empty(1, 4)
    with pytest.raises(RuntimeError, match="ggml type 10"):  # Q2_K
        kernels.quant_linear_out(torch.randn(1, 256), part.blocks, int(Q.Q2_K), torch.empty(0), out, 0)
    with pytest.raises(RuntimeError, match=r"x must be \[M, 256\]"):
        kernels.quant_linear_out(torch.randn(1, 128), part.blocks, int(Q.Q4_K), torch.empty(0), out, 0)
    with pytest.raises(RuntimeError, match="not whole blocks"):
        kernels.quant_linear_out(torch.randn(1, 256), part.blocks[:, :100].contiguous(), int(Q.Q4_K),
                                 torch.empty(0), out, 0)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.quant_rows_out(part.blocks, int(Q.Q4_K), torch.tensor([4]), torch.empty(1, 256))


def tiny_gguf(tmp_path, arch: str, tensor_type, tied: bool, tensor_types=None):
    spec = byte_level_tokenizer_spec("gpt2")
    # Rows of 256 values: K-quant super-blocks; 4 heads of 64.
    model = tiny_hf_model(arch, seed=3, tie_word_embeddings=tied, vocab_size=len(spec.tokens), hidden_size=256,
                          intermediate_size=512)
    path = tmp_path / f"{arch}-{tensor_type.name}.gguf"
    return write_model_gguf(path, model, arch=arch, tensor_type=tensor_type, tensor_types=tensor_types,
                            tokenizer=spec)


MATMUL_WEIGHTS = [f"layers.{i}.{name}" for i in range(2)
                  for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")]
Q4_K_M_LIKE = {"self_attn.v_proj.weight": Q.Q6_K, "mlp.down_proj.weight": Q.Q6_K, "lm_head.weight": Q.Q6_K}


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])  # permuted q/k rows; biases, tied head
@pytest.mark.parametrize("tensor_type", [Q.Q4_1, Q.Q8_0, Q.Q5_0, Q.Q4_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_models_hold_their_files_blocks(tmp_path, monkeypatch, arch, tied, tensor_type, dtype):
    mix = Q4_K_M_LIKE if tensor_type == Q.Q4_K else None
    path = tiny_gguf(tmp_path, arch, tensor_type, tied, mix)
    loaded = load_model(str(path), dtype=dtype)
    if loaded.model.fused_kernels is None:
        pytest.skip("the CPU kernels could not be built here")
    model = loaded.model
    with monkeypatch.context() as portable:  # references: dequantized at load, F.linear (fp32, and the dtype)
        portable.setenv("KVSERVE_CPU_KERNELS", "0")
        reference = load_model(str(path), dtype="float32")
        dequantized = load_model(str(path), dtype=dtype)
    # Every matmul weight and the embedding held as the file's blocks, nothing dequantized beside them.
    names = MATMUL_WEIGHTS + ["embed_tokens"] + ([] if tied else ["lm_head"])
    held = {name: _attribute(model, name) for name in names}
    assert all(isinstance(weight, QuantWeight) for weight in held.values()), held
    if mix:
        assert [p.ggml_type for p in held["layers.0.self_attn.qkv_proj"].parts] == [Q.Q4_K, Q.Q6_K]
    matrix_bytes = sum(weight.nbytes() for weight in held.values())
    other_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # norms, biases
    assert all(p.dim() == 1 for p in model.parameters())
    assert loaded.weights_bytes == matrix_bytes + other_bytes
    # Decode-sized and prefill-sized forwards against the fp32 model over dequantized weights: as close as the
    # same model dequantized at load in this dtype is (bf16 rounds every layer's output; these random blocks
    # make large activations).
    for tokens in ([5], list(range(3, 40))):
        ours = kvserve_logits(loaded, tokens).float()
        theirs = kvserve_logits(reference, tokens).float()
        if len(tokens) <= WALK_ROWS:  # int8 activations, as llama.cpp's decode
            relative = (ours - theirs).abs().max().item() / theirs.abs().max().item()
            assert relative <= ACTIVATION_ROUNDING_TOLERANCE
        elif model.fused_kernels.quant_linear_int8_batches(int(tensor_type), dtype == "bfloat16"):
            # int8 activations at prefill too: at most positions as close as decode's (at a few, these random
            # blocks' outlying activations move the logits further).
            relative = (ours - theirs).abs().amax(-1) / theirs.abs().amax(-1)
            assert relative.median().item() <= ACTIVATION_ROUNDING_TOLERANCE
        elif dtype == "float32":
            assert (ours - theirs).abs().max().item() <= 1e-4 * theirs.abs().max().item()
        else:
            before = (kvserve_logits(dequantized, tokens).float() - theirs).abs().max().item()
            assert (ours - theirs).abs().max().item() <= 1.5 * before + 1e-3 * theirs.abs().max().item()


def _attribute(model, name: str):
    owner, _, attribute = name.rpartition(".")
    return getattr(model.get_submodule(owner) if owner else model, attribute)


def test_portable_path_dequantizes_at_load(tmp_path, monkeypatch):
    """KVSERVE_CPU_KERNELS=0: no kernels to read blocks, so the loader dequantizes as before."""
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, tied=False)
    model = load_model(str(path), dtype="float32").model
    assert isinstance(model.layers[0].mlp.down_proj, torch.nn.Parameter)
    assert isinstance(model.embed_tokens, torch.nn.Parameter)


def test_gguf_weights_dequantized_holds_the_compute_dtype(tmp_path, monkeypatch):
    """--gguf-weights dequantized: the loader dequantizes at load even with the kernels, and greedy decoding gives
    the tokens of the portable path over the same dequantized weights (fp32)."""
    from kvserve import LLM, SamplingParams
    from kvserve.config import EngineConfig

    path = tiny_gguf(tmp_path, "llama", Q.Q4_K, tied=False)
    model = load_model(str(path), dtype="float32", gguf_blocks=False).model
    down = model.layers[0].mlp.down_proj  # dequantized: the compute dtype's rows, read as a dense part
    assert [part.ggml_type for part in down.parts] == [DENSE_TYPES[torch.float32]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    dequantized = LLM(str(path), dtype="float32", gguf_weights="dequantized", kv_cache_memory=0.05)
    ours = dequantized.generate([list(range(3, 40))], params)[0].outputs[0].token_ids
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    portable = LLM(str(path), dtype="float32", kv_cache_memory=0.05)
    assert ours == portable.generate([list(range(3, 40))], params)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="--gguf-weights must be one of blocks, dequantized"):
        EngineConfig.from_kwargs(str(path), gguf_weights="bf16")
