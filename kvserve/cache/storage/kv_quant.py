"""Quantized KV formats: how one head vector of K or V becomes bytes and scales, and back (torch, any device).

The formats and their byte counts are the planner's (planner/kv.py, `KVFormat`); this file is their codec:

- `fp8_e4m3`, `fp8_e5m2`: one byte per element, x / scale in the fp8 type, one fp32 scale per layer for K and
  one for V (vLLM's per-tensor `k_scale`/`v_scale`, 1.0 unless calibrated). Values beyond the type's range
  saturate instead of becoming NaN. Rotated first, as int4 is (below): fp8's error is relative to each
  element, so a q.k dominated by a few outlier channels that q and k share carries those channels' error
  whole; spread over every channel it averages out (demo model, fp32, 4,000 tokens: e4m3 +2.78% perplexity
  unrotated, +0.32% rotated; mean KLD 0.0143 against 0.0040).
- `int8`: one byte per element, symmetric, one scale per (token, KV head) vector in one byte: an unsigned
  8-bit float with 5 exponent and 3 mantissa bits (`encode_scale_byte`, 2^-20 to 2^11 x 1.875), absmax / 127
  rounded up to the next such value. A power-of-two byte (OCP MX's E8M0) costs up to one bit of the
  elements' precision and measured +0.14% perplexity on the demo model, 3 mantissa bits +0.0x%.
- `int4`: two elements per byte. Keys and values are rotated by a fixed orthogonal matrix first
  (`rotation_matrix`), which spreads a head's outlier channels over all of them; attention rotates the query
  the same way (q.k is unchanged) and rotates its output back (the output is a sum of rotated values).
  Values: symmetric, one fp16 scale per 32 elements (absmax / 7; the code is q + 8 in 1..15), low nibble
  first. Keys (KIVI's layout): per channel over each block's tokens, because RoPE turns a channel pair slowly
  with position, so a channel varies little within a block while channels differ a lot from each other. Each
  (block, KV head, channel) has a step (the int8 scale byte, below) and an int8 zero point z: a key element is
  (code + z) x step with code in 0..15. Codes are packed per 64-element chunk as byte i = element i | element
  i + 32 << 4 (a shorter last chunk of n: i and i + n/2), so a byte vector's low nibbles, then its high ones,
  are the elements in order. A block still filling is requantized whole at every write, from the unquantized
  keys that cache/key_staging.py keeps for it, so every block is rounded once over the tokens it holds.

Scales are rounded to their stored form before the data is quantized with them, so what is decoded is what was
encoded; the data is multiplied by the scale's reciprocal (as the CPU kernel that writes new K/V does, which
is bit-identical to these encoders).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.planner.kv import INT4_GROUP_SIZE, kv_format, kv_scales_per_vector

QUANTIZED_KV_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCALE_DTYPE = torch.float16
FP16_MIN_NORMAL, FP16_MAX = 2.0**-14, 65504.0


@dataclass(frozen=True, slots=True)
class KVCodec:
    """One quantized format for vectors of `head_dim` elements."""

    name: str  # one of QUANTIZED_KV_DTYPES
    head_dim: int

    @property
    def data_dtype(self) -> torch.dtype:
        return torch.int8 if self.name == "int8" else torch.uint8  # fp8 bytes are kept as uint8

    @property
    def data_dim(self) -> int:
        """Elements of `data_dtype` per head vector."""
        return self.head_dim // 2 if self.name == "int4" else self.head_dim

    @property
    def scales_per_vector(self) -> int:
        """Scales per head vector; 0 for fp8 (its scale is one per layer)."""
        return kv_scales_per_vector(kv_format(self.name), self.head_dim)

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8 if self.name == "int8" else SCALE_DTYPE

    @property
    def keys_per_block(self) -> bool:
        """Keys scaled per channel over each block (int4), written through key_staging.py."""
        return self.name == "int4"

    @property
    def rotates(self) -> bool:
        return self.name == "int4" or self.name in FP8_DTYPES

    def encode(self, x: torch.Tensor, tensor_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [..., head_dim] (float) -> (data [..., data_dim], scales [..., scales_per_vector] fp16 or None)."""
        if self.name in FP8_DTYPES:
            return encode_fp8(x, FP8_DTYPES[self.name], tensor_scale), None
        if self.name == "int8":
            return encode_int8(x)
        return encode_int4(x)

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype,
               tensor_scale: torch.Tensor | None = None) -> torch.Tensor:
        """The inverse of encode, in `dtype`."""
        if self.name in FP8_DTYPES:
            return decode_fp8(data, FP8_DTYPES[self.name], tensor_scale, dtype)
        if self.name == "int8":
            return (data.to(torch.float32) * decode_scale_byte(scales)).to(dtype)
        return decode_int4(data, scales, self.head_dim).to(dtype)


