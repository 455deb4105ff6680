"""Exact weight bytes of a local checkpoint, read from safetensors headers (no tensor data, no torch).

A safetensors file starts with an 8-byte little-endian header length, then a JSON header mapping each tensor
name to its dtype, shape and byte offsets. That is enough to count every weight exactly.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.planner.dtypes import DTYPE_BYTES
from kvserve.planner.errors import PlannerError

# Bits per element, so 4-bit and 6-bit float formats stay exact.
SAFETENSORS_DTYPE_BITS: dict[str, int] = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16,
    "I64": 64, "I32": 32, "I16": 16, "I8": 8,
    "U64": 64, "U32": 32, "U16": 16, "U8": 8, "BOOL": 8,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6, "F6_E3M2": 6, "F4": 4,
}

# Float tensors that are converted to the serving dtype on load; everything else (packed ints, fp8 data,
# quantization scales) is loaded as stored.
_CONVERTIBLE_DTYPES = ("F32", "F16", "BF16")
_SCALE_SUFFIXES = ("scale", "scale_inv", "scales", "zeros", "g_idx", "absmax")
_MAX_HEADER_BYTES = 100 * 1024 * 1024
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


@dataclass(slots=True, frozen=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    num_bytes: int

    @property
    def num_elements(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count


@dataclass(slots=True, frozen=True)
class CheckpointWeights:
    """What a checkpoint's tensors cost once loaded.

    `float_params` load in the serving dtype (a float32 checkpoint served in bf16 takes 2 B/param);
    `fixed_bytes` load as stored. `skipped_bytes` are tensors the engine does not load by default
    (DeepSeek's multi-token-prediction layer, stored as `model.layers.<num_hidden_layers>`).
    """

    source: str
    float_params: int
    fixed_bytes: int
    stored_bytes: int
    skipped_bytes: int
    num_tensors: int

    def loaded_bytes(self, model_dtype: str) -> int:
        return self.float_params * DTYPE_BYTES[model_dtype] + self.fixed_bytes


def read_safetensors_header(path: Path) -> list[TensorEntry]:
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise PlannerError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > _MAX_HEADER_BYTES:
            raise PlannerError(f"{path}: header length {header_len} is implausible; not a safetensors file?")
        raw = handle.read(header_len)
    try:
        header: dict[str, Any] = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlannerError(f"{path}: safetensors header is not valid JSON ({exc})") from None
    return [_tensor_entry(path, name, info) for name, info in header.items() if name != "__metadata__"]


def _tensor_entry(path: Path, name: str, info: dict[str, Any]) -> TensorEntry:
    dtype, shape = info["dtype"], tuple(int(d) for d in info["shape"])
    start, end = info["data_offsets"]
    bits = SAFETENSORS_DTYPE_BITS.get(dtype)
    elements = 1
    for dim in shape:
        elements *= dim
    num_bytes = -(-elements * bits // 8) if bits else int(end) - int(start)
    if num_bytes != int(end) - int(start):
        raise PlannerError(f"{path}: tensor {name!r} {dtype}{list(shape)} disagrees with its byte offsets")
    return TensorEntry(name, dtype, shape, num_bytes)


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files the loader reads: those named by the index if there is one.

    Mistral repos ship both `consolidated.safetensors` and HF-format shards holding the same weights; counting
    both would double the model, so consolidated files are ignored when HF shards exist.
    """
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({folder / name for name in weight_map.values()})
    files = sorted(folder.glob("*.safetensors"))
    hf_shards = [f for f in files if not f.name.startswith("consolidated")]
    return hf_shards or files


def summarize_checkpoint(folder: Path, num_hidden_layers: int) -> CheckpointWeights | None:
    files = checkpoint_files(folder)
    if not files:
        return None
    float_params = fixed_bytes = stored_bytes = skipped_bytes = num_tensors = 0
    for path in files:
        if not path.is_file():
            raise PlannerError(f"{folder}: the safetensors index names {path.name}, which is missing")
        for tensor in read_safetensors_header(path):
            num_tensors += 1
            if _beyond_decoder(tensor.name, num_hidden_layers):
                skipped_bytes += tensor.num_bytes
                continue
            stored_bytes += tensor.num_bytes
            if tensor.dtype in _CONVERTIBLE_DTYPES and not tensor.name.endswith(_SCALE_SUFFIXES):
                float_params += tensor.num_elements
            else:
                fixed_bytes += tensor.num_bytes
    source = f"{len(files)} safetensors file{'s' if len(files) > 1 else ''} in {folder}"
    return CheckpointWeights(source, float_params, fixed_bytes, stored_bytes, skipped_bytes, num_tensors)


def _beyond_decoder(name: str, num_hidden_layers: int) -> bool:
    match = _LAYER_INDEX.search(name)
    return bool(match) and int(match.group(1)) >= num_hidden_layers and "vision" not in name
