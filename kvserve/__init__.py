"""kvserve: an LLM serving stack built around the KV cache."""

__version__ = "0.1.0"