def codec_for(kv_cache_dtype: str, head_dim: int) -> KVCodec | None:
    """The codec of a --kv-cache-dtype (vLLM's `fp8` is e4m3); None for the unquantized dtypes."""
    name = kv_format(kv_cache_dtype).name
    if name not in QUANTIZED_KV_DTYPES:
        return None
    if name == "int4" and head_dim % 2:
        raise ValueError(f"--kv-cache-dtype int4 packs two elements per byte and needs an even head_dim, got {head_dim}")
    return KVCodec(name, head_dim)


def encode_fp8(x: torch.Tensor, fp8: torch.dtype, tensor_scale: torch.Tensor | None) -> torch.Tensor:
    limit = torch.finfo(fp8).max
    scaled = x.to(torch.float32)
    if tensor_scale is not None:
        scaled = scaled * (1 / tensor_scale)
    return scaled.clamp(-limit, limit).to(fp8).view(torch.uint8)


def decode_fp8(data: torch.Tensor, fp8: torch.dtype, tensor_scale: torch.Tensor | None, dtype: torch.dtype
               ) -> torch.Tensor:
    values = data.view(fp8).to(torch.float32)
    if tensor_scale is not None:
        values = values * tensor_scale
    return values.to(dtype)


def _symmetric_scales(groups: torch.Tensor, max_code: int) -> torch.Tensor:
    """fp16 scales of groups [..., n] (absmax / max_code, within fp16's normal range, rounded to fp16) as
    [..., 1] fp32: a zero group still gets a positive scale, a huge one a finite one (its values then clip)."""
    absmax = groups.abs().amax(dim=-1, keepdim=True)
    return (absmax / max_code).clamp_(FP16_MIN_NORMAL, FP16_MAX).to(SCALE_DTYPE).to(torch.float32)


SCALE_EXPONENT_BIAS = 20  # scale byte: (e + 20) << 3 | m  means  2^e x (1 + m / 8), e in [-20, 11]
SCALE_MIN_EXPONENT, SCALE_MAX_EXPONENT = -20, 11


def encode_scale_byte(scale: torch.Tensor) -> torch.Tensor:
    """Positive fp32 scales -> the smallest 5e3m byte value >= each (clamped to the byte's range)."""
    mantissa, exponent = torch.frexp(scale.clamp(min=2.0**SCALE_MIN_EXPONENT))  # scale = mantissa x 2^exponent
    exponent = exponent - 1  # so that scale = (2 x mantissa) x 2^exponent with 2 x mantissa in [1, 2)
    steps = torch.ceil((mantissa * 2 - 1) * 8)  # eighths above 1, rounded up: 0..8
    exponent = exponent + (steps == 8)
    steps = steps.remainder(8)
    over = exponent > SCALE_MAX_EXPONENT
    exponent = exponent.clamp(max=SCALE_MAX_EXPONENT)
    steps = torch.where(over, torch.full_like(steps, 7), steps)
    return ((exponent + SCALE_EXPONENT_BIAS) * 8 + steps).to(torch.uint8)


def decode_scale_byte(code: torch.Tensor) -> torch.Tensor:
    code = code.to(torch.int32)
    return torch.ldexp(1 + (code & 7).to(torch.float32) / 8, (code >> 3) - SCALE_EXPONENT_BIAS)


def encode_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.to(torch.float32)
    codes = encode_scale_byte(x.abs().amax(dim=-1, keepdim=True) / 127)
    data = torch.round(x * (1 / decode_scale_byte(codes))).clamp_(-127, 127).to(torch.int8)
    return data, codes


def _int4_groups(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] -> [..., groups, 32], the last group zero-padded when head_dim is not a multiple of 32."""
    head_dim = x.shape[-1]
    padded = math.ceil(head_dim / INT4_GROUP_SIZE) * INT4_GROUP_SIZE
    if padded != head_dim:
        x = torch.nn.functional.pad(x, (0, padded - head_dim))
    return x.view(*x.shape[:-1], padded // INT4_GROUP_SIZE, INT4_GROUP_SIZE)


def encode_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = x.shape[-1]
    groups = _int4_groups(x.to(torch.float32))
    scales = _symmetric_scales(groups, 7)
    codes = (torch.round(groups * (1 / scales)).clamp_(-7, 7) + 8).to(torch.uint8).flatten(-2)[..., :head_dim]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, scales.squeeze(-1).to(SCALE_DTYPE)


def decode_int4(data: torch.Tensor, scales: torch.Tensor, head_dim: int) -> torch.Tensor:
    low = (data & 0x0F).to(torch.int16)
    high = (data >> 4).to(torch.int16)
    codes = torch.stack((low, high), dim=-1).flatten(-2) - 8  # [..., head_dim]
    groups = _int4_groups(codes.to(torch.float32))
    return (groups * scales.to(torch.float32).unsqueeze(-1)).flatten(-2)[..., :head_dim]


def int4_key_pairs(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The elements each packed key byte holds: (low nibble's, high nibble's), per 64-element chunk."""
    low, high = [], []
    for start in range(0, head_dim, 64):
        half = min(64, head_dim - start) // 2
        low += range(start, start + half)
        high += range(start + half, start + 2 * half)
    return torch.tensor(low), torch.tensor(high)


