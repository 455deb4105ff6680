"""4-bit KV schemes beside the one kvserve ships: what each costs in accuracy and in bytes, on one model.

    python benchmarks/kv_int4_schemes.py [--num-tokens 2048] [--dtype float32]

A study, not a feature: each scheme is simulated by rounding K and V to it (fake quantization) just before they
reach an unquantized paged cache, so the engine, its kernels, chunked prefill and `kvserve eval-kv`'s scoring
are what measure it; only the rounding differs. The row `int4 (engine)` is the real `--kv-cache-dtype int4`
through its kernels, the anchor the simulated `int4 (shipped)` row should match. Schemes:

- per token: one scale per group of a token's channels (absmax / 7, uniform levels, or NF4's 16 levels for
  Gaussian values), after the fixed signed-Hadamard rotation kvserve's int4 applies;
- per channel (KIVI's keys): each channel of a KV block's 16 tokens gets its own minimum and step (asymmetric,
  16 levels), in fp16, or in one byte each (the minimum in fp8, rounded down, the step in kvserve's int8 scale
  byte, rounded up). `one shot` quantizes a block's tokens together (a prefill writes whole blocks); `token by
  token` requantizes the block from its decoded rows as each token arrives (how decode fills a block).

Bytes are per token and KV head (64-dim heads), K and V together, scales included; bf16 needs 256.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

import kvserve.model.attention as attention_module
from kvserve.cache.storage.kv_quant import decode_scale_byte, encode_scale_byte, rotation_matrix
from kvserve.engine import eval_kv_cli
from kvserve.engine.kv_eval import compare, stdlib_text

BLOCK = 16  # the pool's default block size: per-channel scales are per block
FP16_TINY = 2.0**-14
NF4_LEVELS = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796, 0.1609, 0.2461,
                           0.3379, 0.4407, 0.5626, 0.7230, 1.0])  # QLoRA's NormalFloat4, rounded

Quantizer = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (x [T, H, D] fp32, block ids [T]) -> rounded x


def per_token(group: int, levels: torch.Tensor | None = None) -> Quantizer:
    """Symmetric, one fp16 scale per `group` channels of a token: uniform (absmax / 7) or a 16-level table."""
    def quantize(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
        absmax = groups.abs().amax(-1, keepdim=True)
        if levels is None:
            scale = (absmax / 7).half().float().clamp(min=FP16_TINY)
            return (torch.round(groups / scale).clamp(-7, 7) * scale).reshape(x.shape)
        scale = absmax.half().float().clamp(min=FP16_TINY)
        nearest = (groups.div(scale).unsqueeze(-1) - levels).abs().argmin(-1)
        return (levels[nearest] * scale).reshape(x.shape)
    return quantize


def per_token_byte_scale(group: int) -> Quantizer:
    """As per_token, the scale in kvserve's int8 scale byte (5 exponent, 3 mantissa bits, rounded up)."""
    def quantize(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
        scale = _byte_up(groups.abs().amax(-1, keepdim=True) / 7)
        return (torch.round(groups / scale).clamp(-7, 7) * scale).reshape(x.shape)
    return quantize


def _byte_up(scale: torch.Tensor) -> torch.Tensor:
    """The smallest int8 scale byte's value at or above each scale (kv_quant's own codec)."""
    return decode_scale_byte(encode_scale_byte(scale))


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float8_e4m3fn).float()


def _channel_round(rows: torch.Tensor, byte_metadata: bool) -> torch.Tensor:
    """rows [n, H, D]: each channel's own minimum and step over the n rows, 16 levels."""
    low, high = rows.amin(0, keepdim=True), rows.amax(0, keepdim=True)
    if byte_metadata:
        # The minimum as an fp8 value at or below it: one fp8 rounding moves a value by at most 1/16 of it.
        stored = _fp8(low)
        low = torch.where(stored > low, _fp8(low - low.abs() / 8 - 2.0**-9), stored)
        step = _byte_up((high - low) / 15)
    else:
        low = low.half().float()
        step = ((high - low) / 15).half().float().clamp(min=FP16_TINY)
    return torch.round((rows - low) / step).clamp(0, 15) * step + low


