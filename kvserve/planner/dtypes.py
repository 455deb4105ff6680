"""Dtype names as `--dtype` and config.json spell them, and their sizes."""

from __future__ import annotations

from typing import Any

from kvserve.planner.errors import PlannerError

DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}

_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "torch.float32": "float32",
    "torch.float16": "float16",
    "torch.bfloat16": "bfloat16",
}

MODEL_DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32", "half", "float", "bf16", "fp16")


def normalize_dtype(name: str) -> str:
    canonical = _ALIASES.get(name.lower(), name.lower())
    if canonical not in DTYPE_BYTES:
        raise PlannerError(f"--dtype {name!r}: expected one of {', '.join(MODEL_DTYPE_CHOICES)}")
    return canonical


def resolve_model_dtype(dtype_flag: str, checkpoint_dtype: Any) -> str:
    """`--dtype auto` follows the checkpoint, except that float32 checkpoints run in bfloat16.

    That is what vLLM does on GPUs with bf16 support: nobody serves in fp32, and planning fp32 weights would
    double the weight bytes of every small model whose config.json says float32 (SmolLM2, many fine-tunes).
    """
    if dtype_flag != "auto":
        return normalize_dtype(dtype_flag)
    if not checkpoint_dtype:
        return "bfloat16"
    try:
        resolved = normalize_dtype(str(checkpoint_dtype))
    except PlannerError:
        return "bfloat16"
    return "bfloat16" if resolved == "float32" else resolved
