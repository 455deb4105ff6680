"""Builds the KV tiers an engine's flags ask for (--kv-offloading-size, --kv-disk-path) over its pool storage.

The disk tier's fingerprint names everything a stored block depends on: the weights' identity (each weight
file's name, size and a digest of its head and of samples of its bytes; never times), the compute dtype, the
KV format, its fp8 scales and key offsets, the block size and the per-block tensor shapes. A block written
under any other combination is never read back, and is removed when the tier starts
(cache/storage/disk_tier.py).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import xxhash

from kvserve.cache.storage.block_copier import BlockCopier
from kvserve.cache.storage.block_file import LAYOUT_VERSION
from kvserve.cache.storage.disk_tier import DiskTier
from kvserve.cache.storage.host_tier import HostTier
from kvserve.cache.storage.kv_storage import LayerKVCache
from kvserve.cache.storage.kv_tiers import KVTiers
from kvserve.cache.storage.tier import Tier
from kvserve.config import CacheConfig
from kvserve.model.loader import LoadedModel

logger = logging.getLogger("kvserve.engine")
GIB = 2**30
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".json")
# What the fingerprint reads of each weight file (sampled_digest): its head whole, then this many samples.
DIGEST_HEAD_BYTES = 2**20
DIGEST_SAMPLES = 16
DIGEST_SAMPLE_BYTES = 64 * 2**10


def build_tiers(cache: CacheConfig, loaded: LoadedModel, layers: list[LayerKVCache], kv_format: str,
                copier: BlockCopier | None = None) -> KVTiers | None:
    """`copier`: how blocks leave and enter the pool (default: this process's pool alone)."""
    if cache.kv_offloading_size is None and cache.kv_disk_path is None:
        return None
    copier = copier or BlockCopier(layers)
    tiers_top_first: list[Tier] = []
    if cache.kv_offloading_size is not None:
        tiers_top_first.append(HostTier(int(cache.kv_offloading_size * GIB)))
    if cache.kv_disk_path is not None:
        tiers_top_first.append(DiskTier(cache.kv_disk_path, int(cache.kv_disk_size * GIB),
                                        fingerprint(loaded, layers, kv_format, cache.block_size, copier.shards),
                                        copier.payload_bytes))
    tiers = KVTiers(copier, tiers_top_first)
    logger.info("KV tiers: %s (%d B per block)", ", ".join(_describe(t) for t in tiers.tiers), copier.payload_bytes)
    return tiers


def _describe(tier) -> str:
    if isinstance(tier, HostTier):
        return f"host {tier.capacity_bytes / GIB:g} GiB"
    return f"disk {tier.capacity_bytes / GIB:g} GiB at {tier.path}"


def fingerprint(loaded: LoadedModel, layers: list[LayerKVCache], kv_format: str, block_size: int, shards: int = 1) -> str:
    first = layers[0]
    identity = {
        "layout": LAYOUT_VERSION,
        "weights": _weights_identity(Path(loaded.path)),
        "dtype": str(loaded.dtype),
        "kv_format": kv_format,
        "block_size": block_size,
        "num_layers": len(layers),
        "tensor_parallel_size": shards,  # a payload holds every rank's KV heads
        "tensors": [[list(t.shape[1:]), str(t.dtype)] for t in first.tensors()],
        "rotated": first.rotation is not None,  # blocks hold rotated K/V (int4, fp8)
        "fp8_scales": [[float(layer.key_tensor_scale), float(layer.value_tensor_scale)] for layer in layers
                       if layer.key_tensor_scale is not None],
        "key_offsets": _key_offsets_digest(layers),  # blocks hold keys less these (quantized formats)
    }
    return xxhash.xxh3_128_hexdigest(json.dumps(identity, sort_keys=True).encode())


def _key_offsets_digest(layers: list[LayerKVCache]) -> str | None:
    if layers[0].key_offset is None:
        return None
    digest = xxhash.xxh3_64()
    for layer in layers:
        digest.update(layer.key_offset.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def _weights_identity(path: Path) -> list:
    """Per weight file: its name, size and a digest of samples of its bytes. Not its mtime: a checkpoint copied
    again (a new pod, a restored volume) is the same model and must find its blocks."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    return [[file.name, file.stat().st_size, sampled_digest(file)] for file in files]


def sampled_digest(file: Path) -> str:
    """xxh3-64 of the file's head (its header and tensor index, config.json whole) and of evenly spread samples
    of the rest: a fine-tune of the same shape has the same header and size but other weights, so the samples
    differ, while reading a few MiB keeps start-up fast for checkpoints of any size."""
    size = file.stat().st_size
    digest = xxhash.xxh3_64()
    with open(file, "rb") as handle:
        if size <= DIGEST_HEAD_BYTES + DIGEST_SAMPLES * DIGEST_SAMPLE_BYTES:
            digest.update(handle.read())
            return digest.hexdigest()
        digest.update(handle.read(DIGEST_HEAD_BYTES))
        stride = (size - DIGEST_HEAD_BYTES - DIGEST_SAMPLE_BYTES) // (DIGEST_SAMPLES - 1)
        for index in range(DIGEST_SAMPLES):  # the last sample ends at the file's end
            handle.seek(DIGEST_HEAD_BYTES + index * stride)
            digest.update(handle.read(DIGEST_SAMPLE_BYTES))
    return digest.hexdigest()
