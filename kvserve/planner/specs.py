"""ModelSpec: the architecture numbers the planner needs, parsed from a Hugging Face config.json.

Everything else (registry entries, GGUF metadata) is written as or translated into a config.json dict first, so
there is one parser and the registry's numbers are checked by the same code that reads a user's folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.planner.checkpoint import CheckpointWeights
from kvserve.planner.errors import PlannerError
from kvserve.planner.quant import WeightQuant, quant_from_config

# Model types whose checkpoints omit `tie_word_embeddings` because their config class defaults it to True.
_TIED_BY_DEFAULT = ("gemma", "gemma2", "gemma3", "gemma3_text")
# Gemma 2/3 wrap attention and MLP in pre- and post-norms: four RMSNorm vectors per layer instead of two.
_FOUR_NORM_TYPES = ("gemma2", "gemma3", "gemma3_text")
# Per-head RMSNorm on q and k (Qwen3, Gemma 3).
_QK_NORM_TYPES = ("qwen3", "qwen3_moe", "gemma3", "gemma3_text")
# Qwen2 projections carry q/k/v biases without saying so in config.json.
_QKV_BIAS_TYPES = ("qwen2", "qwen2_moe")
_QWEN_WINDOW_TYPES = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")
_MLA_TYPES = ("deepseek_v2", "deepseek_v3")
# Keys that multimodal text_configs leave at their config-class default.
_TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "head_dim": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
    },
}
_REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """One decoder-only transformer, as far as memory is concerned.

    `head_dim` is taken from config.json when given (Gemma: 256 with hidden 3584 / 16 heads = 224), never
    assumed to be hidden / heads. For MLA models (DeepSeek-V2/V3) `num_kv_heads` and `head_dim` describe the
    query side only; the KV cache is one latent of `kv_lora_rank + qk_rope_head_dim` per layer (see kv.py).
    """

    name: str
    source: str
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    sliding_window: int | None = None
    windowed_layers: tuple[int, ...] = ()
    # Mixture of experts. Layers below `first_dense_layers` use a dense MLP of `intermediate_size`.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    first_dense_layers: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3).
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    # DeepSeek multi-token-prediction modules: in the checkpoint, loaded only for speculative decoding.
    num_mtp_layers: int = 0
    dtype: str | None = None
    quantization: WeightQuant | None = None
    quantization_note: str = ""
    # Parameters outside the decoder (a vision encoder) that are loaded with the model.
    extra_params: int = 0
    extra_params_note: str = ""
    checkpoint: CheckpointWeights | None = None

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def has_windowed_layers(self) -> bool:
        return bool(self.windowed_layers)

    def layer_window(self, layer_index: int) -> int | None:
        """The sliding window of one layer, or None for full attention."""
        return self.sliding_window if layer_index in self.windowed_layers else None

    def is_moe_layer(self, layer_index: int) -> bool:
        return self.is_moe and layer_index >= self.first_dense_layers

    @property
    def attention_kind(self) -> str:
        if self.is_mla:
            return "MLA"
        if self.num_kv_heads == 1:
            return "MQA"
        return "GQA" if self.num_kv_heads < self.num_attention_heads else "MHA"


def spec_from_hf_config(config: dict[str, Any], source: str = "config.json", name: str | None = None) -> ModelSpec:
    """Parse a Hugging Face config.json dict (text-only or multimodal with a `text_config`)."""
    if not isinstance(config, dict):
        raise PlannerError(f"{source}: expected a JSON object, got {type(config).__name__}")
    text = _text_config(config)
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    missing = [key for key in _REQUIRED_KEYS if text.get(key) is None]
    if missing:
        raise PlannerError(f"{source}: missing required key(s) {', '.join(missing)} (is this a decoder LLM config?)")
    num_layers = _positive_int(text, "num_hidden_layers", source)
    hidden = _positive_int(text, "hidden_size", source)
    heads = _positive_int(text, "num_attention_heads", source)
    kv_heads = _positive_int(text, "num_key_value_heads", source, default=heads)
    head_dim = _positive_int(text, "head_dim", source, default=hidden // heads)
    max_positions = _positive_int(text, "max_position_embeddings", source, default=4096)
    window, windowed = sliding_window_layers(text, model_type, num_layers, max_positions)
    quant, quant_note = quant_from_config(config.get("quantization_config") or text.get("quantization_config"))
    extra_params, extra_note = _vision_params(config, hidden)
    architectures = config.get("architectures") or text.get("architectures") or [f"<model_type {model_type}>"]
    spec = ModelSpec(
        name=name or source,
        source=source,
        architecture=str(architectures[0]),
        model_type=model_type,
        num_layers=num_layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=_positive_int(text, "intermediate_size", source, default=4 * hidden),
        vocab_size=_positive_int(text, "vocab_size", source),
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(
            config.get("tie_word_embeddings", text.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT))
        ),
        attention_bias=model_type in _QKV_BIAS_TYPES or bool(text.get("attention_bias", text.get("qkv_bias", False))),
        qk_norm=model_type in _QK_NORM_TYPES,
        norms_per_layer=4 if model_type in _FOUR_NORM_TYPES else 2,
        sliding_window=window,
        windowed_layers=windowed,
        dtype=_dtype_name(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype")),
        quantization=quant,
        quantization_note=quant_note,
        extra_params=extra_params,
        extra_params_note=extra_note,
        **_moe_fields(text, source),
        **_mla_fields(text, model_type, source),
    )
    _check_consistency(spec, source)
    return spec


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    defaults = _TEXT_CONFIG_DEFAULTS.get(str(text.get("model_type", "")), {})
    return {**defaults, **text}


def _positive_int(cfg: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    raw = cfg.get(key)
    if raw is None:
        if default is None:
            raise PlannerError(f"{source}: missing required key {key!r}")
        return default
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or int(raw) != raw or raw <= 0:
        raise PlannerError(f"{source}: {key} must be a positive integer, got {raw!r}")
    return int(raw)


def _dtype_name(raw: Any) -> str | None:
    return str(raw).removeprefix("torch.") if raw else None


def sliding_window_layers(
    cfg: dict[str, Any], model_type: str, num_layers: int, max_positions: int
) -> tuple[int | None, tuple[int, ...]]:
    """(window, indices of windowed layers). A window at least as long as the context never binds: dropped."""
    window = cfg.get("sliding_window") or cfg.get("sliding_window_size")
    if not window or cfg.get("use_sliding_window") is False:
        return None, ()
    window = int(window)
    if window >= max_positions:
        return None, ()
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        layers = tuple(i for i, kind in enumerate(layer_types) if kind == "sliding_attention")
    elif model_type in _QWEN_WINDOW_TYPES:
        first_windowed = int(cfg.get("max_window_layers", num_layers))
        layers = tuple(range(first_windowed, num_layers))
    elif model_type == "gemma2":
        layers = tuple(i for i in range(num_layers) if i % 2 == 0)
    elif model_type in ("gemma3", "gemma3_text"):
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layers = tuple(i for i in range(num_layers) if (i + 1) % pattern != 0)
    else:
        # Mistral v0.1, Phi-3 and others apply the window on every layer.
        layers = tuple(range(num_layers))
    return (window, layers) if layers else (None, ())


def _moe_fields(cfg: dict[str, Any], source: str) -> dict[str, int]:
    num_experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0)
    if num_experts == 0:
        return {}
    top_k = int(cfg.get("num_experts_per_tok") or cfg.get("num_experts_per_token") or 0)
    if not 0 < top_k <= num_experts:
        raise PlannerError(f"{source}: num_experts_per_tok {top_k} must be in 1..{num_experts}")
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        # Mixtral has no separate expert size: each expert is a full-width MLP.
        "moe_intermediate_size": _positive_int(cfg, "moe_intermediate_size", source,
                                               default=cfg.get("intermediate_size")),
        "num_shared_experts": int(cfg.get("n_shared_experts") or 0),
        "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0),
        "first_dense_layers": int(cfg.get("first_k_dense_replace") or 0),
    }


def _mla_fields(cfg: dict[str, Any], model_type: str, source: str) -> dict[str, int]:
    if not cfg.get("kv_lora_rank") and model_type not in _MLA_TYPES:
        return {}
    return {
        "kv_lora_rank": _positive_int(cfg, "kv_lora_rank", source),
        "q_lora_rank": int(cfg.get("q_lora_rank") or 0),
        "qk_rope_head_dim": _positive_int(cfg, "qk_rope_head_dim", source),
        "qk_nope_head_dim": _positive_int(cfg, "qk_nope_head_dim", source),
        "v_head_dim": _positive_int(cfg, "v_head_dim", source),
        "num_mtp_layers": int(cfg.get("num_nextn_predict_layers") or 0),
    }


def _vision_params(config: dict[str, Any], text_hidden: int) -> tuple[int, str]:
    """Parameters of a ViT vision encoder + projector (Gemma 3's SigLIP), estimated from `vision_config`.

    Multimodal checkpoints load the vision tower with the language model, so it costs memory even for text.
    """
    vision = config.get("vision_config")
    if not isinstance(vision, dict) or not vision.get("hidden_size"):
        return 0, ""
    width, layers = int(vision["hidden_size"]), int(vision.get("num_hidden_layers", 0))
    mlp = int(vision.get("intermediate_size", 4 * width))
    patch, image = int(vision.get("patch_size", 14)), int(vision.get("image_size", 224))
    channels = int(vision.get("num_channels", 3))
    per_layer = 4 * (width * width + width) + 2 * width * mlp + mlp + width + 4 * width
    embeddings = channels * patch * patch * width + width + (image // patch) ** 2 * width
    projector = width * text_hidden + width
    total = layers * per_layer + embeddings + 2 * width + projector
    return total, f"vision encoder ({layers} layers x {width} wide, estimated from vision_config)"


def _check_consistency(spec: ModelSpec, source: str) -> None:
    if spec.num_attention_heads % spec.num_kv_heads != 0:
        raise PlannerError(
            f"{source}: num_attention_heads {spec.num_attention_heads} is not a multiple of "
            f"num_key_value_heads {spec.num_kv_heads}"
        )
