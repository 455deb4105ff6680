"""KV cache bytes: THE formula. The engine sizes its pool with these functions, so plan and engine agree.

Storage contract (the engine's `cache/storage` follows these constants exactly):

- Per layer, one K and one V tensor of shape `[num_blocks, block_size, kv_heads_per_gpu, head_dim]`.
- `bfloat16` / `float16`: 2 B per element; `float32`: 4 B; no scales.
- `fp8` (= `fp8_e4m3`) and `fp8_e5m2`: 1 B per element. One per-tensor scale per layer, which is negligible
  and not counted.
- `int8`: 1 B per element, plus one one-byte scale (`INT8_SCALE_BYTES`: an unsigned float with 5 exponent and
  3 mantissa bits) per (token, kv_head) vector, separately for K and for V. The scale group is the whole
  head vector, i.e. `group_size == head_dim`; `KVFormat.group_size` is None for "one scale per vector". One
  byte, not an fp16: at head_dim 64 an fp16 scale would cost 3% of the tokens a pool holds.
- `int4`: 0.5 B per element (two per byte). Values: one fp16 scale per `INT4_GROUP_SIZE` (32) consecutive
  elements of a head vector, symmetric (no zero point); a last partial group still gets its own scale. Keys: no
  per-token scales; each channel of each (block, KV head) has a step byte and an integer zero point
  (`INT4_KEY_CHANNEL_BYTES`), so a block carries 2 x head_dim bytes per KV head beside its codes.

  bytes per block per GPU = layers x kv_heads_per_gpu x (block_size x (key_vector_bytes(d) + vector_bytes(d))
                                                         + key_block_bytes(d))
  vector_bytes(d)         = ceil(d x bits / 8) + scales_per_vector(d) x scale_bytes   (V; K too but for int4)
  key_block_bytes(d)      = d x INT4_KEY_CHANNEL_BYTES for int4, else 0
  bytes per token         = bytes per block / block_size, rounded up (exact at the default block sizes)

- MLA (DeepSeek-V2/V3): one latent vector of `kv_lora_rank + qk_rope_head_dim` elements per layer and token,
  no x2 and no heads; it is replicated on every TP rank, so TP does not shrink it.
- Tensor parallelism: heads split as in parallel.py (`max(1, kv_heads / TP)` per GPU).
- Sliding-window layers: the per-token figure counts every layer (full-attention accounting, an upper bound,
  and what a pool whose blocks span all layers must reserve). `kv_bytes_per_request` additionally gives the
  bytes one request really holds at a context length, where a windowed layer keeps at most its window.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.planner.errors import PlannerError
from kvserve.planner.kv_groups import KVCacheLayout, group_blocks, kv_cache_layout
from kvserve.planner.parallel import kv_heads_per_gpu, pipeline_stages, validate_parallelism
from kvserve.planner.specs import ModelSpec
from kvserve.planner.units import ceil_div, format_bytes

KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
COMPARED_KV_DTYPES = ("auto", "fp8", "int8", "int4")  # the model dtype, then each quantized format
KV_SCALE_BYTES = 2  # fp16 scales for int4
INT8_SCALE_BYTES = 1  # int8's one-byte float scale
INT4_GROUP_SIZE = 32
INT4_KEY_CHANNEL_BYTES = 2  # int4 keys: a step byte and an int8 zero point per channel, block and KV head
DEFAULT_BLOCK_SIZE = 16


@dataclass(slots=True, frozen=True)
class KVFormat:
    """How one KV element is stored. `group_size` None with `scale_bytes` > 0: one scale per head vector."""

    name: str
    bits: int
    group_size: int | None
    scale_bytes: int
    keys_per_block: bool = False  # keys scaled per channel over each block (int4), not per token

    @property
    def element_bytes(self) -> float:
        return self.bits / 8


_KV_FORMATS = {
    "bfloat16": KVFormat("bfloat16", 16, None, 0),
    "float16": KVFormat("float16", 16, None, 0),
    "float32": KVFormat("float32", 32, None, 0),
    "fp8_e4m3": KVFormat("fp8_e4m3", 8, None, 0),
    "fp8_e5m2": KVFormat("fp8_e5m2", 8, None, 0),
    "int8": KVFormat("int8", 8, None, INT8_SCALE_BYTES),
    "int4": KVFormat("int4", 4, INT4_GROUP_SIZE, KV_SCALE_BYTES, keys_per_block=True),
}
_KV_ALIASES = {"fp8": "fp8_e4m3", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def kv_format(kv_cache_dtype: str, model_dtype: str = "bfloat16") -> KVFormat:
    """`--kv-cache-dtype` -> KVFormat; "auto" stores KV in the model dtype, as vLLM does."""
    name = kv_cache_dtype.lower()
    if name == "auto":
        name = model_dtype.lower()
    name = _KV_ALIASES.get(name, name)
    if name not in _KV_FORMATS:
        raise PlannerError(f"--kv-cache-dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")
    return _KV_FORMATS[name]


def kv_scales_per_vector(fmt: KVFormat, vector_dim: int) -> int:
    if fmt.scale_bytes == 0:
        return 0
    return 1 if fmt.group_size is None else ceil_div(vector_dim, fmt.group_size)


def kv_vector_bytes(fmt: KVFormat, vector_dim: int) -> int:
    """Bytes of one head vector (or one MLA latent) of one token, scales included."""
    return ceil_div(vector_dim * fmt.bits, 8) + kv_scales_per_vector(fmt, vector_dim) * fmt.scale_bytes


def kv_key_vector_bytes(fmt: KVFormat, vector_dim: int) -> int:
    """Bytes of one token's key head vector: its codes alone when the keys are scaled per block."""
    return ceil_div(vector_dim * fmt.bits, 8) if fmt.keys_per_block else kv_vector_bytes(fmt, vector_dim)


