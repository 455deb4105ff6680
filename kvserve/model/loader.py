"""One entry point for every checkpoint kvserve loads: `load_model(model, dtype)`.

`model` is a Hugging Face folder, a `.gguf` file (or a folder holding exactly one), or None for the demo model.
Weights stream one tensor at a time into an uninitialised model of the target dtype, under a progress bar.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from kvserve.config import TEXT_MODEL_OF, ModelConfig, ModelLoadError
from kvserve.heap import keep_freed_blocks
from kvserve.model.cpu_isa import native_bf16, selected_isa
from kvserve.model.cpu_kernels import cpu_kernels, packed_weights_are_faster
from kvserve.model.demo import DEMO_MODEL_NAME, demo_model_path
from kvserve.model.hf_checkpoint import (
    count_safetensors_tensors, iter_safetensors, read_generation_config, read_hf_config, safetensors_files,
    safetensors_matrix_dtype,
)
from kvserve.model.gemma3 import Gemma3ForCausalLM
from kvserve.model.layers import bound_onednn_caches
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.quant_weight import QuantPart
from kvserve.model.tensor_parallel import WHOLE_MODEL, TensorShard, check_shardable
from kvserve.model.tokenizer import Tokenizer, load_hf_tokenizer
from kvserve.model.weights import load_weights, quant_weights

logger = logging.getLogger("kvserve.model")

# The module that computes each architecture (config.SUPPORTED_ARCHITECTURES); the rest are Llama's.
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {"Gemma3ForCausalLM": Gemma3ForCausalLM}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
DTYPE_ALIASES = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32"}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer
    generation_config: dict
    path: Path
    name: str  # what the server calls it by default
    dtype: torch.dtype
    hf_config: dict  # the config.json dict (translated from metadata for GGUF), for the planner
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype under --kv-cache-dtype auto; None: `dtype`

    def __post_init__(self) -> None:
        self.kv_dtype = self.kv_dtype or self.dtype

    @property
    def num_kv_heads(self) -> int:
        """KV heads this process computes and caches: all of them, or its tensor-parallel share."""
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def weights_bytes(self) -> int:
        return self.model.weight_bytes()

    @property
    def eos_token_ids(self) -> list[int]:
        """Every id that ends generation: generation_config's, the config's and the tokenizer's EOS."""
        ids: list[int] = []
        gen_eos = self.generation_config.get("eos_token_id")
        for source in (gen_eos if isinstance(gen_eos, list) else [gen_eos], self.config.eos_token_ids,
                       [self.tokenizer.eos_token_id]):
            ids.extend(i for i in source if i is not None and i not in ids)
        return ids


def resolve_model_path(model: str | None) -> Path:
    if model is None:
        return demo_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{model}: no such file or folder (kvserve loads offline: pass a local Hugging Face folder or a .gguf file)"
        )
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(f"{path}: no config.json" + (f" and {len(ggufs)} .gguf files; name one" if ggufs else ""))
    return path


