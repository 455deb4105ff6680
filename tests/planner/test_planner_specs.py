"""ModelSpec parsing from config.json dicts and the built-in registry."""

import pytest

from kvserve.planner import PlannerError, load_spec, spec_from_hf_config
from kvserve.planner.registry import REGISTRY, close_matches, registry_spec


def _config(**overrides):
    base = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000,
        "max_position_embeddings": 2048,
    }
    return base | overrides


def test_basic_llama_config():
    spec = spec_from_hf_config(_config(), source="x/config.json")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim, spec.attention_kind) == (4, 2, 32, "GQA")
    assert not spec.tie_word_embeddings and not spec.attention_bias and spec.windowed_layers == ()


def test_head_dim_from_config_wins():
    assert spec_from_hf_config(_config(head_dim=64)).head_dim == 64


def test_qwen2_has_qkv_bias_and_ignores_disabled_window():
    spec = spec_from_hf_config(_config(model_type="qwen2", sliding_window=512, use_sliding_window=False))
    assert spec.attention_bias and spec.windowed_layers == ()


def test_qwen2_window_applies_from_max_window_layers():
    spec = spec_from_hf_config(_config(model_type="qwen2", sliding_window=512, use_sliding_window=True,
                                       max_window_layers=2))
    assert spec.windowed_layers == (2, 3) and spec.sliding_window == 512


def test_window_as_long_as_the_context_never_binds():
    assert spec_from_hf_config(_config(model_type="mistral", sliding_window=2048)).windowed_layers == ()
    assert spec_from_hf_config(_config(model_type="mistral", sliding_window=1024)).windowed_layers == (0, 1, 2, 3)


def test_layer_types_are_honoured():
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    spec = spec_from_hf_config(_config(sliding_window=128, layer_types=layer_types))
    assert spec.windowed_layers == (0, 2)


def test_gemma3_pattern_five_local_one_global():
    spec = registry_spec("google/gemma-3-27b-it")
    assert spec.num_layers == 62 and spec.sliding_window == 1024
    assert [i for i in range(62) if i not in spec.windowed_layers] == list(range(5, 62, 6))
    assert spec.tie_word_embeddings and spec.qk_norm and spec.norms_per_layer == 4
    assert spec.extra_params > 400_000_000  # the SigLIP vision tower ships in the checkpoint


def test_moe_and_mla_fields():
    deepseek = registry_spec("deepseek-ai/DeepSeek-V3")
    assert deepseek.is_mla and deepseek.kv_lora_rank == 512 and deepseek.qk_rope_head_dim == 64
    assert deepseek.num_experts == 256 and deepseek.first_dense_layers == 3 and deepseek.num_shared_experts == 1
    assert deepseek.quantization.method == "fp8" and deepseek.quantization.block_shape == (128, 128)
    mixtral = registry_spec("mistralai/Mixtral-8x7B-Instruct-v0.1")
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.moe_intermediate_size) == (8, 2, 14336)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"hidden_size": None}, "missing required key"), ({"num_hidden_layers": -2}, "positive integer"),
     ({"num_attention_heads": 8, "num_key_value_heads": 3}, "not a multiple"),
     ({"num_hidden_layers": "many"}, "positive integer")],
)
def test_bad_configs_are_clear_errors(overrides, message):
    config = {k: v for k, v in _config(**overrides).items() if v is not None}
    with pytest.raises(PlannerError, match=message):
        spec_from_hf_config(config, source="bad/config.json")


def test_registry_covers_the_issue_families_with_sources():
    assert len(REGISTRY) >= 25
    ids = " ".join(entry.repo_id for entry in REGISTRY)
    for family in ("Llama-2-7b", "Llama-2-13b", "Llama-2-70b", "Llama-3.1-8B", "Llama-3.1-70B", "Llama-3.1-405B",
                   "Llama-3.2-1B", "Llama-3.2-3B", "Qwen2.5-0.5B", "Qwen2.5-72B", "Qwen3-8B", "Qwen3-30B-A3B",
                   "Mistral-7B", "Mixtral-8x7B", "Mixtral-8x22B", "gemma-2-9b", "gemma-3-27b", "DeepSeek-V3",
                   "Phi-3", "phi-4", "SmolLM2"):
        assert family in ids, family
    for entry in REGISTRY:
        assert entry.repo_id.count("/") == 1
        spec = registry_spec(entry.repo_id)
        assert spec.source.startswith(entry.repo_id)


def test_registry_lookup_is_case_insensitive_and_accepts_short_names_and_aliases():
    assert registry_spec("qwen/qwen2.5-14b-instruct").name == "Qwen/Qwen2.5-14B-Instruct"
    assert registry_spec("Llama-2-7b-hf").name == "meta-llama/Llama-2-7b-hf"
    assert registry_spec("meta-llama/Llama-2-7b-chat-hf").name == "meta-llama/Llama-2-7b-hf"
    assert load_spec("deepseek-ai/DeepSeek-R1").name == "deepseek-ai/DeepSeek-V3"


def test_unknown_model_lists_close_matches():
    with pytest.raises(PlannerError, match=r"unknown model 'Qwen/Qwen2.5-14B'.*close matches: .*Qwen2.5-14B-Instruct"):
        load_spec("Qwen/Qwen2.5-14B")
    assert "meta-llama/Llama-3.1-8B-Instruct" in close_matches("llama-3.1-8b-instrct")
    with pytest.raises(PlannerError, match="--table"):
        load_spec("zzzzzzzz")
