"""The KV pool's formats (cache/storage/kv_quant.py) in Triton: reading a tile of K or V in place, in fp32, and
encoding new vectors bit for bit as the torch encoders do.

Conversions to fp8 and rounding are done on the fp32 bits rather than with Triton's casts: the interpreter's
fp32-to-fp8 cast rounds some values to the wrong binade, and the bit arithmetic is the same on every backend.
"""

from __future__ import annotations

import triton
import triton.language as tl

# The formats' ids: the CPU kernels' (cpu_kernels.QUANTIZED_FORMAT_IDS), 0 for an unquantized cache.
UNQUANTIZED, FP8_E4M3, FP8_E5M2, INT8, INT4 = 0, 1, 2, 3, 4

SCALE_EXPONENT_BIAS = 20  # kv_quant.SCALE_EXPONENT_BIAS: byte (e + 20) << 3 | m means 2^e x (1 + m / 8)


@triton.jit
def scale_byte_value(code):
    """kv_quant.decode_scale_byte: the fp32 built from its exponent and 3 mantissa bits, exactly."""
    code = code.to(tl.int32)
    exponent = (code >> 3) - 20
    bits = ((exponent + 127) << 23) | ((code & 7) << 20)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def encode_scale_byte(scale):
    """kv_quant.encode_scale_byte: the smallest byte value >= a positive fp32 scale, within the byte's range."""
    scale = tl.maximum(scale, 9.5367431640625e-07)  # 2^-20
    bits = scale.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 255) - 127
    mantissa = (bits >> 20) & 7
    mantissa += ((bits & 0xFFFFF) != 0).to(tl.int32)  # rounded up
    exponent += (mantissa == 8).to(tl.int32)
    mantissa = mantissa & 7
    over = exponent > 11
    exponent = tl.minimum(exponent, 11)
    mantissa = tl.where(over, 7, mantissa)
    return ((exponent + 20) * 8 + mantissa).to(tl.uint8)


