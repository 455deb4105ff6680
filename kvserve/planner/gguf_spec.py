"""ModelSpec from a GGUF file: metadata translated into a config.json dict, weights summed from tensor infos.

Uses the `gguf` package's GGUFReader (numpy memory map; no tensor data is read, no torch). GGUF weights are
planned as stored (quantized), as vLLM serves them.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvserve.planner.checkpoint import CheckpointWeights
from kvserve.planner.errors import PlannerError
from kvserve.planner.quant import WeightQuant
from kvserve.planner.specs import ModelSpec, spec_from_hf_config

# GGUF `general.architecture` -> Hugging Face model_type (llama.cpp stores Mistral/Mixtral as "llama").
_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen2moe": "qwen2_moe",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "deepseek2": "deepseek_v3",
}
_FLOAT_TYPES = ("F32", "F16", "BF16")
_BLOCK_INDEX = re.compile(r"^blk\.(\d+)\.")


def spec_from_gguf(path: Path) -> ModelSpec:
    from gguf import GGUFReader  # numpy only; imported lazily so registry lookups stay fast

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise PlannerError(f"{path}: cannot read GGUF metadata ({exc})") from None
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    config = hf_config_from_gguf(lambda key: _field(reader, key), set(tensors), str(path))
    spec = spec_from_hf_config(config, source=str(path), name=str(path))
    checkpoint = _gguf_checkpoint(path, reader.tensors, spec.num_layers)
    return replace(spec, checkpoint=checkpoint, quantization=WeightQuant("gguf", bits=0))


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def hf_config_from_gguf(get: Any, tensor_names: set[str], source: str) -> dict[str, Any]:
    """GGUF metadata (via `get(key)`) -> the config.json keys specs.py reads."""
    arch = get("general.architecture")
    if arch not in _MODEL_TYPES:
        raise PlannerError(f"{source}: GGUF architecture {arch!r} is not supported "
                           f"(supported: {', '.join(sorted(_MODEL_TYPES))})")

    def meta(key: str) -> Any:
        return get(f"{arch}.{key}")

    model_type = _MODEL_TYPES[arch]
    num_blocks = _required(meta("block_count"), "block_count", source)
    num_layers = num_blocks - int(meta("nextn_predict_layers") or 0)
    config: dict[str, Any] = {
        "architectures": [f"gguf:{arch}"],
        "model_type": model_type,
        "num_hidden_layers": num_layers,
        "hidden_size": _required(meta("embedding_length"), "embedding_length", source),
        "intermediate_size": _largest(meta("feed_forward_length")),
        "num_attention_heads": _largest(_required(meta("attention.head_count"), "attention.head_count", source)),
        "num_key_value_heads": _largest(meta("attention.head_count_kv")),
        "head_dim": meta("attention.key_length"),
        "max_position_embeddings": meta("context_length"),
        "vocab_size": meta("vocab_size") or _vocab_size(get, source),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "sliding_window": meta("attention.sliding_window"),
    }
    config |= gguf_window_pattern(meta("attention.sliding_window_pattern"), num_layers)
    config |= _gguf_moe(meta, arch)
    if meta("attention.kv_lora_rank"):
        config |= _gguf_mla(meta)
    return {key: value for key, value in config.items() if value is not None}


def _required(value: Any, key: str, source: str) -> Any:
    if value is None:
        raise PlannerError(f"{source}: GGUF metadata lacks {key}")
    return value


def _largest(value: Any) -> Any:
    """Per-layer arrays (head counts that vary by layer) -> the largest, which bounds memory."""
    return max(value) if isinstance(value, list) else value


def _vocab_size(get: Any, source: str) -> int:
    tokens = get("tokenizer.ggml.tokens")
    if not tokens:
        raise PlannerError(f"{source}: GGUF metadata has neither vocab_size nor tokenizer.ggml.tokens")
    return len(tokens)


def gguf_window_pattern(pattern: Any, num_layers: int) -> dict[str, Any]:
    """`attention.sliding_window_pattern` (one flag a layer, or a period) as config.json keys."""
    if isinstance(pattern, list) and len(pattern) >= num_layers:
        return {"layer_types": ["sliding_attention" if flag else "full_attention" for flag in pattern[:num_layers]]}
    if isinstance(pattern, int) and pattern > 0:
        return {"sliding_window_pattern": pattern}
    return {}


def _gguf_moe(meta: Any, arch: str) -> dict[str, Any]:
    experts = meta("expert_count")
    if not experts:
        return {}
    return {
        "num_local_experts": experts,
        "num_experts_per_tok": meta("expert_used_count"),
        "moe_intermediate_size": meta("expert_feed_forward_length"),
        "n_shared_experts": meta("expert_shared_count") if arch == "deepseek2" else None,
        "shared_expert_intermediate_size": meta("expert_shared_feed_forward_length"),
        "first_k_dense_replace": meta("leading_dense_block_count"),
    }


def _gguf_mla(meta: Any) -> dict[str, Any]:
    rope = meta("rope.dimension_count")
    # Newer llama.cpp conversions store the absorbed-MLA lengths in key_length and the originals in *_mla.
    qk_head = meta("attention.key_length_mla") or meta("attention.key_length")
    v_head = meta("attention.value_length_mla") or meta("attention.value_length")
    return {
        "kv_lora_rank": meta("attention.kv_lora_rank"),
        "q_lora_rank": meta("attention.q_lora_rank"),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": qk_head - rope,
        "v_head_dim": v_head,
        "head_dim": qk_head,
    }


def _gguf_checkpoint(path: Path, tensors: list[Any], num_layers: int) -> CheckpointWeights:
    float_params = fixed_bytes = stored_bytes = skipped_bytes = 0
    for tensor in tensors:
        match = _BLOCK_INDEX.match(tensor.name)
        if match and int(match.group(1)) >= num_layers:
            skipped_bytes += int(tensor.n_bytes)
            continue
        stored_bytes += int(tensor.n_bytes)
        if tensor.tensor_type.name in _FLOAT_TYPES:
            float_params += int(tensor.n_elements)
        else:
            fixed_bytes += int(tensor.n_bytes)
    return CheckpointWeights(path.name, float_params, fixed_bytes, stored_bytes, skipped_bytes, len(tensors))
