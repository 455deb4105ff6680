"""Gemma 3's decoder (Gemma3ForCausalLM, text only), built from the Llama family's pieces (llama.py).

What differs from Llama, as transformers' modeling_gemma3 computes it:
- every RMSNorm multiplies by (1 + weight), in fp32, and rounds once at the end (GGUF files store 1 + weight:
  gguf_file.py subtracts the 1 as transformers does, so both sources hold the checkpoint's own weight);
- q and k are normalized per head (over head_dim) before rotary;
- four norms a layer: the attention output and the MLP output are each normalized before their residual add;
- the token embedding is scaled by sqrt(hidden_size), rounded to the model's dtype;
- the MLP is down(gelu_tanh(gate(x)) * up(x)); attention scales scores by query_pre_attn_scalar ** -0.5;
- sliding layers rotate with their own base (rope_local_base_freq, unscaled), full layers with rope_theta and
  rope_scaling: two rotary tables, each layer reads its kind's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.config import ModelConfig, RopeScaling
from kvserve.model.attention import AttentionMetadata
from kvserve.model.layers import GatedMLP, RMSNorm, linear
from kvserve.model.llama import ForwardStep, LlamaForCausalLM, SelfAttention
from kvserve.model.rotary import RotaryEmbedding
from kvserve.model.tensor_parallel import WHOLE_MODEL, TensorShard, all_reduce


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in fp32, rounded once to x's dtype."""

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        scale = 1.0 + self.weight.float()
        if kernels is not None and x.dtype == torch.float32:
            # In fp32 the fused kernel rounds where this does (once, after the product).
            return kernels.rms_norm(x.contiguous(), scale, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale).to(x.dtype)


class GeluGatedMLP(GatedMLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor, kernels=None) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj).split(self.intermediate_size, dim=-1)
        return linear(F.gelu(gate, approximate="tanh") * up, self.down_proj)


class Gemma3Attention(SelfAttention):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TensorShard = WHOLE_MODEL,
                 weight_dtype: torch.dtype | None = None, layer_index: int = 0) -> None:
        super().__init__(config, dtype, shard, weight_dtype, layer_index, scale=config.query_pre_attn_scalar**-0.5)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)


class Gemma3DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TensorShard = WHOLE_MODEL,
                 weight_dtype: torch.dtype | None = None, layer_index: int = 0) -> None:
        super().__init__()
        self.shard = shard
        self.is_sliding = config.layer_window(layer_index) is not None
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = Gemma3Attention(config, dtype, shard, weight_dtype, layer_index)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GeluGatedMLP(hidden, config.intermediate_size // shard.size, weight_dtype or dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def forward(self, x: torch.Tensor, step: ForwardStep, kv_cache: object | None) -> torch.Tensor:
        kernels = step.kernels
        attended = self.self_attn(self.input_layernorm(x, kernels), step, kv_cache)
        x = x + self.post_attention_layernorm(attended, kernels)
        # The MLP's partial sums are reduced before its output norm, which is not linear.
        mlp_out = all_reduce(self.mlp(self.pre_feedforward_layernorm(x, kernels), kernels), self.shard)
        return x + self.post_feedforward_layernorm(mlp_out, kernels)


class Gemma3ForCausalLM(LlamaForCausalLM):
    decoder_layer_class = Gemma3DecoderLayer
    norm_class = GemmaRMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TensorShard = WHOLE_MODEL,
                 weight_dtype: torch.dtype | None = None) -> None:
        super().__init__(config, dtype, shard, weight_dtype)
        # self.rotary (rope_theta, rope_scaling) serves the full layers; the sliding layers get their own table.
        self.local_rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                            config.rope_local_base_freq, RopeScaling())
        # HF multiplies by sqrt(hidden) rounded to the weights' dtype.
        self.embed_scale = float(torch.tensor(config.hidden_size**0.5).to(dtype))

    def rotary_of(self, layer_index: int) -> RotaryEmbedding:
        return self.local_rotary if self.layers[layer_index].is_sliding else self.rotary

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(input_ids) * self.embed_scale

    def _run_layers(self, x: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                    kv_caches: list | None, kernels) -> torch.Tensor:
        full = ForwardStep(positions, metadata, self.rotary, kernels)
        sliding = ForwardStep(positions, metadata, self.local_rotary, kernels)
        for i, layer in enumerate(self.layers):
            x = layer(x, sliding if layer.is_sliding else full, None if kv_caches is None else kv_caches[i])
        return x