@triton.jit
def round_half_even(x):
    """torch.round for |x| < 2^22: adding and taking away 1.5 x 2^23 leaves the fp32 sum rounded to an integer."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def encode_fp8(x, FORMAT: tl.constexpr):
    """fp32 values within the format's range -> their fp8 byte, rounded to nearest even (torch's cast)."""
    if FORMAT == 1:  # e4m3fn: bias 7, 3 mantissa bits, smallest normal 2^-6, subnormal step 2^-9
        code = _fp8_code(x, 20, 7, 0.015625, 512.0)
    else:  # e5m2: bias 15, 2 mantissa bits, smallest normal 2^-14, subnormal step 2^-16
        code = _fp8_code(x, 21, 15, 6.103515625e-05, 65536.0)
    return code


@triton.jit
def _fp8_code(x, MANTISSA_SHIFT: tl.constexpr, BIAS: tl.constexpr, MIN_NORMAL: tl.constexpr,
              SUBNORMAL_STEPS: tl.constexpr):
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 128
    magnitude = bits & 0x7FFFFFFF
    # Normal: drop the low mantissa bits, rounding half to even; a carry moves into the exponent, as it should.
    rounded = (magnitude + ((1 << (MANTISSA_SHIFT - 1)) - 1) + ((magnitude >> MANTISSA_SHIFT) & 1)) >> MANTISSA_SHIFT
    normal = rounded - ((127 - BIAS) << (23 - MANTISSA_SHIFT))
    subnormal = round_half_even(tl.minimum(tl.abs(x) * SUBNORMAL_STEPS, 1024.0)).to(tl.int32)
    code = tl.where(tl.abs(x) < MIN_NORMAL, subnormal, normal)
    return (code | sign).to(tl.uint8)


@triton.jit
def decode_fp8(byte, FORMAT: tl.constexpr):
    if FORMAT == 1:  # e4m3fn from its bits: Triton has no fp8e4nv before sm_89 (A100: "not supported")
        code = byte.to(tl.int32)
        magnitude = code & 0x7F  # exponent field << 3 | mantissa; bias 7 -> fp32's 127 adds 120 << 3
        normal = ((magnitude + (120 << 3)) << 20).to(tl.float32, bitcast=True)
        value = tl.where(magnitude < 8, magnitude.to(tl.float32) * 0.001953125, normal)  # subnormal: m x 2^-9
        return tl.where(code >= 128, -value, value)
    return byte.to(tl.float8e5, bitcast=True).to(tl.float32)


@triton.jit
def load_kv_tile(data_ptr, scales_ptr, tensor_scale_ptr, slots, head, dims, valid, block_size,
                 num_kv_heads, DATA_DIM: tl.constexpr, NUM_SCALES: tl.constexpr, HEAD_DIM: tl.constexpr,
                 FORMAT: tl.constexpr, INT4_KEYS: tl.constexpr):
    """K or V of `slots` [N] for KV head `head`, elements `dims` [D] (padded past HEAD_DIM), as fp32 [N, D].

    `data_ptr` is the pool tensor [num_blocks, block_size, num_kv_heads, DATA_DIM] (contiguous); `scales_ptr`
    its per-vector scales [.., NUM_SCALES] (int8: one scale byte, int4 values: fp16 per 32 elements) or, for
    int4 keys, the per-block channel bytes [num_blocks, num_kv_heads, 2, HEAD_DIM]; `tensor_scale_ptr` fp8's
    per-layer scale. Rows where `valid` is false read as zero."""
    mask = valid[:, None] & (dims < HEAD_DIM)[None, :]
    vector = slots.to(tl.int64) * num_kv_heads + head  # index of the (slot, head) vector
    if FORMAT == 0:
        x = tl.load(data_ptr + vector[:, None] * DATA_DIM + dims[None, :], mask=mask, other=0.0).to(tl.float32)
    elif FORMAT == 1 or FORMAT == 2:
        byte = tl.load(data_ptr + vector[:, None] * DATA_DIM + dims[None, :], mask=mask, other=0)
        x = decode_fp8(byte, FORMAT) * tl.load(tensor_scale_ptr)
    elif FORMAT == 3:
        code = tl.load(data_ptr + vector[:, None] * DATA_DIM + dims[None, :], mask=mask, other=0).to(tl.float32)
        scale = scale_byte_value(tl.load(scales_ptr + vector, mask=valid, other=0))
        x = code * scale[:, None]
    elif INT4_KEYS:
        # Bytes pair element i with i + n/2 of each 64-element chunk of n (kv_quant.int4_key_pairs).
        chunk_start = (dims // 64) * 64
        chunk_half = tl.minimum(HEAD_DIM - chunk_start, 64) // 2
        local = dims - chunk_start
        high = local >= chunk_half
        byte_index = chunk_start // 2 + tl.where(high, local - chunk_half, local)
        byte = tl.load(data_ptr + vector[:, None] * DATA_DIM + byte_index[None, :], mask=mask, other=0)
        code = ((byte.to(tl.int32) >> tl.where(high, 4, 0)[None, :]) & 15).to(tl.float32)
        channels = ((slots // block_size).to(tl.int64) * num_kv_heads + head) * (2 * HEAD_DIM)
        step = scale_byte_value(tl.load(scales_ptr + channels[:, None] + dims[None, :], mask=mask, other=0))
        zero = tl.load(scales_ptr + channels[:, None] + HEAD_DIM + dims[None, :], mask=mask, other=0)
        zero = zero.to(tl.int8, bitcast=True).to(tl.float32)
        x = (code + zero) * step
    else:  # int4 values: low nibble first, one fp16 scale per 32 elements
        byte = tl.load(data_ptr + vector[:, None] * DATA_DIM + (dims // 2)[None, :], mask=mask, other=0x88)
        code = ((byte.to(tl.int32) >> ((dims % 2) * 4)[None, :]) & 15) - 8
        scale = tl.load(scales_ptr + vector[:, None] * NUM_SCALES + (dims // 32)[None, :], mask=mask, other=0.0)
        x = code.to(tl.float32) * scale.to(tl.float32)
    return tl.where(mask, x, 0.0)
