"""A real-size model without downloading one: random weights in Llama-3.2-3B's shape, as an HF folder (bf16
safetensors + tokenizer), a GGUF f16 made from it by llama.cpp's own `convert_hf_to_gguf.py`, and a Q4_K_M made
from that by `llama-quantize`. Random weights (std 0.02, fixed seed) give degenerate text but the same speed as
trained ones: every engine does the same arithmetic on them.

    python benchmarks/random_llama.py --llama-cpp SRC --llama-quantize BIN [--out DIR] [--convert-python PY]

SRC is the llama.cpp source folder (the PyPI sdist's `vendor/llama.cpp`, ../shared/peers/llama-server.md); BIN
its built `llama-quantize`. Each output is kept and reused when it exists, so a rerun costs nothing.

The tokenizer: the demo model's (SmolLM2's byte-level BPE, 49,152 entries) has the wrong size for a 128,256-row
embedding, so it is widened to 128,256 with plain vocabulary entries `<filler_N>` that no merge produces (they
never come out of encoding; the model may still emit them). Its pre-tokenizer is SmolLM2's own (single digits,
then byte-level), so the converter recognises it as "smollm", the demo GGUF's pre-tokenizer too.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

# meta-llama/Llama-3.2-3B's config.json, less the token ids (they are the tokenizer's, below).
LLAMA_3_2_3B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 28,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "initializer_range": 0.02,
    "vocab_size": 128256,
}
NAME = "llama-3.2-3b-random"
SEED = 0


def widened_demo_tokenizer(vocab_size: int):
    """The demo model's tokenizer as a transformers fast tokenizer of exactly `vocab_size` entries."""
    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvserve.model.demo import demo_model_path
    from kvserve.model.gguf_file import read_gguf_metadata
    from kvserve.model.gguf_tokenizer import load_gguf_tokenizer

    demo = load_gguf_tokenizer(str(demo_model_path()))
    spec = json.loads(demo.backend.to_str())
    vocab = spec["model"]["vocab"]
    if len(vocab) > vocab_size:
        raise ValueError(f"the demo vocabulary ({len(vocab)}) is larger than {vocab_size}")
    vocab.update({f"<filler_{i}>": i for i in range(len(vocab), vocab_size)})
    backend = Tokenizer.from_str(json.dumps(spec))
    # SmolLM2's tokenizer.json splits single digits before the byte-level split (kvserve's GGUF reader does not).
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    template = read_gguf_metadata(str(demo_model_path())).get("tokenizer.chat_template")
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=demo.bos_token, eos_token=demo.eos_token,
                                   unk_token=demo.unk_token, pad_token=demo.pad_token, chat_template=template,
                                   additional_special_tokens=[t for t in demo.special_tokens
                                                              if t not in (demo.bos_token, demo.eos_token)])


def build_hf_folder(out: Path, shape: dict | None = None, seed: int = SEED) -> Path:
    """Random bf16 weights in `shape` (default Llama-3.2-3B's) with the widened tokenizer, saved to `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = shape or LLAMA_3_2_3B
    tokenizer = widened_demo_tokenizer(shape["vocab_size"])
    config = LlamaConfig(**{k: v for k, v in shape.items() if k not in ("architectures", "model_type")},
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bf16 directly: fp32 first would need twice the memory
    try:
        model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    partial = out.with_name(out.name + ".partial")
    model.save_pretrained(partial, safe_serialization=True)
    tokenizer.save_pretrained(partial)
    partial.rename(out)
    return out


def convert_to_gguf(hf_folder: Path, out: Path, llama_cpp: Path, python: str) -> Path:
    partial = out.with_name(out.name + ".partial")
    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    subprocess.run([python, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf_folder), "--outtype", "f16",
                    "--outfile", str(partial)], check=True, env=env)
    partial.rename(out)
    return out


def quantize(f16: Path, out: Path, llama_quantize: str, quant_type: str = "Q4_K_M") -> Path:
    partial = out.with_name(out.name + ".partial")
    subprocess.run([llama_quantize, str(f16), str(partial), quant_type, str(len(os.sched_getaffinity(0)))],
                   check=True)
    partial.rename(out)
    return out


def output_paths(out_dir: Path) -> dict[str, Path]:
    return {"hf": out_dir / f"{NAME}-hf", "f16": out_dir / f"{NAME}-f16.gguf", "q4_k_m": out_dir / f"{NAME}-Q4_K_M.gguf"}


def build_all(out_dir: Path, llama_cpp: Path, llama_quantize: str, python: str = sys.executable) -> dict[str, Path]:
    """The HF folder, the f16 GGUF and the Q4_K_M GGUF in `out_dir`, each built only when missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = output_paths(out_dir)
    if not paths["hf"].is_dir():
        build_hf_folder(paths["hf"])
    if not paths["f16"].is_file():
        convert_to_gguf(paths["hf"], paths["f16"], llama_cpp, python)
    if not paths["q4_k_m"].is_file():
        quantize(paths["f16"], paths["q4_k_m"], llama_quantize)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp source folder")
    parser.add_argument("--llama-quantize", required=True, help="llama.cpp's llama-quantize binary")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "models")
    parser.add_argument("--convert-python", default=sys.executable,
                        help="Python with torch, transformers and sentencepiece for convert_hf_to_gguf.py")
    args = parser.parse_args()
    for kind, path in build_all(args.out, args.llama_cpp, args.llama_quantize, args.convert_python).items():
        size = sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size
        print(f"{kind:7} {size / 1e9:6.2f} GB  {path}")


if __name__ == "__main__":
    main()
