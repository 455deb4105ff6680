"""The Llama-family decoder (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM).

The three differ only in configuration: Qwen2 adds q/k/v biases, Mistral a sliding window, Llama 3 a rope
scaling. Tokens arrive flat ([num_tokens]) with their positions, so one forward can mix sequences in prefill
and decode; how they split into sequences is the attention metadata's business.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig
from kvserve.model.attention import Attention, AttentionMetadata
from kvserve.model.layers import GatedMLP, RMSNorm, empty_parameter
from kvserve.model.rotary import RotaryEmbedding, apply_rotary


class SelfAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v fused into one matmul; the loader writes each checkpoint tensor into its rows.
        self.qkv_proj = empty_parameter(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=dtype)
        self.qkv_bias = empty_parameter(self.q_size + 2 * self.kv_size, dtype=dtype) if config.attention_bias else None
        self.o_proj = empty_parameter(config.hidden_size, self.q_size, dtype=dtype)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, config.sliding_window)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: object | None,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        num_tokens = x.shape[0]
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), *cos_sin)
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), *cos_sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, metadata)
        return F.linear(out, self.o_proj)


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(self, x, cos_sin, kv_cache, metadata):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = empty_parameter(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = torch.nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        # Tied checkpoints share the embedding matrix; the loader then never fills lm_head.
        self.lm_head = None if config.tie_word_embeddings else empty_parameter(config.vocab_size, config.hidden_size, dtype=dtype)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        kv_caches: list | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits in fp32 for the tokens at `logits_indices` (all tokens when None)."""
        x = F.embedding(input_ids, self.embed_tokens)
        cos_sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos_sin, None if kv_caches is None else kv_caches[i], metadata)
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        x = self.norm(x)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return F.linear(x, head).float()
