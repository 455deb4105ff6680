"""The tensors behind the block pool: per layer one K and one V tensor of [num_blocks, block_size, kv_heads, dim].

`cache/storage/` owns these tensors; the model's attention writes new K/V through a slot mapping (slot = block id x
block_size + offset) and reads context through block tables. A quantized format (kv_quant.py) keeps its
scales beside the data in the same object: per-vector scales as [num_blocks, block_size, kv_heads, groups]
tensors that move with their blocks (int4 keys: per-channel bytes [num_blocks, kv_heads, 2, head_dim], which
move with them too), per-tensor fp8 scales as one value per layer. The scheduler, the block pool and the runner
see blocks, never formats. int4 keys of blocks still filling are also kept unquantized (key_staging.py).

A quantized cache also stores keys less a per-layer key offset (`key_offset`): one constant per channel and KV
head, measured once at start-up (engine/kv_calibration.py). Some models' keys sit far from zero in a few
channels (Qwen2's k bias: a channel at 317 +- 1.3 beside channels of +- 1), and a quantizer whose range covers
them rounds every other channel to nothing. Subtracting a constant c from every key shifts all of a query's
scores by the same q . c, which softmax ignores, so attention is unchanged and needs nothing added back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve import huge_pages
from kvserve.cache.storage.key_staging import KeyStaging
from kvserve.cache.storage.kv_quant import KVCodec, codec_for, decode_int4_keys, encode_int4_key_block, rotation_matrix
from kvserve.planner.kv_groups import KVCacheLayout, kv_cache_layout


@dataclass(slots=True)
class LayerKVCache:
    key: torch.Tensor  # [num_blocks, block_size, kv_heads, data_dim] in the model dtype or the codec's data dtype
    value: torch.Tensor
    codec: KVCodec | None = None  # None: unquantized, `key.dtype` is the KV dtype
    # [num_blocks, block_size, kv_heads, groups]: int8's scale bytes; int4's keys: [num_blocks, kv_heads, 2, head_dim]
    # channel bytes (steps, zero points), values: fp16 [num_blocks, block_size, kv_heads, groups]
    key_scales: torch.Tensor | None = None
    value_scales: torch.Tensor | None = None
    key_tensor_scale: torch.Tensor | None = None  # [] fp32 (fp8): stored = x / scale
    value_tensor_scale: torch.Tensor | None = None
    rotation: torch.Tensor | None = None  # [head_dim, head_dim] fp32 when the codec rotates (int4)
    calibrating: bool = False  # fp8 under --calculate-kv-scales: the first write (start-up's) sets the tensor scales
    key_offset: torch.Tensor | None = None  # [kv_heads, head_dim] in the model dtype, subtracted before storing
    # [head_dim] bool while the key offset is to be measured on the next keys written, in these channels only
    key_offset_channels: torch.Tensor | None = None
    # A fused writer for this device (the CPU kernels' write_kv / write_quantized_kv), given by the model runner:
    # fn(cache, slot_mapping, key, value), bit-identical to the torch ops below; None: those run.
    writer: Callable | None = None
    # int4: which blocks still filling keep their keys unquantized (shared by the layers), and this layer's rows
    # [staging rows, block_size, kv_heads, head_dim] in the KV dtype
    key_staging: KeyStaging | None = None
    key_stage: torch.Tensor | None = None
    # The layer's KV cache group (planner/kv_groups.py): which block tables and slots address it. Layers of
    # different groups share the tensors of one storage slot; a block belongs to one group at a time.
    group: int = 0

    @property
    def flat_key(self) -> torch.Tensor:
        """[num_blocks * block_size, kv_heads, data_dim]: a view addressed by slot."""
        return self.key.view(-1, *self.key.shape[2:])

    @property
    def flat_value(self) -> torch.Tensor:
        return self.value.view(-1, *self.value.shape[2:])

    @property
    def quantized(self) -> bool:
        return self.codec is not None

    def tensors(self) -> list[torch.Tensor]:
        """Every per-block tensor (data and scales), block dim first: what moving a block moves."""
        return [t for t in (self.key, self.value, self.key_scales, self.value_scales) if t is not None]

    def measure_key_offset(self, key: torch.Tensor) -> None:
        """key [tokens, kv_heads, head_dim] (unrotated): each channel's median over the tokens after the first
        (a sequence's first token is an attention sink whose key is unlike the rest), in the channels given."""
        sample = key[1:] if key.shape[0] > 1 else key
        median = sample.to(torch.float32).median(dim=0).values
        self.key_offset = (median * self.key_offset_channels.to(median.device)).to(key.dtype)
        self.key_offset_channels = None

    def write(self, slot_mapping: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """key, value [tokens, kv_heads, head_dim] in the model dtype (already rotated when the codec rotates)."""
        if self.calibrating:
            self._calibrate(key, value)
        if self.writer is not None:
            self.writer(self, slot_mapping, key, value)
            return
        if self.codec is None:
            self.flat_key.index_copy_(0, slot_mapping, key.to(self.key.dtype))
            self.flat_value.index_copy_(0, slot_mapping, value.to(self.value.dtype))
            return
        pairs = [(self.key, self.key_scales, self.key_tensor_scale, key),
                 (self.value, self.value_scales, self.value_tensor_scale, value)]
        if self.keys_per_block:
            self._write_int4_keys(key, self.key_staging.plan(slot_mapping))
            pairs = pairs[1:]
        for data, scales, tensor_scale, x in pairs:
            encoded, encoded_scales = self.codec.encode(x, tensor_scale)
            data.view(-1, *data.shape[2:]).index_copy_(0, slot_mapping, encoded)
            if scales is not None:
                scales.view(-1, *scales.shape[2:]).index_copy_(0, slot_mapping, encoded_scales)

    @property
    def keys_per_block(self) -> bool:
        return self.key_staging is not None

    def _write_int4_keys(self, key: torch.Tensor, plan: torch.Tensor) -> None:
        """Each stretch of a block the step writes: the block's rows [0, hi] quantized together, the earlier ones
        from its staging row (or the cache's codes), the new ones from `key` (key_staging.py's plan)."""
        for block, first, lo, hi, row, decode in plan.tolist():
            new = key[first:first + hi - lo + 1].to(torch.float32)
            channels = self.key_scales[block]
            if row >= 0:
                stage = self.key_stage[row]
                if decode:
                    stage[:decode] = decode_int4_keys(self.key[block, :decode], channels).to(stage.dtype)
                stage[lo:hi + 1] = new.to(stage.dtype)
                past = stage[:lo].to(torch.float32)
            else:
                past = decode_int4_keys(self.key[block, :lo], channels)
            codes, channel_bytes = encode_int4_key_block(torch.cat((past, new)))
            self.key[block, :hi + 1] = codes
            self.key_scales[block] = channel_bytes

    def _calibrate(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """vLLM's --calculate-kv-scales: scale = absmax of the first batch (here the start-up calibration's, so
        the same on every start) / a range that leaves headroom for larger values later (vLLM's constants, 200
        for K and 100 for V, against e4m3's maximum of 448). Fixed afterwards: every block of the pool must
        decode with the scale it was written with."""
        self.key_tensor_scale.fill_(max(key.abs().max().item() / K_SCALE_RANGE, _MIN_TENSOR_SCALE))
        self.value_tensor_scale.fill_(max(value.abs().max().item() / V_SCALE_RANGE, _MIN_TENSOR_SCALE))
        self.calibrating = False

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` as [len(slots), kv_heads, head_dim] in `dtype`: only those rows are decoded."""
        if self.codec is None:
            return self.flat_key.index_select(0, slots).to(dtype), self.flat_value.index_select(0, slots).to(dtype)
        if self.keys_per_block:
            block_size = self.key.shape[1]
            keys = decode_int4_keys(self.flat_key.index_select(0, slots),
                                    self.key_scales.index_select(0, slots // block_size)).to(dtype)
        else:
            keys = self._gather_one(self.key, self.key_scales, self.key_tensor_scale, slots, dtype)
        return keys, self._gather_one(self.value, self.value_scales, self.value_tensor_scale, slots, dtype)

    def _gather_one(self, data: torch.Tensor, scales: torch.Tensor | None, tensor_scale: torch.Tensor | None,
                    slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = data.view(-1, *data.shape[2:]).index_select(0, slots)
        row_scales = None if scales is None else scales.view(-1, *scales.shape[2:]).index_select(0, slots)
        return self.codec.decode(rows, row_scales, dtype, tensor_scale)


def calibration_caches(layers: list[LayerKVCache], num_blocks: int, channels: list[torch.Tensor]) -> list[LayerKVCache]:
    """Scratch caches of `num_blocks` blocks in the (quantized) layers' own format, writer and scale state, which
    measure their key offsets in their `channels` (one per layer; and fp8 scales, when the layers are calibrating) on their first
    write: a calibration forward runs over these, so it never touches the pool and the pool's size never changes
    it."""
    scratch = []
    for layer, layer_channels in zip(layers, channels, strict=True):
        _, block_size, num_kv_heads, _ = layer.key.shape
        stage = layer.key_stage  # one staging row: the calibration forward is one sequence
        fresh = _quantized_layer(layer.codec, num_blocks, block_size, num_kv_heads, layer.key.device, layer.rotation,
                                 _staging(layer.codec, 1, block_size), torch.float32 if stage is None else stage.dtype)
        if layer.key_tensor_scale is not None:
            fresh.key_tensor_scale.copy_(layer.key_tensor_scale)
            fresh.value_tensor_scale.copy_(layer.value_tensor_scale)
        fresh.calibrating, fresh.writer, fresh.key_offset_channels = layer.calibrating, layer.writer, layer_channels
        fresh.group = layer.group
        scratch.append(fresh)
    return scratch


def adopt_calibration(layers: list[LayerKVCache], measured: list[LayerKVCache]) -> None:
    """The key offsets (and calibrated fp8 scales) that calibration caches measured, into the pool's layers."""
    for layer, scratch in zip(layers, measured, strict=True):
        assert scratch.key_offset is not None, "a layer's keys never reached its cache"
        layer.key_offset = scratch.key_offset
        if layer.calibrating:
            layer.key_tensor_scale.copy_(scratch.key_tensor_scale)
            layer.value_tensor_scale.copy_(scratch.value_tensor_scale)
            layer.calibrating = False


K_SCALE_RANGE, V_SCALE_RANGE = 200.0, 100.0
_MIN_TENSOR_SCALE = 1e-6


def set_fp8_scales(layers: list[LayerKVCache], checkpoint_scales: dict[int, tuple[float, float]],
                   calculate: bool) -> str | None:
    """fp8 pools: the checkpoint's k_scale/v_scale where it has them, else calibration on the first batch (the
    start-up text) under --calculate-kv-scales, else 1.0 (vLLM's order). Returns where the scales come from, for
    the log; None for pools without per-tensor scales."""
    if not layers or layers[0].key_tensor_scale is None:
        return None
    if checkpoint_scales:
        for index, layer in enumerate(layers):
            k_scale, v_scale = checkpoint_scales.get(index, (1.0, 1.0))
            layer.key_tensor_scale.fill_(k_scale)
            layer.value_tensor_scale.fill_(v_scale)
        return f"the checkpoint's k_scale/v_scale ({len(checkpoint_scales)} layers)"
    if calculate:
        for layer in layers:
            layer.calibrating = True
        return "calculated at start-up on the built-in calibration text (--calculate-kv-scales)"
    return "1.0 (pass --calculate-kv-scales to calibrate them)"


def allocate_kv_storage(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    kv_cache_dtype: str | None = None,
    staging_rows: int = 8,
    layout: KVCacheLayout | None = None,
) -> list[LayerKVCache]:
    """One LayerKVCache per model layer. `dtype`: the unquantized KV dtype; `kv_cache_dtype` (fp8, fp8_e4m3,
    fp8_e5m2, int8, int4) quantizes. `staging_rows`: int4's staging rows (key_staging.py; the engine passes
    --max-num-seqs). `layout` (default: one group of every layer): the pool holds layout.num_slots layers' tensors,
    and the k-th layer of each group reads and writes slot k's (the scales of a per-tensor format stay per layer)."""
    layout = layout or kv_cache_layout([None] * num_layers)
    assert sum(len(group.layers) for group in layout.groups) == num_layers
    codec = codec_for(kv_cache_dtype, head_dim) if kv_cache_dtype else None
    if codec is None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: padded block-table entries read block contents that attention then masks out,
        # and NaN garbage times a zero weight would still be NaN.
        slots = [LayerKVCache(huge_pages.full(shape, 0, dtype, device), huge_pages.full(shape, 0, dtype, device))
                 for _ in range(layout.num_slots)]
    else:
        rotation = rotation_matrix(codec.head_dim, device) if codec.rotates else None  # one, shared by every layer
        staging = [_staging(codec, staging_rows, block_size) for _ in layout.groups]  # one per group's slot mapping
        slots = [_quantized_layer(codec, num_blocks, block_size, num_kv_heads, device, rotation, staging[0], dtype)
                 for _ in range(layout.num_slots)]
    layers: list[LayerKVCache | None] = [None] * num_layers
    for group_index, group in enumerate(layout.groups):
        for slot, layer in enumerate(group.layers):
            shared = slots[slot] if group_index == 0 else _sharing(slots[slot], staging[group_index] if codec else None)
            shared.group = group_index
            layers[layer] = shared
    return layers


def _sharing(slot: LayerKVCache, staging: KeyStaging | None) -> LayerKVCache:
    """Another layer over `slot`'s per-block tensors, with its own per-layer state (tensor scales, int4 staging)."""
    def fresh(tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else torch.ones_like(tensor) if tensor.dim() == 0 else torch.zeros_like(tensor)

    return LayerKVCache(slot.key, slot.value, slot.codec, slot.key_scales, slot.value_scales,
                        fresh(slot.key_tensor_scale), fresh(slot.value_tensor_scale), slot.rotation,
                        key_staging=staging, key_stage=fresh(slot.key_stage))


def _staging(codec: KVCodec, rows: int, block_size: int) -> KeyStaging | None:
    return KeyStaging(rows, block_size) if codec.keys_per_block else None


def _quantized_layer(codec: KVCodec, num_blocks: int, block_size: int, num_kv_heads: int,
                     device: torch.device | str, rotation: torch.Tensor | None, staging: KeyStaging | None,
                     stage_dtype: torch.dtype) -> LayerKVCache:
    data_shape = (num_blocks, block_size, num_kv_heads, codec.data_dim)

    def data(keys: bool) -> torch.Tensor:
        # int4 values' zero byte would decode to -8 x scale; 0x88 is two zeros. int4 keys' zero byte decodes to 0
        # under zero channel bytes, as fp8's and int8's does.
        fill = 0x88 if codec.name == "int4" and not keys else 0
        return huge_pages.full(data_shape, fill, codec.data_dtype, device)

    def scales() -> torch.Tensor | None:
        if codec.scales_per_vector == 0:
            return None
        return torch.zeros((num_blocks, block_size, num_kv_heads, codec.scales_per_vector), dtype=codec.scale_dtype,
                           device=device)

    def tensor_scale() -> torch.Tensor | None:
        return torch.ones((), dtype=torch.float32, device=device) if codec.scales_per_vector == 0 else None

    def key_scales() -> torch.Tensor | None:
        if staging is None:
            return scales()
        return torch.zeros((num_blocks, num_kv_heads, 2, codec.head_dim), dtype=torch.uint8, device=device)

    stage = None if staging is None else torch.zeros(
        (staging.capacity, block_size, num_kv_heads, codec.head_dim), dtype=stage_dtype, device=device)
    return LayerKVCache(data(True), data(False), codec, key_scales(), scales(), tensor_scale(), tensor_scale(),
                        rotation, key_staging=staging, key_stage=stage)
