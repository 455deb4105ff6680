"""kvserve: an LLM serving stack built around the KV cache."""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvserve.engine.llm",
    "SamplingParams": "kvserve.engine.sampling_params",
    "LLMEngine": "kvserve.engine.llm_engine",
}


def __getattr__(name: str):
    # Lazy, so `import kvserve` (and `kvserve plan`) does not import torch.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "LLMEngine", "__version__"]
