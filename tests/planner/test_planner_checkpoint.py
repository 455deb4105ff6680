"""Local checkpoints: exact weight bytes from safetensors headers, and specs from GGUF metadata."""

import json
import struct

import numpy as np
import pytest

from kvserve.planner import PlannerError, kv_bytes_per_token, load_spec
from kvserve.planner.checkpoint import read_safetensors_header, summarize_checkpoint
from kvserve.planner.plan import PlanRequest, make_plan
from kvserve.planner.weights import estimate_weights

HIDDEN, INTERMEDIATE, VOCAB, LAYERS, HEADS, KV_HEADS = 64, 128, 100, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def _tiny_config():
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 512,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }


def _tiny_tensors(dtype):
    kv_width = KV_HEADS * HEAD_DIM
    tensors = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "lm_head.weight": (VOCAB, HIDDEN),
               "model.norm.weight": (HIDDEN,)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}."
        tensors |= {
            prefix + "self_attn.q_proj.weight": (HIDDEN, HIDDEN),
            prefix + "self_attn.k_proj.weight": (kv_width, HIDDEN),
            prefix + "self_attn.v_proj.weight": (kv_width, HIDDEN),
            prefix + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            prefix + "mlp.gate_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.up_proj.weight": (INTERMEDIATE, HIDDEN),
            prefix + "mlp.down_proj.weight": (HIDDEN, INTERMEDIATE),
            prefix + "input_layernorm.weight": (HIDDEN,),
            prefix + "post_attention_layernorm.weight": (HIDDEN,),
        }
    return {name: np.zeros(shape, dtype=dtype) for name, shape in tensors.items()}


@pytest.fixture
def hf_folder(tmp_path):
    from safetensors.numpy import save_file

    tensors = _tiny_tensors(np.float32)
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config()))
    return tmp_path, sum(t.size for t in tensors.values())


def test_folder_spec_reads_exact_weight_bytes_from_headers(hf_folder):
    folder, num_params = hf_folder
    spec = load_spec(str(folder))
    assert spec.checkpoint is not None and spec.checkpoint.float_params == num_params
    assert spec.checkpoint.stored_bytes == 4 * num_params  # float32 on disk
    # The float32 checkpoint is served in bfloat16 (--dtype auto), so 2 bytes per parameter.
    weights = estimate_weights(spec, "bfloat16")
    assert weights.total_bytes == 2 * num_params and "checkpoint headers" in weights.formula
    assert estimate_weights(spec, "float32").total_bytes == 4 * num_params
    # The architecture count agrees with the headers for this plain Llama layout.
    from kvserve.planner.weights import total_params

    assert total_params(spec) == num_params
    assert kv_bytes_per_token(spec) == 2 * LAYERS * KV_HEADS * HEAD_DIM * 2


def test_header_parsing_matches_file_layout(hf_folder):
    folder, _ = hf_folder
    path = next(folder.glob("*.safetensors"))
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    entries = read_safetensors_header(path)
    assert sum(entry.num_bytes for entry in entries) == len(raw) - 8 - header_len


def test_config_json_path_also_finds_the_weights(hf_folder):
    folder, num_params = hf_folder
    plan = make_plan(load_spec(str(folder / "config.json")), PlanRequest(gpu="L4"))
    assert plan.weights.per_gpu_bytes == 2 * num_params
    assert plan.model_dtype == "bfloat16"


def test_layers_beyond_the_decoder_are_not_counted(tmp_path):
    from safetensors.numpy import save_file

    save_file({"model.layers.0.w": np.zeros((4, 4), np.float16), "model.layers.2.mtp.w": np.zeros((8, 8), np.float16),
               "model.layers.1.scale_inv": np.zeros((2,), np.float32)}, str(tmp_path / "model.safetensors"))
    summary = summarize_checkpoint(tmp_path, num_hidden_layers=2)
    assert summary.float_params == 16 and summary.fixed_bytes == 8 and summary.skipped_bytes == 128


def test_consolidated_duplicates_are_ignored(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.zeros((10,), np.float16)}, str(tmp_path / "consolidated.safetensors"))
    save_file({"a": np.zeros((10,), np.float16)}, str(tmp_path / "model.safetensors"))
    assert summarize_checkpoint(tmp_path, 1).float_params == 10


def test_corrupt_safetensors_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_tiny_config()))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(PlannerError, match="not valid JSON"):
        load_spec(str(tmp_path))


def test_folder_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(PlannerError, match="no config.json"):
        load_spec(str(tmp_path))


def _write_gguf(path, *, window=None):
    import gguf

    writer = gguf.GGUFWriter(str(path), "gemma2" if window else "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(32)
    writer.add_value_length(32)
    writer.add_vocab_size(VOCAB)
    if window:
        writer.add_sliding_window(window)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, HIDDEN), np.float16))
    quantized = gguf.quants.quantize(np.zeros((HIDDEN, HIDDEN), np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", quantized, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_norm.weight", np.zeros((HIDDEN,), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_metadata_becomes_a_spec(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path)
    spec = load_spec(str(path))
    assert (spec.num_layers, spec.hidden_size, spec.num_attention_heads, spec.num_kv_heads) == (2, 64, 4, 2)
    assert spec.head_dim == 32 and spec.vocab_size == VOCAB and spec.max_position_embeddings == 512
    assert spec.tie_word_embeddings  # no output.weight tensor
    assert kv_bytes_per_token(spec) == 2 * 2 * 2 * 32 * 2
    checkpoint = spec.checkpoint
    assert checkpoint.float_params == VOCAB * HIDDEN + HIDDEN
    assert checkpoint.fixed_bytes == HIDDEN * HIDDEN // 32 * 34  # Q8_0: 34 bytes per 32 weights
    assert estimate_weights(spec, "bfloat16").total_bytes == checkpoint.loaded_bytes("bfloat16")


def test_gguf_sliding_window_follows_the_architecture(tmp_path):
    path = tmp_path / "gemma.gguf"
    _write_gguf(path, window=128)
    spec = load_spec(str(path))
    assert spec.sliding_window == 128 and spec.windowed_layers == (0,)


def test_gguf_in_a_folder_and_bad_files(tmp_path):
    _write_gguf(tmp_path / "only.gguf")
    assert load_spec(str(tmp_path)).num_layers == 2
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(PlannerError, match="GGUF"):
        load_spec(str(bad))