def per_channel(byte_metadata: bool, token_by_token: bool) -> Quantizer:
    def quantize(x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        for block in torch.unique(blocks):
            index = (blocks == block).nonzero().squeeze(-1)
            rows = x[index]
            if token_by_token:
                done = rows[:0]
                for t in range(rows.shape[0]):
                    done = _channel_round(torch.cat((done, rows[t:t + 1])), byte_metadata)
                out[index] = done
            else:
                out[index] = _channel_round(rows, byte_metadata)
        return out
    return quantize


def rotated(inner: Quantizer) -> Quantizer:
    """The quantizer applied in the rotated basis kvserve's int4 uses (q.k and the output are unchanged by it)."""
    rotation = rotation_matrix(64)
    return lambda x, blocks: inner(x @ rotation, blocks) @ rotation.T


@dataclass(frozen=True)
class Scheme:
    name: str
    key: Quantizer | None  # None: left unquantized
    value: Quantizer | None
    bytes_per_token: int  # per KV head, K and V, 64-dim heads; 0 where half of it is unquantized


SHIPPED = rotated(per_token(32))
SCHEMES = (
    Scheme("int4 (shipped): K and V per token, rotated", SHIPPED, SHIPPED, 72),
    Scheme("K alone, shipped", SHIPPED, None, 0),
    Scheme("V alone, shipped", None, SHIPPED, 0),
    Scheme("K alone, per token NF4 levels, rotated", rotated(per_token(32, NF4_LEVELS)), None, 0),
    Scheme("K alone, per channel fp16, one shot", per_channel(False, False), None, 0),
    Scheme("K alone, per channel fp16, one shot, rotated", rotated(per_channel(False, False)), None, 0),
    Scheme("K alone, per channel fp16, token by token", per_channel(False, True), None, 0),
    Scheme("K per channel fp16 + V shipped, one shot, rotated", rotated(per_channel(False, False)), SHIPPED, 84),
    Scheme("K per channel bytes + V byte per 64, one shot, rotated", rotated(per_channel(True, False)),
           rotated(per_token_byte_scale(64)), 73),
    Scheme("K per channel bytes + V byte per 64, token by token, rotated", rotated(per_channel(True, True)),
           rotated(per_token_byte_scale(64)), 73),
)


class FakeQuantizedAttention:
    """Replaces the attention module's paged_attention: rounds this layer's new K and V to the active scheme."""

    def __init__(self) -> None:
        self.original = attention_module.paged_attention
        self.scheme: Scheme | None = None

    def __call__(self, attn, q, k, v, kv_cache, metadata):
        if self.scheme is not None:
            blocks = metadata.paged.slot_mapping // BLOCK
            if self.scheme.key is not None:
                k = self.scheme.key(k.float(), blocks).to(k.dtype)
            if self.scheme.value is not None:
                v = self.scheme.value(v.float(), blocks).to(v.dtype)
        return self.original(attn, q, k, v, kv_cache, metadata)


def _score(args: argparse.Namespace, kv_cache_dtype: str, text: str):
    scored = eval_kv_cli.evaluate(args, kv_cache_dtype, text)
    return scored.prompt_logprobs, scored.num_tokens, scored.model_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    eval_kv_cli.add_arguments(parser)
    parser.set_defaults(dtype="float32", greedy_prompts=0)
    args = parser.parse_args(argv)
    text = stdlib_text()
    hook = FakeQuantizedAttention()
    attention_module.paged_attention = hook
    reference, num_tokens, model = _score(args, "auto", text)
    print(f"{model}, {num_tokens} tokens, --dtype {args.dtype}, against unquantized KV", flush=True)
    print(f"{'scheme':62s} {'B/token':>8s} {'vs bf16':>8s} {'ppl':>8s} {'KLD':>8s} {'top-1':>7s}")
    engine_int4, _, _ = _score(args, "int4", text)
    _print_row("int4 (engine): --kv-cache-dtype int4", 72, compare("int4", reference, engine_int4))
    for scheme in SCHEMES:
        hook.scheme = scheme
        scored, _, _ = _score(args, "auto", text)
        _print_row(scheme.name, scheme.bytes_per_token, compare(scheme.name, reference, scored))
    return 0


def _print_row(name: str, bytes_per_token: int, result) -> None:
    size = f"{bytes_per_token}" if bytes_per_token else "-"
    ratio = f"{256 / bytes_per_token:.2f}x" if bytes_per_token else "-"
    print(f"{name:62s} {size:>8s} {ratio:>8s} {result.perplexity_increase * 100:+7.2f}% {result.mean_kld:8.5f} "
          f"{result.top1_agreement * 100:6.1f}%", flush=True)


if __name__ == "__main__":
    sys.exit(main())
