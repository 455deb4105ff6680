"""Weight quantization formats: what `--quantization` and a checkpoint's `quantization_config` mean in bytes.

Only the linear layers inside decoder blocks are quantized (attention projections, MLP, experts). Embeddings,
the LM head, norms and MoE routers stay in the model dtype, as vLLM's fp8/AWQ/GPTQ loaders keep them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.planner.errors import PlannerError

QUANTIZATION_CHOICES = ("none", "fp8", "int8", "awq", "gptq", "awq_marlin", "gptq_marlin")

# AWQ/GPTQ checkpoints almost always use 128-element groups along the input dimension.
DEFAULT_INT4_GROUP_SIZE = 128


@dataclass(slots=True, frozen=True)
class WeightQuant:
    """How one linear weight is stored.

    method: "none" (model dtype), "fp8" (1 B/element + fp32 scales: one per tensor, or one per block when
    `block_shape` is set, as DeepSeek-V3 ships), "int8" (1 B/element + one fp32 scale per output channel),
    "awq"/"gptq" (`bits`-bit packed weights + one fp16 scale and one packed zero point per `group_size` inputs
    per output; GPTQ also keeps an int32 `g_idx` per input row).
    """

    method: str = "none"
    bits: int = 16
    group_size: int | None = None
    block_shape: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        if self.method == "none":
            return "none"
        if self.method in ("awq", "gptq"):
            return f"{self.method} int{self.bits} g{self.group_size}"
        if self.block_shape:
            return f"{self.method} block {self.block_shape[0]}x{self.block_shape[1]}"
        return self.method


UNQUANTIZED = WeightQuant()


def quant_from_flag(name: str | None) -> WeightQuant | None:
    """`--quantization` -> WeightQuant; None means "whatever the checkpoint is" (vLLM's default)."""
    if name is None:
        return None
    method = name.lower().removesuffix("_marlin")
    if method == "none":
        return UNQUANTIZED
    if method == "fp8":
        return WeightQuant("fp8", bits=8)
    if method == "int8":
        return WeightQuant("int8", bits=8)
    if method in ("awq", "gptq"):
        return WeightQuant(method, bits=4, group_size=DEFAULT_INT4_GROUP_SIZE)
    raise PlannerError(f"--quantization {name!r}: expected one of {', '.join(QUANTIZATION_CHOICES)}")


def quant_from_config(quantization_config: dict[str, Any] | None) -> tuple[WeightQuant | None, str]:
    """A checkpoint's `quantization_config` -> (WeightQuant or None, a note when the planner had to guess)."""
    if not quantization_config:
        return None, ""
    method = str(quantization_config.get("quant_method", "")).lower()
    if method == "fp8":
        block = quantization_config.get("weight_block_size")
        return WeightQuant("fp8", bits=8, block_shape=tuple(block) if block else None), ""
    if method in ("awq", "gptq"):
        bits = int(quantization_config.get("bits", quantization_config.get("w_bit", 4)))
        group = int(quantization_config.get("group_size", quantization_config.get("q_group_size", 128)))
        return WeightQuant(method, bits=bits, group_size=group if group > 0 else None), ""
    if method == "compressed-tensors":
        return _compressed_tensors_quant(quantization_config)
    return None, f"quant_method {method!r} is not modelled; weights planned at the model dtype (an upper bound)"


def _compressed_tensors_quant(quantization_config: dict[str, Any]) -> tuple[WeightQuant | None, str]:
    groups = quantization_config.get("config_groups") or {}
    for group in groups.values():
        weights = (group or {}).get("weights") or {}
        bits, kind = int(weights.get("num_bits", 16)), weights.get("type", "int")
        if bits == 8 and kind == "float":
            return WeightQuant("fp8", bits=8), ""
        if bits == 8:
            return WeightQuant("int8", bits=8), ""
        if bits == 4:
            return WeightQuant("gptq", bits=4, group_size=weights.get("group_size") or DEFAULT_INT4_GROUP_SIZE), ""
    return None, "compressed-tensors scheme not recognised; weights planned at the model dtype (an upper bound)"
