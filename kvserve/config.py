"""Configuration dataclasses shared by the model layer, the engine and the server.

`ModelConfig` is the architecture as the model layer needs it, parsed from a Hugging Face `config.json`
dict (GGUF metadata is translated into the same dict first, so there is one parser).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.planner.kv import KV_CACHE_DTYPES
from kvserve.planner.specs import sliding_window_layers

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM")
# Multimodal checkpoints whose language model kvserve serves alone: the text model's config is `text_config`,
# its weights those under the language model's prefix (loader._HFSource renames them).
TEXT_MODEL_OF = {"Gemma3ForConditionalGeneration": "Gemma3ForCausalLM"}


class ModelLoadError(ValueError):
    """A checkpoint cannot be loaded; the message names the file and the thing that is wrong."""


@dataclass(slots=True)
class RopeScaling:
    rope_type: str = "default"  # "default" | "llama3" | "linear"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    sliding_window: int | None = None
    windowed_layers: tuple[int, ...] = ()  # the layers that attend over `sliding_window` tokens (the rest: all)
    torch_dtype: str | None = None  # the checkpoint's own dtype name, for --dtype auto
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # Gemma 3: attention scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); the sliding layers' own
    # rope base (None: every layer rotates with rope_theta and rope_scaling); the MLP's activation.
    query_pre_attn_scalar: float | None = None
    rope_local_base_freq: float | None = None
    hidden_activation: str = "silu"

    def layer_window(self, layer_index: int) -> int | None:
        """The sliding window of one layer, or None where it attends over the whole context."""
        return self.sliding_window if layer_index in self.windowed_layers else None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        architectures = cfg.get("architectures") or []
        arch = architectures[0] if architectures else _arch_from_model_type(cfg.get("model_type"))
        if arch in TEXT_MODEL_OF:
            if not isinstance(cfg.get("text_config"), dict):
                raise ModelLoadError(f"{source}: {arch} without a text_config; kvserve serves its language model")
            cfg, arch = cfg["text_config"], TEXT_MODEL_OF[arch]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"{source}: unsupported architecture {arch!r}; kvserve loads {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if key not in cfg:
                raise ModelLoadError(f"{source}: missing required key {key!r}")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        num_layers = int(cfg["num_hidden_layers"])
        window, windowed = sliding_window_layers(cfg, str(cfg.get("model_type") or ""), num_layers,
                                                 int(cfg.get("max_position_embeddings", 4096)))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([int(eos)] if isinstance(eos, int) else [int(e) for e in eos])
        gemma3 = arch == "Gemma3ForCausalLM"
        if gemma3:
            _check_gemma3(cfg, source)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_param(cfg, "rope_theta", GEMMA3_ROPE_THETA if gemma3 else 10000.0)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma3)),  # Gemma 3 ties them unless it says
            attention_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            rope_scaling=_parse_rope_scaling(cfg, source),
            sliding_window=window,
            windowed_layers=windowed,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or head_dim) if gemma3 else None,
            rope_local_base_freq=_local_rope_theta(cfg, source) if gemma3 else None,
            hidden_activation="gelu_pytorch_tanh" if gemma3 else "silu",
        )


_MODEL_TYPE_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM", "gemma3": "Gemma3ForConditionalGeneration",
}


def _arch_from_model_type(model_type: str | None) -> str:
    return _MODEL_TYPE_ARCHITECTURES.get(model_type or "", f"<model_type {model_type!r}>")


GEMMA3_ROPE_THETA = 1_000_000.0  # transformers' defaults when a Gemma 3 config names no rope base
GEMMA3_LOCAL_ROPE_THETA = 10_000.0
HYBRID_ROPE_SECTIONS = ("full_attention", "sliding_attention")


def _check_gemma3(cfg: dict[str, Any], source: str) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ModelLoadError(f"{source}: {key} = {cfg[key]}; Gemma 3 has no logit soft-capping and kvserve "
                                 "does not compute it (Gemma 2 checkpoints are not supported)")
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ModelLoadError(f"{source}: hidden_activation {activation!r}; kvserve's Gemma 3 computes gelu_pytorch_tanh")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention (an embedding model); kvserve serves causal "
                             "language models")


def _rope_section(cfg: dict[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """The rope parameters one kind of layer rotates with. transformers 5 writes `rope_parameters`, per layer
    type where layers differ (Gemma 3: {"full_attention": {...}, "sliding_attention": {...}}); older configs
    keep rope_theta and rope_scaling at the top level."""
    params = cfg.get("rope_parameters") or {}
    if any(key in params for key in HYBRID_ROPE_SECTIONS):
        return params.get(layer_type) or {}
    return params


def _rope_param(cfg: dict[str, Any], key: str, default: Any) -> Any:
    return _rope_section(cfg).get(key, cfg.get(key, default))


def _local_rope_theta(cfg: dict[str, Any], source: str) -> float:
    """Gemma 3's sliding layers: their own base, never scaled (transformers applies rope_scaling to the full
    layers only)."""
    section = _rope_section(cfg, "sliding_attention") if cfg.get("rope_parameters") else {}
    rope_type = section.get("rope_type", "default") or "default"
    if rope_type != "default":
        raise ModelLoadError(f"{source}: sliding layers with rope_type {rope_type!r}; kvserve rotates them unscaled")
    return float(section.get("rope_theta") or cfg.get("rope_local_base_freq") or GEMMA3_LOCAL_ROPE_THETA)


def _parse_rope_scaling(cfg: dict[str, Any], source: str) -> RopeScaling:
    raw = cfg.get("rope_scaling") or _rope_section(cfg)
    rope_type = raw.get("rope_type", raw.get("type", "default")) or "default"
    if rope_type not in ("default", "llama3", "linear"):
        raise ModelLoadError(f"{source}: unsupported rope_scaling type {rope_type!r} (kvserve: default, llama3, linear)")
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "xxh3_128"
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = False  # fp8: per-layer scales from the start-up calibration text instead of 1.0 (vLLM's flag)
    kv_offloading_size: float | None = None  # GiB of host memory for blocks evicted from the pool (vLLM's flag)
    kv_offloading_backend: str = "native"
    kv_disk_path: str | None = None  # a disk tier below the host tier, kept across restarts
    kv_disk_size: float = 10.0  # GiB
    kv_disk_save_timeout: float = 30.0  # seconds shutdown may spend saving the pool to the disk tier
    kv_idle_offload_seconds: float | None = None  # sessions idle this long leave the pool for the tiers
    kv_cache_memory: float | None = None  # GiB for the pool on CPU (vLLM's VLLM_CPU_KVCACHE_SPACE); None: default
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    scheduling_policy: str = "fcfs"
    max_waiting_requests: int | None = None


@dataclass(slots=True)
class ParallelConfig:
    tensor_parallel_size: int = 1


GGUF_WEIGHTS = ("blocks", "dequantized")
ATTENTION_BACKENDS = ("auto", "cpu", "triton", "torch")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    disable_cascade_attn: bool = False  # vLLM's flag: decodes sharing prefix blocks read them each on their own
    # vLLM's flag: one block table for every layer, sliding-window layers keeping every token's K/V as the others do
    disable_hybrid_kv_cache_manager: bool = False
    gguf_weights: str = "blocks"  # blocks: held as the file's blocks; dequantized: to bf16/fp32 at load
    attention_backend: str = "auto"  # vLLM's flag: auto | cpu | triton | torch (model/attention_backend.py)
    enforce_eager: bool = False  # vLLM's flag: no CUDA graphs for decode steps
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def _validate_tiers(self) -> None:
        cache = self.cache
        if cache.kv_offloading_size is not None and cache.kv_offloading_size <= 0:
            raise ValueError(f"--kv-offloading-size must be > 0 GiB, got {cache.kv_offloading_size}")
        if cache.kv_offloading_backend != "native":
            raise ValueError(f"--kv-offloading-backend {cache.kv_offloading_backend!r}: kvserve has 'native'")
        if cache.kv_disk_size <= 0:
            raise ValueError(f"--kv-disk-size must be > 0 GiB, got {cache.kv_disk_size}")
        if cache.kv_disk_save_timeout < 0:
            raise ValueError(f"--kv-disk-save-timeout must be >= 0 seconds, got {cache.kv_disk_save_timeout}")
        tiers = cache.kv_offloading_size is not None or cache.kv_disk_path is not None
        if tiers and not cache.enable_prefix_caching:
            raise ValueError("the KV tiers (--kv-offloading-size, --kv-disk-path) find blocks by their prefix hash: "
                             "they need prefix caching (drop --no-enable-prefix-caching)")
        if cache.kv_idle_offload_seconds is not None:
            if cache.kv_idle_offload_seconds <= 0:
                raise ValueError(f"--kv-idle-offload-seconds must be > 0, got {cache.kv_idle_offload_seconds}")
            if not tiers:
                raise ValueError("--kv-idle-offload-seconds moves idle sessions' blocks to a KV tier: give "
                                 "--kv-offloading-size or --kv-disk-path too")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: Any) -> "EngineConfig":
        """Engine args named like the CLI flags (max_num_seqs, block_size, kv_cache_memory, ...)."""
        config = cls(model=model)
        sections = (config, config.cache, config.scheduler, config.parallel)
        for key, value in kwargs.items():
            owner = next((s for s in sections if key in s.__dataclass_fields__ and key not in ("cache", "scheduler", "parallel")), None)
            if owner is None:
                raise TypeError(f"unknown engine argument {key!r}")
            setattr(owner, key, value)
        config.validate()
        return config

    def validate(self) -> None:
        cache, sched = self.cache, self.scheduler
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                             f"got {self.attention_backend!r}")
        if self.gguf_weights not in GGUF_WEIGHTS:
            raise ValueError(f"--gguf-weights must be one of {', '.join(GGUF_WEIGHTS)}, got {self.gguf_weights!r}")
        if cache.block_size <= 0 or cache.block_size > 1024:
            raise ValueError(f"block_size must be in 1..1024, got {cache.block_size}")
        if sched.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {sched.max_num_seqs}")
        if sched.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {sched.max_num_batched_tokens}")
        if sched.max_model_len is not None and sched.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {sched.max_model_len}")
        if not 0 < cache.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {cache.gpu_memory_utilization}")
        if cache.kv_cache_memory is not None and cache.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {cache.kv_cache_memory}")
        if cache.num_gpu_blocks_override is not None and cache.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override must be >= 1, got {cache.num_gpu_blocks_override}")
        if sched.scheduling_policy not in ("fcfs", "lpm"):
            raise ValueError(f"scheduling_policy must be fcfs or lpm, got {sched.scheduling_policy!r}")
        if self.parallel.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, got {self.parallel.tensor_parallel_size}")
        self._validate_tiers()
        if cache.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"--kv-cache-dtype {cache.kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
