"""The Llama-family decoder (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM); gemma3.py builds on it.

The three differ only in configuration: Qwen2 adds q/k/v biases, Mistral a sliding window, Llama 3 a rope
scaling. Tokens arrive flat ([num_tokens]) with their positions, so one forward can mix sequences in prefill
and decode; how they split into sequences is the attention metadata's business.
"""

from __future__ import annotations

import torch

from kvserve.config import ModelConfig
from kvserve.model.attention import Attention, AttentionMetadata
from kvserve.model.layers import GatedMLP, PackedWeight, RMSNorm, empty_parameter, linear, tensor_bytes
from kvserve.model.quant_weight import QuantWeight, dense_weight
from kvserve.model.rotary import RotaryEmbedding, apply_rotary
from kvserve.model.tensor_parallel import WHOLE_MODEL, TensorShard, all_reduce, embed, gather_logits


class SelfAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TensorShard = WHOLE_MODEL,
                 weight_dtype: torch.dtype | None = None, layer_index: int = 0, scale: float | None = None) -> None:
        super().__init__()
        self.shard = shard
        self.num_heads, self.num_kv_heads = shard.heads(config)  # this rank's share (all of them at TP 1)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v fused into one matmul; the loader writes each checkpoint tensor into its rows.
        weight_dtype = weight_dtype or dtype
        self.qkv_proj = empty_parameter(self.q_size + 2 * self.kv_size, config.hidden_size, dtype=weight_dtype)
        self.qkv_bias = empty_parameter(self.q_size + 2 * self.kv_size, dtype=dtype) if config.attention_bias else None
        self.o_proj = empty_parameter(config.hidden_size, self.q_size, dtype=weight_dtype)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, config.layer_window(layer_index),
                              scale)
        # Per-head norms of q and k before rotary (Gemma 3), each over head_dim; None: none.
        self.q_norm: torch.nn.Module | None = None
        self.k_norm: torch.nn.Module | None = None

    def forward(self, x: torch.Tensor, step: "ForwardStep", kv_cache: object | None) -> torch.Tensor:
        qkv = linear(x, self.qkv_proj, self.qkv_bias)
        num_tokens = x.shape[0]
        if self.q_norm is not None:
            self._norm_qk_(qkv, step.kernels)
        if step.kernels is not None:
            step.kernels.rotary_qk_(qkv, step.positions, step.rotary.cos_cache, step.rotary.sin_cache,
                                    self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        if step.kernels is None:
            cos, sin = step.cos_sin(x.dtype)
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, kv_cache, step.metadata)
        return all_reduce(linear(out, self.o_proj), self.shard)  # row-parallel: the ranks' partial sums

    def _norm_qk_(self, qkv: torch.Tensor, kernels) -> None:
        """Normalizes each q and k head of the fused activation in place (rotary then reads them there)."""
        num_tokens = qkv.shape[0]
        q = qkv[:, : self.q_size].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(num_tokens, self.num_kv_heads, self.head_dim)
        q.copy_(self.q_norm(q, kernels))
        k.copy_(self.k_norm(k, kernels))


class DecoderLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TensorShard = WHOLE_MODEL,
                 weight_dtype: torch.dtype | None = None, layer_index: int = 0) -> None:
        super().__init__()
        self.shard = shard
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = SelfAttention(config, dtype, shard, weight_dtype, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size // shard.size, weight_dtype or dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, step: "ForwardStep", kv_cache: object | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, residual stream before adding it): the next layer's norm adds it,
        so each residual add fuses with the norm that follows it."""
        if residual is None:
            residual = x.clone()
            hidden = self.input_layernorm(x, step.kernels)
        else:
            hidden = self.input_layernorm.add_and_norm(x, residual, step.kernels)
        hidden = self.self_attn(hidden, step, kv_cache)
        hidden = self.post_attention_layernorm.add_and_norm(hidden, residual, step.kernels)
        return all_reduce(self.mlp(hidden, step.kernels), self.shard), residual


class LlamaForCausalLM(torch.nn.Module):
    # What a subclass (gemma3.py) changes: its layers and its norm.
    decoder_layer_class: type[torch.nn.Module] = DecoderLayer
    norm_class: type[RMSNorm] = RMSNorm

    def __init__(self, config: ModelConfig, dtype: torch.dtype, shard: TensorShard = WHOLE_MODEL,
                 weight_dtype: torch.dtype | None = None) -> None:
        """`dtype` computes; `weight_dtype` (default: `dtype`) holds the matmul weights and the token embedding:
        a 16-bit checkpoint computed in fp32 keeps them 16-bit, which only the CPU kernels read."""
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.shard = shard  # which tensor-parallel rank's slice of the weights this model holds
        weight_dtype = weight_dtype or dtype
        vocab_rows = shard.vocab_rows_per_rank(config.vocab_size)
        self.embed_tokens = _vocab_parameter(vocab_rows, config, weight_dtype)
        self.layers = torch.nn.ModuleList(self.decoder_layer_class(config, dtype, shard, weight_dtype, index)
                                          for index in range(config.num_hidden_layers))
        self.norm = self.norm_class(config.hidden_size, config.rms_norm_eps, dtype)
        # Tied checkpoints share the embedding matrix; the loader then never fills lm_head (None: the head reads
        # embed_tokens).
        self.lm_head = None if config.tie_word_embeddings else _vocab_parameter(vocab_rows, config, weight_dtype)
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling)
        # The C++ module for fused CPU ops, or None (portable torch); set by the loader.
        self.fused_kernels = None
        # fp8 KV scales a checkpoint carries (`model.layers.N.self_attn.k_scale` / `v_scale`): layer -> (k, v).
        self.checkpoint_kv_scales: dict[int, tuple[float | None, float | None]] = {}

    def rotary_of(self, layer_index: int) -> RotaryEmbedding:
        """The rotary table a layer's q and k turn by (one for every layer here)."""
        return self.rotary

    def hold_quant_weights(self, weights: dict[str, QuantWeight]) -> None:
        """Replaces parameters ("layers.0.mlp.gate_up_proj", "embed_tokens") by their checkpoint blocks, read in
        place from then on (quant_weight.py)."""
        for name, weight in weights.items():
            owner, _, attribute = name.rpartition(".")
            module = self.get_submodule(owner) if owner else self
            delattr(module, attribute)
            setattr(module, attribute, weight)

    def hold_dense_weights(self, packed: bool = False) -> None:
        """Every matmul weight still a plain tensor (a 16-bit or fp32 checkpoint's) is held once for the CPU
        kernels: as a QuantWeight over the same storage, read in place for every batch size
        (quant_weight.dense_weight), or with `packed` in oneDNN's layout alone (PackedWeight, the plain tensor
        freed). A plain token embedding on a whole model becomes a QuantWeight (its lookups read rows)."""
        kernels = self.fused_kernels
        for module, name in self._matmul_weights():
            weight = getattr(module, name)
            if isinstance(weight, torch.Tensor):
                weight = weight.detach()
                delattr(module, name)
                setattr(module, name, PackedWeight.of(weight) if packed else dense_weight(weight, kernels))
        if isinstance(self.embed_tokens, torch.Tensor) and self.shard.size == 1:
            embedding = self.embed_tokens.detach()
            del self.embed_tokens
            self.embed_tokens = dense_weight(embedding, kernels)

    def weight_bytes(self) -> int:
        """Bytes of every weight held: parameters and weights held otherwise (QuantWeight, PackedWeight)."""
        return sum(tensor_bytes(t) for t in self.parameters()) + sum(w.nbytes() for w in self._held_weights())

    def parameter_count(self) -> int:
        """The model's parameters, those held otherwise included."""
        return sum(p.numel() for p in self.parameters()) + sum(w.numel() for w in self._held_weights())

    def _held_weights(self) -> list[QuantWeight | PackedWeight]:
        """The weights held otherwise than as parameters, each once (a tied head is the embedding)."""
        held = [getattr(m, n) for m, n in self._matmul_weights()] + [self.embed_tokens]
        return list({id(w): w for w in held if isinstance(w, (QuantWeight, PackedWeight))}.values())

    def _matmul_weights(self):
        """(module, attribute) of each matmul weight; the head's is None while it reads the tied embedding."""
        for layer in self.layers:
            yield from ((layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"), (layer.mlp, "gate_up_proj"),
                        (layer.mlp, "down_proj"))
        if self.lm_head is not None:
            yield self, "lm_head"

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        metadata: AttentionMetadata,
        kv_caches: list | None = None,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits in the model's dtype for the tokens at `logits_indices` (all tokens when None); a consumer that
        needs fp32 converts the rows it uses (a batch's [rows, vocab] copy is a large fresh allocation). Under
        tensor parallelism only rank 0 gets them; the other ranks return None."""
        x = self._embed(input_ids)
        kernels = self.fused_kernels if x.device.type == "cpu" else None
        x = self._run_layers(x, positions, metadata, kv_caches, kernels)
        return self._logits(x, logits_indices, kernels)

    def _run_layers(self, x: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata,
                    kv_caches: list | None, kernels) -> torch.Tensor:
        """The residual stream after the last layer."""
        step = ForwardStep(positions, metadata, self.rotary, kernels)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, step, None if kv_caches is None else kv_caches[i])
        return residual.add_(x)

    def _logits(self, x: torch.Tensor, logits_indices: torch.Tensor | None, kernels) -> torch.Tensor | None:
        """The final norm and the head over the residual stream's rows at `logits_indices` (all when None)."""
        if logits_indices is not None:
            x = x.index_select(0, logits_indices)
        x = self.norm(x.contiguous(), kernels)
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return gather_logits(linear(x, head), self.config.vocab_size, self.shard)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.embed_tokens, QuantWeight):  # held as blocks only by a whole model (one rank)
            return self.embed_tokens.lookup(input_ids, self.dtype)
        return embed(input_ids, self.embed_tokens, self.config.vocab_size, self.shard)


def _vocab_parameter(rows: int, config: ModelConfig, dtype: torch.dtype) -> torch.nn.Parameter:
    if rows == config.vocab_size:
        return empty_parameter(rows, config.hidden_size, dtype=dtype)
    # A vocabulary split unevenly: the last rank's padding rows stay zero (their logits are cut off).
    return torch.nn.Parameter(torch.zeros(rows, config.hidden_size, dtype=dtype), requires_grad=False)


class ForwardStep:
    """What every layer of one forward shares: positions, attention metadata, rotary tables, fused kernels."""

    __slots__ = ("positions", "metadata", "rotary", "kernels", "_cos_sin")

    def __init__(self, positions: torch.Tensor, metadata: AttentionMetadata, rotary: RotaryEmbedding, kernels) -> None:
        self.positions = positions
        self.metadata = metadata
        self.rotary = rotary
        self.kernels = kernels  # the C++ module, or None for the portable torch path
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos_sin is None:
            self._cos_sin = self.rotary.cos_sin(self.positions, dtype)
        return self._cos_sin
