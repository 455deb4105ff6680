"""Where a ModelSpec comes from: a registry id, a local HF folder, a config.json path, or a .gguf file.

Kept apart from specs.py, which the registry and the GGUF reader both build on, so the imports point one way.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from kvserve.planner.checkpoint import summarize_checkpoint
from kvserve.planner.errors import PlannerError
from kvserve.planner.gguf_spec import spec_from_gguf
from kvserve.planner.registry import registry_spec
from kvserve.planner.specs import ModelSpec, spec_from_hf_config


def load_spec(model: str) -> ModelSpec:
    """A registry id, a local HF folder, a config.json path, or a .gguf file -> ModelSpec."""
    path = Path(model).expanduser()
    if path.is_dir():
        return _spec_from_folder(path, model)
    if path.is_file():
        if path.suffix == ".gguf":
            return spec_from_gguf(path)
        return _spec_from_config_file(path, model)
    return registry_spec(model)


def _spec_from_folder(folder: Path, name: str) -> ModelSpec:
    config_path = folder / "config.json"
    if config_path.is_file():
        return _spec_from_config_file(config_path, name)
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return spec_from_gguf(ggufs[0])
    raise PlannerError(f"{folder}: no config.json (and not exactly one .gguf file) in this folder")


def _spec_from_config_file(config_path: Path, name: str) -> ModelSpec:
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{config_path}: not valid JSON ({exc})") from None
    spec = spec_from_hf_config(config, source=str(config_path), name=name)
    checkpoint = summarize_checkpoint(config_path.parent, spec.num_layers)
    return replace(spec, checkpoint=checkpoint) if checkpoint else spec