def resolve_dtype(dtype: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    return resolve_dtypes(dtype, config, device)[0]


def resolve_dtypes(dtype: str, config: ModelConfig, device: torch.device) -> tuple[torch.dtype, torch.dtype]:
    """(compute dtype, the KV cache's dtype under --kv-cache-dtype auto).

    The KV cache follows the model's dtype, as in vLLM. When `--dtype auto` computes a 16-bit checkpoint in
    fp32 (a CPU without native bf16, where fp32 matmuls are the fast ones), the model's dtype is still the
    checkpoint's: K/V stay in it, with half fp32's bytes (twice the tokens in the pool, half the bandwidth
    per decode step), and the kernels widen them as they read.
    """
    name = DTYPE_ALIASES.get(dtype, dtype)
    kv_name = None
    if name == "auto":
        name = str(config.torch_dtype or "bfloat16").removeprefix("torch.")
        if name not in DTYPES:
            name = "bfloat16"
        if device.type == "cpu" and name != "float32" and not native_bf16():
            # bf16 only where the CPU has bf16 dot products (AVX512-BF16, AMX); elsewhere torch's bf16 and fp16
            # matmuls run at a fraction of fp32's speed.
            name, kv_name = "float32", name
        elif device.type == "cpu" and name == "float16":
            name = "bfloat16"  # bf16 dot products are native here, fp16 ones are not
        if name == "bfloat16" and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 8:
            name = "float16"  # GPUs before Ampere only emulate bf16
    if name not in DTYPES:
        raise ValueError(f"--dtype must be one of auto, bfloat16, float16, float32; got {dtype!r}")
    return DTYPES[name], DTYPES[kv_name or name]


def cpu_dispatch_line(dtype: torch.dtype, kernels_built: bool, kv_dtype: torch.dtype | None = None) -> str:
    """One line for the start-up log: what this CPU has, and the compute dtype, KV dtype and kernels chosen."""
    isa = selected_isa()
    bf16 = "native bf16" if native_bf16() else "no native bf16"
    kernels = f"{isa.label} kernels" if kernels_built else "portable torch path (no CPU kernels)"
    kv = "" if kv_dtype in (None, dtype) else f", {_name(kv_dtype)} KV cache"
    line = f"CPU: {isa.label}, {bf16} -> {_name(dtype)} compute{kv}, {kernels}"
    if dtype != torch.float32 and not native_bf16():
        line += " (float32 computes faster on this CPU: --dtype auto picks it)"
    return line


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def load_model(model: str | None = None, dtype: str = "auto", device: str | torch.device = "cpu",
               shard: TensorShard = WHOLE_MODEL, gguf_blocks: bool = True) -> LoadedModel:
    """`shard`: the tensor-parallel rank whose slice of the weights to load (default: all of them).
    `gguf_blocks`: a GGUF file's quantized matrices stay its blocks where the CPU kernels read them (False:
    dequantized at load, as --gguf-weights dequantized)."""
    started = time.perf_counter()
    bound_onednn_caches()
    path = resolve_model_path(model)
    device = torch.device(device)
    source = _source(path)
    config = ModelConfig.from_hf_dict(source.config, source=str(source.config_file))
    if shard.size > 1:
        check_shardable(source.config, config, shard.size, str(source.config_file))
    torch_dtype, kv_dtype = resolve_dtypes(dtype, config, device)
    tokenizer = source.tokenizer()
    kernels = cpu_kernels() if device.type == "cpu" else None
    if device.type == "cpu":
        keep_freed_blocks()
    weight_dtype = held_weight_dtype(source.matrix_dtype(), torch_dtype, kernels)
    with torch.device(device):
        net = MODEL_CLASSES.get(config.architecture, LlamaForCausalLM)(config, torch_dtype, shard, weight_dtype)
    net.fused_kernels = kernels
    held = quant_weights(net, source.quant_parts(), net.fused_kernels) if gguf_blocks and _holds_blocks(net, shard) else {}
    held_names = frozenset(name for _, names in held.values() for name in names)
    with tqdm(total=source.num_tensors(), desc=f"Loading {path.name}", unit="tensor", leave=False) as bar:
        load_weights(net, source.tensors(torch_dtype, held_names), checkpoint=str(path), on_tensor=bar.update,
                     held=held_names)
    net.hold_quant_weights({name: weight for name, (weight, _) in held.items()})
    if kernels is not None:
        packed = weight_dtype == torch_dtype and packed_weights_are_faster(torch_dtype)
        net.hold_dense_weights(packed)
        if shard.rank == 0 and len(held) < 4 * config.num_hidden_layers:  # some matmul weights not GGUF blocks
            logger.info("CPU matmul weights not held as GGUF blocks: %s", "oneDNN's packed layout alone" if packed
                        else f"{_name(weight_dtype)} rows read in place (quant_linear)")
    net.eval()
    if device.type == "cpu" and shard.rank == 0:
        logger.info("%s", cpu_dispatch_line(torch_dtype, net.fused_kernels is not None, kv_dtype))
    name = DEMO_MODEL_NAME if model is None else str(model)
    rank = f" (tensor-parallel rank {shard.rank} of {shard.size})" if shard.size > 1 else ""
    logger.info(
        "Loaded %s (%s) from %s%s: %.1fM parameters, %s, %s in %.1f s",
        name, config.architecture, path, rank, net.parameter_count() / 1e6, str(torch_dtype).removeprefix("torch."),
        weights_line(net.weight_bytes(), source.parameter_bytes(), len(held)), time.perf_counter() - started,
    )
    return LoadedModel(
        net, config, tokenizer, source.generation_config(), path, name, torch_dtype, source.config, kv_dtype
    )


def held_weight_dtype(stored: torch.dtype | None, compute: torch.dtype, kernels) -> torch.dtype:
    """The matmul weights' dtype: the compute dtype, except that matrices stored 16-bit and computed in fp32 by
    the CPU kernels (a CPU without bf16 dot products) stay 16-bit: the kernels widen them as they read, so they
    cost the file's bytes, not twice. `stored`: the checkpoint's matrices' dtype (None: quantized or mixed)."""
    if kernels is not None and compute == torch.float32 and stored in (torch.bfloat16, torch.float16):
        return stored
    return compute


def _holds_blocks(net: LlamaForCausalLM, shard: TensorShard) -> bool:
    """Whether matmul weights stay GGUF blocks (quant_weight.py): with the CPU kernels, on a whole model (a
    tensor-parallel shard dequantizes its slices as before)."""
    return net.fused_kernels is not None and shard.size == 1


def weights_line(held_bytes: int, file_bytes: int | None, block_weights: int) -> str:
    """The weights' resident bytes beside the checkpoint's, for the start-up log."""
    line = f"{held_bytes / 2**20:.1f} MiB of weights"
    if file_bytes:
        line += f" ({held_bytes / file_bytes:.2f}x the file's {file_bytes / 2**20:.1f} MiB of tensors"
        line += f"; {block_weights} matmul weights read as GGUF blocks)" if block_weights else ")"
    return line


def check_tensor_parallel(model: str | None, size: int) -> None:
    """Refuses a --tensor-parallel-size the model cannot be split into, before any worker starts."""
    source = _source(resolve_model_path(model))
    config = ModelConfig.from_hf_dict(source.config, source=str(source.config_file))
    check_shardable(source.config, config, size, str(source.config_file))


def load_tokenizer(model: str | None = None) -> Tokenizer:
    """The model's tokenizer and chat template alone, without its weights (`kvserve advise` re-renders prompts)."""
    return _source(resolve_model_path(model)).tokenizer()


def _source(path: Path):
    return _GGUFSource(path) if path.suffix == ".gguf" else _HFSource(path)


class _HFSource:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.config_file = folder / "config.json"
        self.config = read_hf_config(folder)
        self.files = safetensors_files(folder)

    def tokenizer(self) -> Tokenizer:
        return load_hf_tokenizer(self.folder)

    def generation_config(self) -> dict:
        return read_generation_config(self.folder)

    def num_tensors(self) -> int:
        return count_safetensors_tensors(self.files)

    def tensors(self, dtype: torch.dtype, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor, str]]:
        if (self.config.get("architectures") or [None])[0] not in TEXT_MODEL_OF:
            return iter_safetensors(self.files, dtype)
        # A multimodal checkpoint: its language model's tensors under their text model names (the vision
        # tower's match no parameter and are skipped).
        return ((_text_model_name(name), tensor, file) for name, tensor, file in iter_safetensors(self.files, dtype))

    def quant_parts(self) -> Iterator[tuple[str, QuantPart]]:
        return iter(())  # safetensors hold plain (or differently quantized) tensors

    def matrix_dtype(self) -> torch.dtype | None:
        return safetensors_matrix_dtype(self.files)

    def parameter_bytes(self) -> int:
        return sum(file.stat().st_size for file in self.files)