def pack_int4_keys(codes: torch.Tensor) -> torch.Tensor:
    """codes [..., head_dim] in 0..15 -> [..., head_dim / 2] bytes in the keys' chunk order."""
    low, high = int4_key_pairs(codes.shape[-1])
    codes = codes.to(torch.uint8)
    return codes[..., low.to(codes.device)] | (codes[..., high.to(codes.device)] << 4)


def unpack_int4_keys(data: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4_keys, as int16 codes."""
    head_dim = data.shape[-1] * 2
    low, high = int4_key_pairs(head_dim)
    codes = torch.empty(*data.shape[:-1], head_dim, dtype=torch.int16, device=data.device)
    codes[..., low.to(data.device)] = (data & 0x0F).to(torch.int16)
    codes[..., high.to(data.device)] = (data >> 4).to(torch.int16)
    return codes


def encode_int4_key_block(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [n, kv_heads, head_dim]: one block's first n keys -> (packed codes [n, kv_heads, head_dim / 2],
    channel bytes [kv_heads, 2, head_dim] uint8: step bytes, then int8 zero points).

    The step is the smallest scale byte that lets 16 levels from an integer zero point cover the channel's
    range over the rows: the first of three candidates, (max - min) / 15 rounded up to a byte and the next two
    up, that fits (two steps up always do: adjacent byte values differ by at most 9/8, two by more than 15/14).
    The step is also at least |min| / 127 so that z stays in int8.
    """
    rows = rows.to(torch.float32)
    low, high = rows.amin(dim=0), rows.amax(dim=0)  # [kv_heads, head_dim]
    first = encode_scale_byte(torch.maximum((high - low) * (1 / 15), low.abs() * (1 / 127))).to(torch.int32)
    chosen = torch.clamp(first + 2, max=255)
    for bump in (1, 0):  # the smallest that fits wins
        code = torch.clamp(first + bump, max=255)
        chosen = torch.where(_key_step_fits(code, low, high), code, chosen)
    step = decode_scale_byte(chosen)
    inverse = 1 / step
    zero = torch.floor(low * inverse).clamp_(-128, 127)
    codes = (torch.round(rows * inverse) - zero).clamp_(0, 15)
    channel = torch.stack((chosen.to(torch.uint8), zero.to(torch.int8).view(torch.uint8)), dim=-2)
    return pack_int4_keys(codes), channel


def _key_step_fits(code: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    step = decode_scale_byte(code)
    zero = torch.floor(low * (1 / step))
    return (zero >= -128) & (zero <= 127) & ((zero + 15) * step >= high)


def decode_int4_keys(data: torch.Tensor, channel: torch.Tensor) -> torch.Tensor:
    """data [..., head_dim / 2] packed key codes, channel [..., 2, head_dim] their block's channel bytes (the
    same leading dims) -> fp32 keys [..., head_dim]."""
    step = decode_scale_byte(channel[..., 0, :])
    zero = channel[..., 1, :].view(torch.int8).to(torch.float32)
    return (unpack_int4_keys(data).to(torch.float32) + zero) * step


def rotation_matrix(head_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """A fixed orthogonal [head_dim, head_dim] fp32 matrix: a Hadamard matrix with random column signs when
    head_dim is a power of two (every entry +-1/sqrt(d), so any one channel is spread evenly over all), otherwise
    the Q factor of a seeded Gaussian. Fixed seed: the same on every run and machine, so stored blocks stay
    readable."""
    generator = torch.Generator().manual_seed(0x6B76)
    if head_dim & (head_dim - 1) == 0:
        matrix = torch.ones(1, 1)
        while matrix.shape[0] < head_dim:
            matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
        signs = torch.randint(0, 2, (head_dim,), generator=generator).float() * 2 - 1
        matrix = matrix * signs / math.sqrt(head_dim)
    else:
        matrix, _ = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=generator, dtype=torch.float64))
        matrix = matrix.float()
    return matrix.to(device)
