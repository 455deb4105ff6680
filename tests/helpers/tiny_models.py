"""Small random Llama / Qwen2 / Mistral / Gemma 3 checkpoints built with transformers (fixed seeds), saved as HF folders.

These are the reference models of the test suite: kvserve must compute what transformers computes on them.
"""

from __future__ import annotations

from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def forward(self, x):\n    return x * 2\n",
    "KV caches hold the keys and values of every past token.",
    "Paged attention reads blocks through a block table.",
] * 20

BASE = dict(
    vocab_size=384, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
    initializer_range=0.25,  # large enough that attention is peaked, so rope and masks visibly matter
)

ARCHITECTURES = {
    "llama": dict(tie_word_embeddings=False, rope_theta=10000.0),
    "llama3": dict(
        tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64},
    ),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    "mistral": dict(tie_word_embeddings=False, rope_theta=10000.0, sliding_window=24),
    # Gemma 3: windows of 8 (prompts run several times past them), both layer kinds, per-kind rope bases; a
    # query_pre_attn_scalar unlike head_dim so the attention scale is visible. GQA 4:1 here, one KV head below
    # with linear rope scaling on the full layers (as Gemma 3 4B+ has).
    "gemma3": dict(
        tie_word_embeddings=True, num_hidden_layers=5, num_attention_heads=8, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                     "full_attention"],
        query_pre_attn_scalar=24, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 100000.0},
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}},
    ),
    "gemma3-mqa": dict(
        tie_word_embeddings=True, num_hidden_layers=7, num_attention_heads=4, num_key_value_heads=1, head_dim=64,
        sliding_window=12, sliding_window_pattern=3, query_pre_attn_scalar=64,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
    ),
}


def build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=BASE["vocab_size"], special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    backend.train_from_iterator(TOKENIZER_CORPUS, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(folder)


def build_model(kind: str, seed: int = 0, **overrides):
    import transformers

    config_classes = {
        "llama": transformers.LlamaConfig, "llama3": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config, "mistral": transformers.MistralConfig,
        "gemma3": transformers.Gemma3TextConfig, "gemma3-mqa": transformers.Gemma3TextConfig,
    }
    model_classes = {
        "llama": transformers.LlamaForCausalLM, "llama3": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM, "mistral": transformers.MistralForCausalLM,
        "gemma3": transformers.Gemma3ForCausalLM, "gemma3-mqa": transformers.Gemma3ForCausalLM,
    }
    config = config_classes[kind](**(BASE | ARCHITECTURES[kind] | overrides))
    torch.manual_seed(seed)
    model = model_classes[kind](config).to(torch.float32).eval()
    with torch.no_grad():
        # Random init leaves biases at zero; give Qwen2's q/k/v biases values so the test can see them.
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.1)
    return model


def save_model(kind: str, folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides):
    """`overrides`: config fields that differ from BASE (num_key_value_heads=1 for MQA, ...)."""
    model = build_model(kind, seed, **overrides)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    build_tokenizer(folder)
    return model