# Where multimodal checkpoints keep their language model: transformers 4 wrote "language_model.model.*", 5 writes
# "model.language_model.*".
TEXT_MODEL_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
                       "language_model.lm_head.": "lm_head."}


def _text_model_name(name: str) -> str:
    for prefix, text_prefix in TEXT_MODEL_PREFIXES.items():
        if name.startswith(prefix):
            return text_prefix + name.removeprefix(prefix)
    return name


class _GGUFSource:
    def __init__(self, path: Path) -> None:
        from kvserve.model.gguf_file import read_gguf_config

        self.path = path
        self.config_file = path
        self.config = read_gguf_config(str(path))

    def tokenizer(self) -> Tokenizer:
        from kvserve.model.gguf_tokenizer import load_gguf_tokenizer

        data = load_gguf_tokenizer(str(self.path))
        special = {"bos_token": data.bos_token, "eos_token": data.eos_token, "unk_token": data.unk_token,
                   "pad_token": data.pad_token}
        return Tokenizer(backend=data.backend, special_tokens=special, chat_template=data.chat_template)

    def generation_config(self) -> dict:
        return {key: self.config[key] for key in ("bos_token_id", "eos_token_id") if self.config.get(key) is not None}

    def num_tensors(self) -> int:
        from kvserve.model.gguf_file import gguf_tensor_count

        return gguf_tensor_count(str(self.path))

    def tensors(self, dtype: torch.dtype, skip: frozenset[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor, str]]:
        from kvserve.model.gguf_file import iter_gguf_tensors

        for name, tensor in iter_gguf_tensors(str(self.path), dtype, skip):
            yield name, tensor, str(self.path)

    def quant_parts(self) -> Iterator[tuple[str, QuantPart]]:
        from kvserve.model.gguf_file import iter_gguf_quant_parts

        return iter_gguf_quant_parts(str(self.path))

    def matrix_dtype(self) -> torch.dtype | None:
        from kvserve.model.gguf_file import gguf_matrix_dtype

        return gguf_matrix_dtype(str(self.path))

    def parameter_bytes(self) -> int:
        from kvserve.model.gguf_file import gguf_parameter_bytes

        return gguf_parameter_bytes(str(self.path))
