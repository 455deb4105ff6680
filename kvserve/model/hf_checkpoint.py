"""Reading a Hugging Face model folder: config.json, generation_config.json, single or sharded safetensors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from kvserve.config import ModelLoadError

SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found") from None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON ({exc})") from None


def read_hf_config(folder: Path) -> dict:
    return read_json(folder / "config.json")


def read_generation_config(folder: Path) -> dict:
    path = folder / "generation_config.json"
    return read_json(path) if path.exists() else {}


def safetensors_files(folder: Path) -> list[Path]:
    """The checkpoint's weight files: the shards named by the index, or the single model.safetensors."""
    index_path = folder / SAFETENSORS_INDEX
    if index_path.exists():
        weight_map = read_json(index_path).get("weight_map") or {}
        if not weight_map:
            raise ModelLoadError(f"{index_path}: empty weight_map")
        shard_names = sorted(set(weight_map.values()))
        missing = [name for name in shard_names if not (folder / name).exists()]
        if missing:
            raise ModelLoadError(f"{index_path}: shard file(s) missing: {', '.join(missing)}")
        return [folder / name for name in shard_names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights (kvserve loads safetensors or GGUF)")
    return files


def count_safetensors_tensors(files: list[Path]) -> int:
    total = 0
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            total += len(f.keys())
    return total


def iter_safetensors(files: list[Path], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor, str]]:
    """Yields (tensor name, tensor cast to dtype, file name) one tensor at a time, so peak memory stays low."""
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype), str(path)


SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def safetensors_matrix_dtype(files: list[Path]) -> torch.dtype | None:
    """The dtype every matrix of the checkpoint is stored in when that is one float type (read from the headers);
    None when the types differ or are not floats."""
    found = set()
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                if len(tensor.get_shape()) == 2:
                    found.add(tensor.get_dtype())
    return SAFETENSORS_DTYPES.get(found.pop()) if len(found) == 1 else None
