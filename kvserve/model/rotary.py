"""Rotary position embeddings (rotate-half layout, as in Hugging Face checkpoints), with llama3/linear scaling."""

from __future__ import annotations

import math

import torch

from kvserve.config import RopeScaling


def rope_inverse_frequencies(head_dim: int, rope_theta: float, scaling: RopeScaling) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponents)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputes cos/sin for every position once; a forward pass only indexes them."""

    def __init__(self, head_dim: int, max_positions: int, rope_theta: float, scaling: RopeScaling) -> None:
        super().__init__()
        inv_freq = rope_inverse_frequencies(head_dim, rope_theta, scaling)
        self.inv_freq = inv_freq
        self.max_positions = max_positions
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).to(torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of shape [num_tokens, 1, head_dim], computed once per forward and shared by all layers."""
        cos = self.cos_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(dtype).unsqueeze(1)
        return cos, sin


def slow_channels(inv_freq: torch.Tensor, max_positions: int, max_angle: float = 1.0) -> torch.Tensor:
    """[head_dim] bool: the channels whose pair turns by at most `max_angle` radians over `max_positions`, so a
    value that is constant before rotation stays nearly constant after it at every position."""
    slow = inv_freq * max_positions <= max_angle
    return torch.cat((slow, slow))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
