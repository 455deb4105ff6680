"""GGUF files (llama.cpp / Ollama): metadata, a Hugging Face-style config, and dequantized weights.

The model layer speaks Hugging Face: `read_gguf_config` translates GGUF metadata into a `config.json`-style
dict (so `ModelConfig.from_hf_dict` stays the one parser), and `iter_gguf_tensors` yields tensors under HF
parameter names, in HF shape and orientation, with llama.cpp's Q/K row permutation undone.

The header is parsed here rather than with `gguf.GGUFReader`: that reader builds a numpy view per array
element, which costs ~1.7 s on a 49k-token vocabulary, while a plain struct walk takes a few tens of ms.
Block layouts, type sizes and dequantization come from the `gguf` package.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from kvserve.config import ModelLoadError
from kvserve.model.quant_weight import QUANT_LINEAR_TYPES, QuantPart
from kvserve.planner.gguf_spec import gguf_window_pattern

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF architecture -> (HF architecture, HF model_type). Mistral files say "llama" (llama.cpp computes
# them with the llama graph), so they load as Llama.
GGUF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}

# convert_hf_to_gguf interleaves the rotary halves of q_proj/k_proj rows for these architectures only.
PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

T = gguf.GGMLQuantizationType
FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
# The classic block quants; each is decoded by gguf.quants and covered by tests against a reference decoder.
QUANTIZED_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K})
SUPPORTED_TENSOR_TYPES = frozenset(FLOAT_TYPES) | QUANTIZED_TYPES

# llama.cpp tensor names -> HF names. Layer tensors are "blk.{i}.{suffix}".
GLOBAL_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
LAYER_TENSOR_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 names its four norms a layer differently: its ffn_norm is the MLP's input norm, and the post-attention
# norm normalizes the attention output (convert_hf_to_gguf's tensor_mapping: ATTN_POST_NORM, FFN_PRE_NORM...).
GEMMA3_LAYER_TENSOR_NAMES = LAYER_TENSOR_NAMES | {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
ARCH_LAYER_TENSOR_NAMES = {"gemma3": GEMMA3_LAYER_TENSOR_NAMES}
# Architectures whose norm weights convert_hf_to_gguf stored as 1 + weight (Gemma's norms multiply by 1 + weight);
# reading them subtracts the 1 again, as transformers does, so the model holds the checkpoint's own weight.
SHIFTED_NORM_ARCHITECTURES = frozenset({"gemma3"})
# llama.cpp's defaults for Gemma 3 files that do not say: the sliding layers' rope base and the pattern (five
# sliding layers, then a full one); a 27B (62 layers) scales attention by hidden / heads instead of head_dim.
GEMMA3_LOCAL_ROPE_BASE = 10000.0
GEMMA3_27B_LAYERS = 62

# Tensors that are not parameters: llama.cpp's per-dimension RoPE factors (llama3 scaling), which
# read_gguf_config turns back into `rope_scaling`.
NON_PARAMETER_TENSORS = frozenset({"rope_freqs.weight"})

# Candidate llama3 rope parameters tried when recovering `rope_scaling` from rope_freqs.weight
# (Llama 3.1 and 3.2 all use low 1, high 4, original context 8192).
LLAMA3_ROPE_CANDIDATES = [
    (low, high, original)
    for original in (8192, 4096, 16384, 32768, 131072)
    for low in (1.0, 2.0, 0.5)
    for high in (4.0, 8.0, 2.0)
]


# ---------------------------------------------------------------------------------------------- header


@dataclass(slots=True)
class GGUFTensorInfo:
    name: str
    gguf_shape: tuple[int, ...]  # GGUF order, innermost dimension first
    ggml_type: int
    data_offset: int  # absolute offset of the tensor's bytes in the file
    nbytes: int | None  # None when the type is unknown to the gguf package

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.gguf_shape))

    @property
    def type_name(self) -> str:
        try:
            return T(self.ggml_type).name
        except ValueError:
            return f"ggml type {self.ggml_type}"


@dataclass(slots=True)
class GGUFContents:
    path: str
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]

    def tensor(self, name: str) -> GGUFTensorInfo | None:
        return next((info for info in self.tensors if info.name == name), None)


V = gguf.GGUFValueType
SCALAR_FORMATS = {
    V.UINT8: "<B", V.INT8: "<b", V.UINT16: "<H", V.INT16: "<h", V.UINT32: "<I", V.INT32: "<i",
    V.FLOAT32: "<f", V.BOOL: "<?", V.UINT64: "<Q", V.INT64: "<q", V.FLOAT64: "<d",
}  # fmt: skip
ARRAY_DTYPES = {
    V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
    V.FLOAT32: "<f4", V.BOOL: "?", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8",
}  # fmt: skip


# Bounds on what a header may declare. llama.cpp's own reader has the same limits on dimensions; nested
# arrays are rare (none in llama.cpp's writers), so a few levels are plenty and a deeper file is malformed.
MAX_ARRAY_DEPTH = 8
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
# The fewest bytes one item of each kind takes in the file: counts are checked against the bytes left
# before anything is read or allocated, so a header cannot declare more than the file holds.
MIN_STRING_BYTES = 8  # a uint64 length
MIN_ARRAY_BYTES = 12  # item type (uint32) + count (uint64)
MIN_KV_BYTES = MIN_STRING_BYTES + 4 + 1  # key, value type, the smallest value
MIN_TENSOR_ENTRY_BYTES = MIN_STRING_BYTES + 4 + 4 + 8  # name, dimension count, type, offset


def _min_value_bytes(value_type: int) -> int:
    if value_type == V.STRING:
        return MIN_STRING_BYTES
    if value_type == V.ARRAY:
        return MIN_ARRAY_BYTES
    return struct.calcsize(SCALAR_FORMATS[V(value_type)])


@dataclass(slots=True)
class _HeaderCursor:
    """Reads little-endian GGUF header values from a buffer, front to back. Every length and count is checked
    against the bytes left before it is read or allocated; anything malformed raises ModelLoadError naming
    the problem and its offset."""

    buffer: mmap.mmap
    path: str = ""
    offset: int = 0

    def error(self, problem: str, offset: int | None = None) -> ModelLoadError:
        at = self.offset if offset is None else offset
        return ModelLoadError(f"{self.path}: corrupt GGUF header: {problem} at offset {at}")

    @property
    def remaining(self) -> int:
        return len(self.buffer) - self.offset

    def need(self, nbytes: int, what: str, offset: int | None = None) -> None:
        if nbytes > self.remaining:
            raise self.error(f"{what} needs {nbytes} bytes but only {max(self.remaining, 0)} are left", offset)

    def scalar(self, fmt: str, what: str = "value") -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        self.offset += size
        return value

    def count(self, what: str, min_item_bytes: int) -> int:
        """A uint64 count of items that take at least min_item_bytes each, checked against the bytes left."""
        at = self.offset
        count = self.scalar("<Q", what)
        if count * min_item_bytes > self.remaining:
            raise self.error(f"{what} {count} is more than the {self.remaining} bytes left can hold", at)
        return count

    def string(self, what: str = "string") -> str:
        length = self.count(f"{what} length", 1)
        raw = self.buffer[self.offset : self.offset + length]
        self.offset += length
        # llama.cpp writes some vocabularies with bytes that are not valid UTF-8 (partial byte tokens).
        return raw.decode("utf-8", errors="replace")

    def value_type(self, what: str) -> int:
        at = self.offset
        value_type = self.scalar("<I", what)
        if value_type not in V._value2member_map_:
            raise self.error(f"unknown {what} {value_type}", at)
        return value_type

    def value(self, value_type: int, depth: int = 0) -> Any:
        if value_type == V.STRING:
            return self.string()
        if value_type == V.ARRAY:
            return self.array(depth + 1)
        value = self.scalar(SCALAR_FORMATS[V(value_type)])
        if value_type == V.FLOAT32:
            # The shortest decimal that rounds to this float32: 1e-05, as config.json said, not 9.9999997e-06.
            return float(str(np.float32(value)))
        return value

    def array(self, depth: int = 1) -> list[Any]:
        if depth > MAX_ARRAY_DEPTH:
            raise self.error(f"arrays nested more than {MAX_ARRAY_DEPTH} deep")
        item_type = self.value_type("array item type")
        count = self.count("array count", _min_value_bytes(item_type))
        if item_type in ARRAY_DTYPES:
            dtype = np.dtype(ARRAY_DTYPES[V(item_type)])
            raw = self.buffer[self.offset : self.offset + count * dtype.itemsize]
            self.offset += count * dtype.itemsize
            return np.frombuffer(raw, dtype=dtype).tolist()
        return [self.value(item_type, depth) for _ in range(count)]


def read_gguf(path: str) -> GGUFContents:
    """Parses the header: all metadata and the tensor directory (no tensor data is read)."""
    try:
        file = open(path, "rb")
    except OSError as error:
        raise ModelLoadError(f"{path}: cannot read GGUF file: {error}") from error
    with file:
        if os.fstat(file.fileno()).st_size < 4:
            raise ModelLoadError(f"{path}: not a GGUF file (empty or truncated)")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            cursor = _HeaderCursor(buffer, path)
            try:
                return _parse_header(path, cursor)
            except ModelLoadError:
                raise
            except (struct.error, IndexError, KeyError, ValueError, TypeError, OverflowError, UnicodeDecodeError,
                    ZeroDivisionError, RecursionError, MemoryError) as error:  # fmt: skip
                # A backstop: the checks above should leave nothing to come here.
                raise cursor.error(f"{type(error).__name__}: {error}") from error


def _parse_header(path: str, cursor: _HeaderCursor) -> GGUFContents:
    buffer = cursor.buffer
    if buffer[:4] != GGUF_MAGIC:
        raise ModelLoadError(f"{path}: not a GGUF file (magic {bytes(buffer[:4])!r})")
    cursor.offset = 4
    version = cursor.scalar("<I", "version")
    if version not in SUPPORTED_GGUF_VERSIONS:
        raise ModelLoadError(f"{path}: unsupported GGUF version {version} (kvserve reads little-endian GGUF v2 and v3)")
    tensor_count = cursor.scalar("<Q", "tensor count")
    kv_count = cursor.scalar("<Q", "metadata count")
    if kv_count * MIN_KV_BYTES > cursor.remaining:
        raise cursor.error(f"metadata count {kv_count} is more than the {cursor.remaining} bytes left can hold", 16)
    metadata = {}
    alignment_offset = cursor.offset
    for _ in range(kv_count):
        key = cursor.string("metadata key")
        if key == "general.alignment":
            alignment_offset = cursor.offset
        metadata[key] = cursor.value(cursor.value_type(f"value type of {key!r}"))
    if tensor_count * MIN_TENSOR_ENTRY_BYTES > cursor.remaining:
        raise cursor.error(f"tensor count {tensor_count} is more than the {cursor.remaining} bytes left can hold")
    directory = [_read_tensor_entry(cursor) for _ in range(tensor_count)]
    alignment = _alignment(cursor, metadata, alignment_offset)
    data_start = math.ceil(cursor.offset / alignment) * alignment
    tensors = [
        GGUFTensorInfo(name, shape, ggml_type, data_start + offset, _tensor_nbytes(shape, ggml_type))
        for name, shape, ggml_type, offset in directory
    ]
    _check_tensor_bounds(path, tensors, len(buffer))
    return GGUFContents(path=path, version=version, metadata=metadata, tensors=tensors)


def _alignment(cursor: _HeaderCursor, metadata: dict[str, Any], offset: int) -> int:
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise cursor.error(f"general.alignment {alignment!r} is not a positive power of two", offset)
    return alignment


def _read_tensor_entry(cursor: _HeaderCursor) -> tuple[str, tuple[int, ...], int, int]:
    entry_offset = cursor.offset
    name = cursor.string("tensor name")
    num_dims = cursor.scalar("<I", "dimension count")
    if num_dims > MAX_TENSOR_DIMS:
        raise cursor.error(f"tensor {name!r} has {num_dims} dimensions (at most {MAX_TENSOR_DIMS})", entry_offset)
    shape = tuple(cursor.scalar("<Q", "dimension") for _ in range(num_dims))
    ggml_type = cursor.scalar("<I", "tensor type")
    offset = cursor.scalar("<Q", "tensor offset")
    if offset > len(cursor.buffer):
        raise cursor.error(f"tensor {name!r} starts at data offset {offset}, past the end of the file", entry_offset)
    return name, shape, ggml_type, offset


def _tensor_nbytes(gguf_shape: tuple[int, ...], ggml_type: int) -> int | None:
    try:
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[T(ggml_type)]
    except (ValueError, KeyError):
        return None
    return math.prod(gguf_shape) // block_size * block_bytes


def _check_tensor_bounds(path: str, tensors: list[GGUFTensorInfo], file_size: int) -> None:
    for info in tensors:
        if info.data_offset > file_size or (info.nbytes is not None and info.data_offset + info.nbytes > file_size):
            raise ModelLoadError(
                f"{path}: tensor {info.name!r} (bytes {info.data_offset}..{info.data_offset + (info.nbytes or 0)}) "
                f"runs past the end of the file ({file_size} bytes; truncated download?)"
            )


def read_gguf_metadata(path: str) -> dict[str, Any]:
    return read_gguf(path).metadata


def gguf_tensor_count(path: str) -> int:
    """How many tensors iter_gguf_tensors yields, for a progress bar."""
    return sum(info.name not in NON_PARAMETER_TENSORS for info in read_gguf(path).tensors)


# ---------------------------------------------------------------------------------------------- config


def gguf_architecture(contents: GGUFContents) -> str:
    """The GGUF architecture name, checked against what kvserve loads."""
    arch = contents.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"{contents.path}: unsupported GGUF architecture {arch!r}; kvserve loads {', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def read_gguf_config(path: str) -> dict[str, Any]:
    """A Hugging Face `config.json`-style dict for the model in this GGUF file."""
    contents = read_gguf(path)
    return gguf_config(contents)


def gguf_config(contents: GGUFContents) -> dict[str, Any]:
    arch = gguf_architecture(contents)
    meta = contents.metadata
    hf_architecture, model_type = GGUF_ARCHITECTURES[arch]

    def arch_value(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    for key in ("embedding_length", "block_count", "feed_forward_length", "attention.head_count"):
        if arch_value(key) is None:
            raise ModelLoadError(f"{contents.path}: missing GGUF metadata {arch}.{key}")
    hidden_size = int(arch_value("embedding_length"))
    num_heads = int(arch_value("attention.head_count"))
    head_dim = arch_value("attention.key_length") or arch_value("rope.dimension_count") or hidden_size // num_heads
    rope_theta = float(arch_value("rope.freq_base", 10000.0))
    config = {
        "architectures": [hf_architecture],
        "model_type": model_type,
        "vocab_size": _vocab_size(contents, arch),
        "hidden_size": hidden_size,
        "intermediate_size": int(arch_value("feed_forward_length")),
        "num_hidden_layers": int(arch_value("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(arch_value("attention.head_count_kv", num_heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(arch_value("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "max_position_embeddings": int(arch_value("context_length", 4096)),
        "tie_word_embeddings": contents.tensor("output.weight") is None,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_token_ids(meta),
        "torch_dtype": _dequantized_dtype_name(contents),
        "gguf_file_type": gguf_file_type_name(contents),
    }
    rope_scaling = _rope_scaling(contents, arch, rope_theta, int(head_dim))
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch == "gemma3":
        config |= _gemma3_config(arch_value, config)
    return config


def _gemma3_config(arch_value: Any, config: dict[str, Any]) -> dict[str, Any]:
    """The Gemma 3 keys llama.cpp keeps as metadata or hard-codes (llama-model.cpp's gemma3 hparams)."""
    num_layers, window = config["num_hidden_layers"], arch_value("attention.sliding_window")
    scalar = config["hidden_size"] // config["num_attention_heads"] if num_layers == GEMMA3_27B_LAYERS else config["head_dim"]
    extra = {
        "query_pre_attn_scalar": scalar,
        "rope_local_base_freq": float(arch_value("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
        "final_logit_softcapping": arch_value("final_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
    }
    if window:
        extra["sliding_window"] = int(window)
        extra |= gguf_window_pattern(arch_value("attention.sliding_window_pattern"), num_layers)
    return extra


def _vocab_size(contents: GGUFContents, arch: str) -> int:
    if f"{arch}.vocab_size" in contents.metadata:
        return int(contents.metadata[f"{arch}.vocab_size"])
    if "tokenizer.ggml.tokens" in contents.metadata:
        return len(contents.metadata["tokenizer.ggml.tokens"])
    embedding = contents.tensor("token_embd.weight")
    if embedding is None:
        raise ModelLoadError(f"{contents.path}: cannot tell the vocabulary size (no vocab_size, tokens or token_embd)")
    return embedding.hf_shape[0]


def _eos_token_ids(meta: dict[str, Any]) -> int | list[int] | None:
    # End-of-turn / end-of-message tokens stop generation in llama.cpp too; HF configs list them beside EOS.
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = list(dict.fromkeys(int(meta[key]) for key in keys if meta.get(key) is not None))
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else ids


def _tensor_type_counts(contents: GGUFContents) -> Counter[int]:
    # 1-D tensors (norms, biases) stay F32 whatever the file type, so they don't say what the file is.
    return Counter(info.ggml_type for info in contents.tensors if len(info.gguf_shape) > 1)


def gguf_file_type_name(contents: GGUFContents) -> str:
    """llama.cpp's name for the file's quantization ("Q4_K_M", "Q8_0", "F16"...)."""
    file_type = contents.metadata.get("general.file_type")
    if file_type is not None:
        try:
            return gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
        except ValueError:
            return f"file type {file_type}"
    counts = _tensor_type_counts(contents)
    if not counts:
        return "unknown"
    return GGUFTensorInfo("", (), counts.most_common(1)[0][0], 0, None).type_name


def _dequantized_dtype_name(contents: GGUFContents) -> str:
    # A float file keeps its own precision for --dtype auto; quantized weights dequantize to bfloat16.
    counts = _tensor_type_counts(contents)
    if counts and set(counts) <= set(FLOAT_TYPES):
        widest = max(counts, key=lambda ggml_type: FLOAT_TYPES[T(ggml_type)].itemsize)
        return str(FLOAT_TYPES[T(widest)]).removeprefix("torch.")
    return "bfloat16"


def _rope_scaling(contents: GGUFContents, arch: str, rope_theta: float, head_dim: int) -> dict[str, Any] | None:
    meta = contents.metadata
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none"):
        scaling = {"rope_type": scaling_type, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0))}
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    rope_freqs = contents.tensor("rope_freqs.weight")
    if rope_freqs is not None:
        return _llama3_scaling_from_rope_freqs(contents, rope_freqs, rope_theta, head_dim)
    return None


def _llama3_scaling_from_rope_freqs(
    contents: GGUFContents, rope_freqs: GGUFTensorInfo, rope_theta: float, head_dim: int
) -> dict[str, Any]:
    """convert_hf_to_gguf stores llama3 rope scaling only as per-dimension factors (rope_freqs.weight), not as
    parameters; the model layer takes parameters, so find the ones that reproduce the stored factors."""
    stored = _read_tensor(contents, rope_freqs, torch.float32).double()
    factor = float(stored.max())
    for low_freq_factor, high_freq_factor, original in LLAMA3_ROPE_CANDIDATES:
        expected = llama3_rope_factors(rope_theta, head_dim, factor, low_freq_factor, high_freq_factor, original)
        if expected.shape == stored.shape and torch.allclose(expected, stored, rtol=1e-4, atol=1e-6):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original,
            }
    raise ModelLoadError(
        f"{contents.path}: tensor 'rope_freqs.weight' holds RoPE factors that match no llama3 rope scaling "
        "kvserve knows; the model cannot be computed faithfully"
    )


def llama3_rope_factors(
    rope_theta: float, head_dim: int, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> torch.Tensor:
    """The per-dimension divisors of the rotary frequencies under llama3 scaling, as llama.cpp stores them."""
    inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    between = 1.0 / ((1 - smooth) / factor + smooth)
    low_freq_wavelen = original / low_freq_factor
    high_freq_wavelen = original / high_freq_factor
    factors = torch.where(wavelen > low_freq_wavelen, torch.full_like(wavelen, factor), between)
    return torch.where(wavelen < high_freq_wavelen, torch.ones_like(wavelen), factors)


# ---------------------------------------------------------------------------------------------- tensors


def iter_gguf_tensors(path: str, dtype: torch.dtype, skip: frozenset[str] = frozenset()
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (HF parameter name, dequantized tensor in HF shape, cast to dtype), one tensor at a time, except
    the names in `skip` (held as blocks instead: iter_gguf_quant_parts)."""
    contents = read_gguf(path)
    arch = gguf_architecture(contents)
    planned = [(info, hf_tensor_name(contents.path, info, arch)) for info in contents.tensors]
    for info, _ in planned:
        _check_supported_type(contents.path, info)
    for info, hf_name in planned:
        if hf_name is None or hf_name in skip:
            continue
        if arch in SHIFTED_NORM_ARCHITECTURES and hf_name.endswith("norm.weight"):
            yield hf_name, (_read_tensor(contents, info, torch.float32) - 1.0).to(dtype)
            continue
        tensor = _read_tensor(contents, info, dtype)
        heads = _permuted_heads(contents, arch, hf_name)
        yield hf_name, tensor if heads is None else unpermute_qk_rows(tensor, heads)


def iter_gguf_quant_parts(path: str) -> Iterator[tuple[str, QuantPart]]:
    """(HF parameter name, its rows of blocks) for each matrix in a block type quant_linear.cpp reads, rows in HF
    order (the Q/K permutation moves whole rows), mapped from the file (merge_parts copies them)."""
    contents = read_gguf(path)
    arch = gguf_architecture(contents)
    for info in contents.tensors:
        hf_name = hf_tensor_name(contents.path, info, arch)
        if hf_name is None or len(info.gguf_shape) != 2 or info.ggml_type not in QUANT_LINEAR_TYPES:
            continue
        _check_supported_type(contents.path, info)
        assert info.nbytes is not None
        raw = np.memmap(contents.path, dtype=np.uint8, mode="c", offset=info.data_offset, shape=(info.nbytes,))
        rows = torch.from_numpy(raw).view(info.hf_shape[0], -1)
        heads = _permuted_heads(contents, arch, hf_name)
        yield hf_name, QuantPart(info.ggml_type, rows if heads is None else unpermute_qk_rows(rows, heads))


def gguf_matrix_dtype(path: str) -> torch.dtype | None:
    """The dtype every matrix of the file is stored in when that is one float type (an f16 or bf16 file);
    None when any matrix is block-quantized or the types differ."""
    types = {T(info.ggml_type) for info in read_gguf(path).tensors
             if len(info.gguf_shape) == 2 and info.name not in NON_PARAMETER_TENSORS}
    return FLOAT_TYPES.get(types.pop()) if len(types) == 1 else None


def gguf_parameter_bytes(path: str) -> int:
    """Bytes of the file's parameter tensors, as stored (what "the file's size" means for its weights)."""
    contents = read_gguf(path)
    return sum(info.nbytes or 0 for info in contents.tensors if info.name not in NON_PARAMETER_TENSORS)


def _permuted_heads(contents: GGUFContents, arch: str, hf_name: str) -> int | None:
    """The head count whose rotary rows convert_hf_to_gguf interleaved in this tensor; None: not permuted."""
    projection = hf_name.rsplit(".", 2)[-2]
    if arch not in PERMUTED_QK_ARCHITECTURES or projection not in ("q_proj", "k_proj"):
        return None
    return _qk_head_count(contents, arch, projection)


def hf_tensor_name(path: str, info: GGUFTensorInfo, arch: str = "llama") -> str | None:
    """The HF parameter name for a GGUF tensor of a file of architecture `arch`; None for tensors that are not
    parameters."""
    if info.name in NON_PARAMETER_TENSORS:
        return None
    if info.name in GLOBAL_TENSOR_NAMES:
        return GLOBAL_TENSOR_NAMES[info.name]
    prefix, _, rest = info.name.partition(".")
    layer, _, suffix = rest.partition(".")
    layer_names = ARCH_LAYER_TENSOR_NAMES.get(arch, LAYER_TENSOR_NAMES)
    if prefix == "blk" and layer.isdigit() and suffix in layer_names:
        return f"model.layers.{int(layer)}.{layer_names[suffix]}"
    raise ModelLoadError(f"{path}: unexpected tensor {info.name!r}; kvserve does not know this parameter")


def _check_supported_type(path: str, info: GGUFTensorInfo) -> None:
    if info.ggml_type not in SUPPORTED_TENSOR_TYPES:
        supported = ", ".join(sorted(T(t).name for t in SUPPORTED_TENSOR_TYPES))
        raise ModelLoadError(
            f"{path}: tensor {info.name!r} has unsupported GGUF quantization type {info.type_name}; "
            f"kvserve dequantizes {supported}"
        )


def _qk_head_count(contents: GGUFContents, arch: str, projection: str) -> int:
    num_heads = contents.metadata.get(f"{arch}.attention.head_count")
    if num_heads is None:
        raise ModelLoadError(f"{contents.path}: missing GGUF metadata {arch}.attention.head_count")
    if projection == "k_proj":
        return int(contents.metadata.get(f"{arch}.attention.head_count_kv", num_heads))
    return int(num_heads)


def unpermute_qk_rows(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undoes convert_hf_to_gguf's permute(): llama.cpp wants each head's rotary halves interleaved
    (pairs x0,x1 rotate together); HF keeps the halves apart (rotate_half). Works on weights and biases."""
    rows = tensor.shape[0]
    assert rows % (2 * num_heads) == 0, f"{rows} rows do not split into {num_heads} heads of rotary pairs"
    per_head = tensor.reshape(num_heads, rows // num_heads // 2, 2, *tensor.shape[1:])
    return per_head.transpose(1, 2).reshape(tensor.shape).contiguous()


def _read_tensor(contents: GGUFContents, info: GGUFTensorInfo, dtype: torch.dtype) -> torch.Tensor:
    _check_supported_type(contents.path, info)
    assert info.nbytes is not None
    # Copy-on-write mapping: a writable array torch can wrap without a copy; nothing is written to the file.
    block_size, _ = gguf.GGML_QUANT_SIZES[T(info.ggml_type)]
    if info.gguf_shape and info.gguf_shape[0] % block_size:
        raise ModelLoadError(
            f"{contents.path}: tensor {info.name!r} has rows of {info.gguf_shape[0]} values, "
            f"not a whole number of {info.type_name} blocks of {block_size}"
        )
    raw = np.memmap(contents.path, dtype=np.uint8, mode="c", offset=info.data_offset, shape=(info.nbytes,))
    return dequantize(raw, T(info.ggml_type), info.hf_shape, dtype)


def dequantize(
    raw: np.ndarray, ggml_type: gguf.GGMLQuantizationType, hf_shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Bytes of one tensor -> a torch tensor of `hf_shape` in `dtype` (a new tensor, not a view of `raw`)."""
    if ggml_type in FLOAT_TYPES:
        # Reinterpret the bytes in torch: numpy has no bfloat16, and a direct cast skips an fp32 round trip.
        stored = torch.from_numpy(raw).view(FLOAT_TYPES[ggml_type]).reshape(hf_shape)
        return stored.to(dtype, copy=True)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[ggml_type]
    row_length = hf_shape[-1]
    assert row_length % block_size == 0, f"rows of {row_length} are not whole {ggml_type.name} blocks"
    rows = raw.reshape(-1, row_length // block_size * block_bytes)
    # gguf.quants is vectorized numpy (~250-300 M weights/s per core); fast enough for loading.
    values = gguf.quants.dequantize(rows, ggml_type)
    return torch.from_numpy(values).reshape(hf_shape).to(dtype)