def kv_key_block_bytes(fmt: KVFormat, vector_dim: int) -> int:
    """Bytes a block carries per KV head beside its keys' codes (int4's per-channel steps and zero points)."""
    return vector_dim * INT4_KEY_CHANNEL_BYTES if fmt.keys_per_block else 0


def kv_tensors_per_layer(spec: ModelSpec) -> int:
    return 1 if spec.is_mla else 2


def kv_vector_dim(spec: ModelSpec) -> int:
    return spec.kv_lora_rank + spec.qk_rope_head_dim if spec.is_mla else spec.head_dim


def kv_layer_block_bytes(spec: ModelSpec, fmt: KVFormat, block_size: int, tensor_parallel_size: int = 1) -> int:
    """Bytes one block occupies in one layer on one GPU (K and V together, scales included). An MLA latent is
    stored as a key."""
    heads = kv_heads_per_gpu(spec, tensor_parallel_size)
    dim = kv_vector_dim(spec)
    keys = block_size * kv_key_vector_bytes(fmt, dim) + kv_key_block_bytes(fmt, dim)
    values = 0 if spec.is_mla else block_size * kv_vector_bytes(fmt, dim)
    return heads * (keys + values)


def kv_layer_token_bytes(spec: ModelSpec, fmt: KVFormat, tensor_parallel_size: int = 1,
                         block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """Bytes one token occupies in one layer on one GPU (K and V together; per-block scales shared out over the
    block's tokens, rounded up)."""
    return ceil_div(kv_layer_block_bytes(spec, fmt, block_size, tensor_parallel_size), block_size)


def kv_layers_per_gpu(spec: ModelSpec, pipeline_parallel_size: int = 1) -> range:
    """The layers of the most loaded pipeline stage (all layers without PP)."""
    return max(pipeline_stages(spec.num_layers, pipeline_parallel_size), key=len)


def kv_bytes_per_token(
    spec: ModelSpec,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> int:
    """KV bytes one token costs on one GPU across all its layers (full-attention accounting): a block's bytes over
    its tokens, rounded up (exact unless a format keeps per-block scales that the block size does not divide)."""
    return ceil_div(kv_block_bytes(spec, block_size, kv_cache_dtype, model_dtype, tensor_parallel_size,
                                   pipeline_parallel_size), block_size)


def kv_block_bytes(
    spec: ModelSpec,
    block_size: int,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    layout: KVCacheLayout | None = None,
) -> int:
    """Bytes of one block (block_size tokens), K and V, scales included, on one GPU: across all layers, or with
    `layout` (kv_layout) one pool block, the layers one block holds (one group's for a model mixing windows and full
    attention)."""
    if block_size <= 0:
        raise PlannerError(f"--block-size must be positive, got {block_size}")
    validate_parallelism(spec, tensor_parallel_size, pipeline_parallel_size)
    fmt = kv_format(kv_cache_dtype, model_dtype)
    layers = len(kv_layers_per_gpu(spec, pipeline_parallel_size)) if layout is None else layout.num_slots
    return layers * kv_layer_block_bytes(spec, fmt, block_size, tensor_parallel_size)


def kv_layout(spec: ModelSpec, pipeline_parallel_size: int = 1, hybrid: bool = True) -> KVCacheLayout:
    """How the pool groups the layers of the most loaded stage by what their KV keeps (kv_groups.py); without
    `hybrid` (--disable-hybrid-kv-cache-manager), one group keeping every token for every layer."""
    layers = kv_layers_per_gpu(spec, pipeline_parallel_size)
    return kv_cache_layout([spec.layer_window(layer) if hybrid else None for layer in layers])


KEY_STAGING_MAX_ROWS = 128


def key_staging_rows(max_num_seqs: int) -> int:
    """Staging rows for int4 keys: one per sequence that may be filling a block, at most KEY_STAGING_MAX_ROWS (past
    that many decoding at once, the least recently written blocks are requantized from their codes instead)."""
    return min(max_num_seqs, KEY_STAGING_MAX_ROWS)


def kv_key_staging_bytes(
    spec: ModelSpec,
    block_size: int,
    max_num_seqs: int,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
) -> int:
    """Bytes beside the pool that a format scaling keys per block keeps: the unquantized keys of the blocks still
    filling (key_staging_rows of them; cache/storage/key_staging.py), in the KV dtype, every layer. 0 for other
    formats."""
    fmt = kv_format(kv_cache_dtype, model_dtype)
    if not fmt.keys_per_block:
        return 0
    layers = len(kv_layers_per_gpu(spec, pipeline_parallel_size))
    element = kv_format(model_dtype).bits // 8
    rows = key_staging_rows(max_num_seqs)
    return layers * rows * block_size * kv_heads_per_gpu(spec, tensor_parallel_size) * kv_vector_dim(spec) * element


def tokens_held_by_layer(spec: ModelSpec, layer_index: int, context_len: int, block_size: int | None = None) -> int:
    """Tokens of a `context_len` request one layer keeps: all of them, or at most its sliding window.

    With `block_size`, whole blocks as the pool holds them (kv_groups.group_blocks): a window that does not start
    on a block boundary straddles one more block.
    """
    window = spec.layer_window(layer_index)
    if block_size is None:
        return context_len if window is None else min(context_len, window)
    return group_blocks(window, context_len, block_size) * block_size


def kv_bytes_per_request(
    spec: ModelSpec,
    context_len: int,
    kv_cache_dtype: str = "auto",
    model_dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    block_size: int | None = None,
) -> int:
    """KV bytes one request of `context_len` tokens holds on one GPU, sliding windows honoured."""
    if context_len < 0:
        raise PlannerError(f"context length must be >= 0, got {context_len}")
    validate_parallelism(spec, tensor_parallel_size, pipeline_parallel_size)
    fmt = kv_format(kv_cache_dtype, model_dtype)
    layers = kv_layers_per_gpu(spec, pipeline_parallel_size)
    held = sum(tokens_held_by_layer(spec, layer, context_len, block_size) for layer in layers)
    if block_size is None:
        return held * kv_layer_token_bytes(spec, fmt, tensor_parallel_size)
    return held // block_size * kv_layer_block_bytes(spec, fmt, block_size, tensor_parallel_size)


def explain_kv_bytes_per_token(
    spec: ModelSpec, fmt: KVFormat, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
) -> str:
    """The arithmetic behind `kv_bytes_per_token`, e.g. `2 (K,V) × 48 layers × 8 KV heads × 128 × 2 B = 192 KiB`."""
    layers = len(kv_layers_per_gpu(spec, pipeline_parallel_size))
    layer_text = f"{layers} layers"
    if layers != spec.num_layers:
        layer_text += f" (of {spec.num_layers}, PP {pipeline_parallel_size})"
    vector = _explain_vector(fmt, kv_vector_dim(spec))
    total = layers * kv_layer_token_bytes(spec, fmt, tensor_parallel_size)
    per_block_keys = fmt.keys_per_block and not spec.is_mla
    if per_block_keys:
        vector = _explain_int4(fmt, kv_vector_dim(spec))
    if spec.is_mla:
        latent = f"({spec.kv_lora_rank} + {spec.qk_rope_head_dim}) latent"
        vector = vector.replace(str(kv_vector_dim(spec)), latent, 1)
        return f"{layer_text} × {vector} = {format_bytes_exact(total)}  (MLA: one latent per layer, no ×2)"
    heads = kv_heads_per_gpu(spec, tensor_parallel_size)
    head_text = f"{heads} KV heads"
    if tensor_parallel_size > 1 and spec.num_kv_heads >= tensor_parallel_size:
        head_text += f"/GPU ({spec.num_kv_heads} ÷ TP {tensor_parallel_size})"
    elif tensor_parallel_size > 1:
        head_text += "/GPU (replicated)"
    tensors = "" if per_block_keys else "2 (K,V) × "
    return f"{tensors}{layer_text} × {head_text} × {vector} = {format_bytes_exact(total)}"


def _explain_vector(fmt: KVFormat, dim: int) -> str:
    element = f"{fmt.bits // 8} B" if fmt.bits % 8 == 0 else f"{fmt.bits / 8:g} B"
    scales = kv_scales_per_vector(fmt, dim)
    if scales == 0:
        return f"{dim} × {element}"
    return f"({dim} × {element} + {scales} scale{'s' if scales > 1 else ''} × {fmt.scale_bytes} B)"


def _explain_int4(fmt: KVFormat, dim: int) -> str:
    """int4's K and V differ: K's codes plus a block's per-channel bytes shared out, V's codes plus scales."""
    keys = f"{dim} × 0.5 B + {dim} × {INT4_KEY_CHANNEL_BYTES} B / {DEFAULT_BLOCK_SIZE}-token block"
    scales = kv_scales_per_vector(fmt, dim)
    return f"(K {keys} + V {dim} × 0.5 B + {scales} × {fmt.scale_bytes} B)"


def format_bytes_exact(num_bytes: int) -> str:
    """`192 KiB` when the unit divides evenly, else `70,272 B (68.63 KiB)` so exact values stay checkable."""
    text = format_bytes(num_bytes)
    if "." in text and num_bytes < 1024**3:
        return f"{num_bytes:,} B ({text})"
    return text
