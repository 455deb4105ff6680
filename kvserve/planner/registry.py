"""Built-in registry: popular models, with the architecture keys of their published config.json.

Each entry names the Hugging Face repo its numbers come from and stores them in config.json form, so they go
through the same parser as a user's local config (specs.py). Only keys that matter for memory are kept.
Aliases are other repo ids with the identical architecture (base vs instruct, where the config agrees).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

from kvserve.planner.errors import PlannerError
from kvserve.planner.specs import ModelSpec, spec_from_hf_config


@dataclass(slots=True, frozen=True)
class RegistryEntry:
    repo_id: str
    config: dict[str, Any]
    aliases: tuple[str, ...] = ()
    note: str = ""


def _decoder(
    architecture: str,
    model_type: str,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_positions: int,
    *,
    tie: bool = False,
    head_dim: int | None = None,
    dtype: str = "bfloat16",
    **extra: Any,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "vocab_size": vocab,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
    }
    if head_dim is not None:
        config["head_dim"] = head_dim
    return config | extra


def _llama(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return _decoder("LlamaForCausalLM", "llama", *args, **kwargs)


def _llama31(*args: Any, rope_factor: float = 8.0, **kwargs: Any) -> dict[str, Any]:
    rope = {
        "rope_type": "llama3",
        "factor": rope_factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    return _llama(*args, rope_scaling=rope, **kwargs)


def _qwen2(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return _decoder("Qwen2ForCausalLM", "qwen2", *args, use_sliding_window=False, **kwargs)


def _qwen3(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return _decoder("Qwen3ForCausalLM", "qwen3", *args, 40960, head_dim=128, use_sliding_window=False, **kwargs)


def _qwen3_moe(hidden: int, layers: int, heads: int, experts: int, moe_width: int, dense_width: int) -> dict[str, Any]:
    return _decoder(
        "Qwen3MoeForCausalLM", "qwen3_moe", hidden, dense_width, layers, heads, 4, 151936, 40960, head_dim=128,
        num_experts=experts, num_experts_per_tok=8, moe_intermediate_size=moe_width, use_sliding_window=False,
    )


def _gemma2(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> dict[str, Any]:
    return _decoder(
        "Gemma2ForCausalLM", "gemma2", hidden, intermediate, layers, heads, kv_heads, 256000, 8192,
        tie=True, head_dim=head_dim, sliding_window=4096,
    )


# Gemma 3 4B/12B/27B ship a SigLIP vision tower in the same checkpoint.
_GEMMA3_VISION = {
    "model_type": "siglip_vision_model",
    "hidden_size": 1152,
    "intermediate_size": 4304,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "patch_size": 14,
    "image_size": 896,
}


def _gemma3_multimodal(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int
) -> dict[str, Any]:
    text = _decoder(
        "Gemma3ForCausalLM", "gemma3_text", hidden, intermediate, layers, heads, kv_heads, 262208, 131072,
        tie=True, head_dim=head_dim, sliding_window=1024, sliding_window_pattern=6,
    )
    del text["architectures"], text["torch_dtype"], text["tie_word_embeddings"]
    return {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "text_config": text,
        "vision_config": _GEMMA3_VISION,
        "torch_dtype": "bfloat16",
    }


def _phi3(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return _decoder("Phi3ForCausalLM", "phi3", *args, **kwargs)


_DEEPSEEK_V3 = _decoder(
    "DeepseekV3ForCausalLM", "deepseek_v3", 7168, 18432, 61, 128, 128, 129280, 163840,
    moe_intermediate_size=2048, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
    first_k_dense_replace=3, moe_layer_freq=1, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
    qk_nope_head_dim=128, v_head_dim=128, num_nextn_predict_layers=1,
    quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                         "weight_block_size": [128, 128]},
)

REGISTRY: tuple[RegistryEntry, ...] = (
    # Llama 2: MHA (Llama-2-70B: GQA with 8 KV heads).
    RegistryEntry("meta-llama/Llama-2-7b-hf", _llama(4096, 11008, 32, 32, 32, 32000, 4096, dtype="float16"),
                  ("meta-llama/Llama-2-7b-chat-hf",)),
    RegistryEntry("meta-llama/Llama-2-13b-hf", _llama(5120, 13824, 40, 40, 40, 32000, 4096, dtype="float16"),
                  ("meta-llama/Llama-2-13b-chat-hf",)),
    RegistryEntry("meta-llama/Llama-2-70b-hf", _llama(8192, 28672, 80, 64, 8, 32000, 4096, dtype="float16"),
                  ("meta-llama/Llama-2-70b-chat-hf",)),
    # Llama 3 / 3.1 / 3.2.
    RegistryEntry("meta-llama/Meta-Llama-3-8B-Instruct", _llama(4096, 14336, 32, 32, 8, 128256, 8192),
                  ("meta-llama/Meta-Llama-3-8B",)),
    RegistryEntry("meta-llama/Meta-Llama-3-70B-Instruct", _llama(8192, 28672, 80, 64, 8, 128256, 8192),
                  ("meta-llama/Meta-Llama-3-70B",)),
    RegistryEntry("meta-llama/Llama-3.1-8B-Instruct", _llama31(4096, 14336, 32, 32, 8, 128256, 131072),
                  ("meta-llama/Llama-3.1-8B", "meta-llama/Meta-Llama-3.1-8B-Instruct")),
    RegistryEntry("meta-llama/Llama-3.1-70B-Instruct", _llama31(8192, 28672, 80, 64, 8, 128256, 131072),
                  ("meta-llama/Llama-3.1-70B", "meta-llama/Meta-Llama-3.1-70B-Instruct")),
    RegistryEntry("meta-llama/Llama-3.1-405B-Instruct", _llama31(16384, 53248, 126, 128, 8, 128256, 131072),
                  ("meta-llama/Llama-3.1-405B", "meta-llama/Meta-Llama-3.1-405B-Instruct"),
                  note="the first upload's config.json said 16 KV heads; Meta corrected it to 8"),
    RegistryEntry("meta-llama/Llama-3.2-1B-Instruct",
                  _llama31(2048, 8192, 16, 32, 8, 128256, 131072, tie=True, head_dim=64, rope_factor=32.0),
                  ("meta-llama/Llama-3.2-1B",)),
    RegistryEntry("meta-llama/Llama-3.2-3B-Instruct",
                  _llama31(3072, 8192, 28, 24, 8, 128256, 131072, tie=True, head_dim=128, rope_factor=32.0),
                  ("meta-llama/Llama-3.2-3B",)),
    # Qwen2.5 instruct models (base repos say max_position_embeddings 131072 for some sizes: not aliased).
    RegistryEntry("Qwen/Qwen2.5-0.5B-Instruct", _qwen2(896, 4864, 24, 14, 2, 151936, 32768, tie=True)),
    RegistryEntry("Qwen/Qwen2.5-1.5B-Instruct", _qwen2(1536, 8960, 28, 12, 2, 151936, 32768, tie=True)),
    RegistryEntry("Qwen/Qwen2.5-3B-Instruct", _qwen2(2048, 11008, 36, 16, 2, 151936, 32768, tie=True)),
    RegistryEntry("Qwen/Qwen2.5-7B-Instruct", _qwen2(3584, 18944, 28, 28, 4, 152064, 32768)),
    RegistryEntry("Qwen/Qwen2.5-14B-Instruct", _qwen2(5120, 13824, 48, 40, 8, 152064, 32768)),
    RegistryEntry("Qwen/Qwen2.5-32B-Instruct", _qwen2(5120, 27648, 64, 40, 8, 152064, 32768)),
    RegistryEntry("Qwen/Qwen2.5-72B-Instruct", _qwen2(8192, 29568, 80, 64, 8, 152064, 32768)),
    # Qwen3 dense (head_dim 128 regardless of hidden/heads) and MoE.
    RegistryEntry("Qwen/Qwen3-0.6B", _qwen3(1024, 3072, 28, 16, 8, 151936, tie=True)),
    RegistryEntry("Qwen/Qwen3-1.7B", _qwen3(2048, 6144, 28, 16, 8, 151936, tie=True)),
    RegistryEntry("Qwen/Qwen3-4B", _qwen3(2560, 9728, 36, 32, 8, 151936, tie=True)),
    RegistryEntry("Qwen/Qwen3-8B", _qwen3(4096, 12288, 36, 32, 8, 151936)),
    RegistryEntry("Qwen/Qwen3-14B", _qwen3(5120, 17408, 40, 40, 8, 151936)),
    RegistryEntry("Qwen/Qwen3-32B", _qwen3(5120, 25600, 64, 64, 8, 151936)),
    RegistryEntry("Qwen/Qwen3-30B-A3B", _qwen3_moe(2048, 48, 32, 128, 768, 6144)),
    RegistryEntry("Qwen/Qwen3-235B-A22B", _qwen3_moe(4096, 94, 64, 128, 1536, 12288)),
    # Mistral / Mixtral.
    RegistryEntry("mistralai/Mistral-7B-Instruct-v0.3",
                  _decoder("MistralForCausalLM", "mistral", 4096, 14336, 32, 32, 8, 32768, 32768),
                  ("mistralai/Mistral-7B-v0.3",)),
    RegistryEntry("mistralai/Mistral-7B-v0.1",
                  _decoder("MistralForCausalLM", "mistral", 4096, 14336, 32, 32, 8, 32000, 32768, sliding_window=4096),
                  ("mistralai/Mistral-7B-Instruct-v0.1",)),
    RegistryEntry("mistralai/Mixtral-8x7B-Instruct-v0.1",
                  _decoder("MixtralForCausalLM", "mixtral", 4096, 14336, 32, 32, 8, 32000, 32768,
                           num_local_experts=8, num_experts_per_tok=2),
                  ("mistralai/Mixtral-8x7B-v0.1",)),
    RegistryEntry("mistralai/Mixtral-8x22B-Instruct-v0.1",
                  _decoder("MixtralForCausalLM", "mixtral", 6144, 16384, 56, 48, 8, 32768, 65536,
                           num_local_experts=8, num_experts_per_tok=2),
                  note="the base repo (Mixtral-8x22B-v0.1) has a 32000-token vocabulary"),
    # Gemma 2: every other layer (even indices) uses a 4096-token sliding window.
    RegistryEntry("google/gemma-2-2b-it", _gemma2(2304, 9216, 26, 8, 4, 256), ("google/gemma-2-2b",)),
    RegistryEntry("google/gemma-2-9b-it", _gemma2(3584, 14336, 42, 16, 8, 256), ("google/gemma-2-9b",)),
    RegistryEntry("google/gemma-2-27b-it", _gemma2(4608, 36864, 46, 32, 16, 128), ("google/gemma-2-27b",)),
    # Gemma 3: five sliding-window layers for every global one.
    RegistryEntry("google/gemma-3-1b-it",
                  _decoder("Gemma3ForCausalLM", "gemma3_text", 1152, 6912, 26, 4, 1, 262144, 32768, tie=True,
                           head_dim=256, sliding_window=512, sliding_window_pattern=6),
                  ("google/gemma-3-1b-pt",)),
    RegistryEntry("google/gemma-3-4b-it", _gemma3_multimodal(2560, 10240, 34, 8, 4, 256), ("google/gemma-3-4b-pt",)),
    RegistryEntry("google/gemma-3-12b-it", _gemma3_multimodal(3840, 15360, 48, 16, 8, 256), ("google/gemma-3-12b-pt",)),
    RegistryEntry("google/gemma-3-27b-it", _gemma3_multimodal(5376, 21504, 62, 32, 16, 128),
                  ("google/gemma-3-27b-pt",)),
    # DeepSeek-V3: MLA, 256 routed experts, shipped in block-scaled fp8.
    RegistryEntry("deepseek-ai/DeepSeek-V3", _DEEPSEEK_V3,
                  ("deepseek-ai/DeepSeek-V3-0324", "deepseek-ai/DeepSeek-V3-Base", "deepseek-ai/DeepSeek-R1",
                   "deepseek-ai/DeepSeek-R1-0528"),
                  note="the MTP module (layer 61) is in the checkpoint but only loaded for speculative decoding"),
    # Phi.
    RegistryEntry("microsoft/Phi-3-mini-4k-instruct",
                  _phi3(3072, 8192, 32, 32, 32, 32064, 4096, sliding_window=2047)),
    RegistryEntry("microsoft/Phi-3.5-mini-instruct",
                  _phi3(3072, 8192, 32, 32, 32, 32064, 131072, sliding_window=262144)),
    RegistryEntry("microsoft/phi-4", _phi3(5120, 17920, 40, 40, 10, 100352, 16384)),
    # SmolLM2.
    RegistryEntry("HuggingFaceTB/SmolLM2-135M-Instruct",
                  _llama(576, 1536, 30, 9, 3, 49152, 8192, tie=True, head_dim=64),
                  ("HuggingFaceTB/SmolLM2-135M",)),
    RegistryEntry("HuggingFaceTB/SmolLM2-360M-Instruct",
                  _llama(960, 2560, 32, 15, 5, 49152, 8192, tie=True, head_dim=64),
                  ("HuggingFaceTB/SmolLM2-360M",)),
    RegistryEntry("HuggingFaceTB/SmolLM2-1.7B-Instruct",
                  _llama(2048, 8192, 24, 32, 32, 49152, 8192, tie=True, head_dim=64),
                  ("HuggingFaceTB/SmolLM2-1.7B",)),
)


def _lookup_keys(entry: RegistryEntry) -> list[str]:
    keys = []
    for repo_id in (entry.repo_id, *entry.aliases):
        keys += [repo_id.lower(), repo_id.split("/")[-1].lower()]
    return keys


def _index() -> dict[str, RegistryEntry]:
    index: dict[str, RegistryEntry] = {}
    for entry in REGISTRY:
        for key in _lookup_keys(entry):
            index.setdefault(key, entry)
    return index


_INDEX = _index()


def find_entry(model_id: str) -> RegistryEntry:
    """Look up by repo id or by the name after the slash, case-insensitively; else list close matches."""
    entry = _INDEX.get(model_id.strip().lower())
    if entry is None:
        raise PlannerError(_unknown_model_message(model_id))
    return entry


def registry_spec(model_id: str) -> ModelSpec:
    entry = find_entry(model_id)
    spec = spec_from_hf_config(entry.config, source=f"{entry.repo_id} (built-in registry)", name=entry.repo_id)
    return spec


def close_matches(model_id: str, limit: int = 5) -> list[str]:
    query = model_id.strip().lower()
    keys = list(_INDEX)
    candidates = difflib.get_close_matches(query, keys, n=limit * 3, cutoff=0.6)
    candidates += [key for key in keys if query and query.split("/")[-1] in key]
    matches: list[str] = []
    for key in candidates:
        repo_id = _INDEX[key].repo_id
        if repo_id not in matches:
            matches.append(repo_id)
    return matches[:limit]


def _unknown_model_message(model_id: str) -> str:
    matches = close_matches(model_id)
    hint = f"close matches: {', '.join(matches)}" if matches else "run `kvserve plan --table` to list the registry"
    return (
        f"unknown model {model_id!r}: not a local folder, config.json or .gguf file, and not in the built-in "
        f"registry ({len(REGISTRY)} models); {hint}"
    )
