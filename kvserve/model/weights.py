"""Writes checkpoint tensors (Hugging Face names) into the model's fused parameters, checking every shape."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvserve.config import ModelLoadError
from kvserve.model.llama import DecoderLayer, LlamaForCausalLM


@dataclass(slots=True)
class Destination:
    """Where one checkpoint tensor goes: rows [row_start, row_start + rows) of a parameter."""

    parameter: torch.Tensor
    row_start: int
    rows: int


def _whole(parameter: torch.Tensor) -> Destination:
    return Destination(parameter, 0, parameter.shape[0])


def _layer_destinations(layer: DecoderLayer) -> dict[str, Destination]:
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
    table = {
        "self_attn.q_proj.weight": Destination(attn.qkv_proj, 0, q),
        "self_attn.k_proj.weight": Destination(attn.qkv_proj, q, kv),
        "self_attn.v_proj.weight": Destination(attn.qkv_proj, q + kv, kv),
        "self_attn.o_proj.weight": _whole(attn.o_proj),
        "mlp.gate_proj.weight": Destination(mlp.gate_up_proj, 0, inter),
        "mlp.up_proj.weight": Destination(mlp.gate_up_proj, inter, inter),
        "mlp.down_proj.weight": _whole(mlp.down_proj),
        "input_layernorm.weight": _whole(layer.input_layernorm.weight),
        "post_attention_layernorm.weight": _whole(layer.post_attention_layernorm.weight),
    }
    if attn.qkv_bias is not None:
        table |= {
            "self_attn.q_proj.bias": Destination(attn.qkv_bias, 0, q),
            "self_attn.k_proj.bias": Destination(attn.qkv_bias, q, kv),
            "self_attn.v_proj.bias": Destination(attn.qkv_bias, q + kv, kv),
        }
    return table


def weight_destinations(model: LlamaForCausalLM) -> dict[str, Destination]:
    """Every checkpoint tensor name the model needs, with where it goes."""
    table = {"model.embed_tokens.weight": _whole(model.embed_tokens), "model.norm.weight": _whole(model.norm.weight)}
    if model.lm_head is not None:
        table["lm_head.weight"] = _whole(model.lm_head)
    for index, layer in enumerate(model.layers):
        for suffix, dest in _layer_destinations(layer).items():
            table[f"model.layers.{index}.{suffix}"] = dest
    return table


def load_weights(
    model: LlamaForCausalLM,
    tensors: Iterable[tuple[str, torch.Tensor, str]],
    checkpoint: str,
    on_tensor: Callable[[], None] = lambda: None,
) -> None:
    """Fills every parameter of `model` from `tensors` (name, tensor, source file); fails naming what is wrong.

    Tensors the model does not use (rotary inv_freq buffers, a tied lm_head copy) are skipped; fp8 KV scales
    (`self_attn.k_scale` / `v_scale`, as vLLM reads them) are kept in `model.checkpoint_kv_scales`.
    """
    destinations = weight_destinations(model)
    written: set[str] = set()
    for name, tensor, source in tensors:
        on_tensor()
        dest = destinations.get(name)
        if dest is None:
            _keep_kv_scale(model, name, tensor)
            continue
        expected = (dest.rows, *dest.parameter.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        with torch.no_grad():
            dest.parameter[dest.row_start : dest.row_start + dest.rows].copy_(tensor)
        written.add(name)
    missing = [name for name in destinations if name not in written]
    _check_kv_scales(model, checkpoint)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{checkpoint}: missing tensor(s): {shown}")


_KV_SCALE = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


def _keep_kv_scale(model: LlamaForCausalLM, name: str, tensor: torch.Tensor) -> None:
    match = _KV_SCALE.fullmatch(name)
    if match is None or tensor.numel() != 1:
        return
    layer, which = int(match.group(1)), match.group(2)
    k_scale, v_scale = model.checkpoint_kv_scales.get(layer, (None, None))
    value = float(tensor.float().item())
    model.checkpoint_kv_scales[layer] = (value, v_scale) if which == "k" else (k_scale, value)


def _check_kv_scales(model: LlamaForCausalLM, checkpoint: str) -> None:
    for layer, scales in model.checkpoint_kv_scales.items():
        if not all(scale is not None and scale > 0 and math.isfinite(scale) for scale in scales):
            raise ModelLoadError(f"{checkpoint}: layer {layer} has fp8 KV scales {scales}; both k_scale and v_scale "
                                 "must be positive")
