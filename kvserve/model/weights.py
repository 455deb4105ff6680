"""Writes checkpoint tensors (Hugging Face names) into the model's fused parameters, checking every shape."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from kvserve.config import ModelConfig, ModelLoadError
from kvserve.model.llama import DecoderLayer, LlamaForCausalLM
from kvserve.model.quant_weight import QuantPart, QuantWeight, merge_parts
from kvserve.model.tensor_parallel import TensorShard


@dataclass(slots=True)
class Destination:
    """Where one checkpoint tensor goes: rows [row_start, row_start + rows) of a parameter.

    Under tensor parallelism a rank takes a slice of the checkpoint tensor along `split_dim`, starting at
    `split_start`, of a tensor that is `split_full` long there (None: the whole tensor, not split).
    """

    parameter: torch.Tensor
    row_start: int
    rows: int
    split_dim: int = 0
    split_start: int = 0
    split_full: int | None = None

    def checkpoint_shape(self) -> tuple[int, ...]:
        shape = [self.rows, *self.parameter.shape[1:]]
        if self.split_full is not None:
            shape[self.split_dim] = self.split_full
        return tuple(shape)

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.split_full is None:
            return tensor
        size = self.rows if self.split_dim == 0 else self.parameter.shape[self.split_dim]
        return tensor.narrow(self.split_dim, self.split_start, size)


def _whole(parameter: torch.Tensor) -> Destination:
    return Destination(parameter, 0, parameter.shape[0])


def _rows(parameter: torch.Tensor, row_start: int, rows: int, shard_start: int, full: int) -> Destination:
    """A column-parallel piece: this rank's `rows` rows, from row `shard_start` of the checkpoint's `full`."""
    if rows == full:
        return Destination(parameter, row_start, rows)
    return Destination(parameter, row_start, rows, 0, shard_start, full)


def _columns(parameter: torch.Tensor, shard_start: int, full: int) -> Destination:
    """A row-parallel weight: this rank's columns, from column `shard_start` of the checkpoint's `full`."""
    if parameter.shape[1] == full:
        return _whole(parameter)
    return Destination(parameter, 0, parameter.shape[0], 1, shard_start, full)


def _layer_destinations(layer: DecoderLayer, config: ModelConfig, shard: TensorShard) -> dict[str, Destination]:
    attn, mlp = layer.self_attn, layer.mlp
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
    q_start, kv_start, inter_start = shard.rank * q, shard.first_kv_head(config) * attn.head_dim, shard.rank * inter
    q_full, kv_full = config.num_attention_heads * attn.head_dim, config.num_key_value_heads * attn.head_dim
    inter_full = config.intermediate_size
    table = {
        "self_attn.q_proj.weight": _rows(attn.qkv_proj, 0, q, q_start, q_full),
        "self_attn.k_proj.weight": _rows(attn.qkv_proj, q, kv, kv_start, kv_full),
        "self_attn.v_proj.weight": _rows(attn.qkv_proj, q + kv, kv, kv_start, kv_full),
        "self_attn.o_proj.weight": _columns(attn.o_proj, q_start, q_full),
        "mlp.gate_proj.weight": _rows(mlp.gate_up_proj, 0, inter, inter_start, inter_full),
        "mlp.up_proj.weight": _rows(mlp.gate_up_proj, inter, inter, inter_start, inter_full),
        "mlp.down_proj.weight": _columns(mlp.down_proj, inter_start, inter_full),
    }
    # Norms are replicated, and each is named as in the checkpoint ("self_attn.q_norm.weight").
    table |= {name: _whole(weight) for name, weight in layer.named_parameters() if name.endswith("norm.weight")}
    if attn.qkv_bias is not None:
        table |= {
            "self_attn.q_proj.bias": _rows(attn.qkv_bias, 0, q, q_start, q_full),
            "self_attn.k_proj.bias": _rows(attn.qkv_bias, q, kv, kv_start, kv_full),
            "self_attn.v_proj.bias": _rows(attn.qkv_bias, q + kv, kv, kv_start, kv_full),
        }
    return table


def _vocab(parameter: torch.Tensor, config: ModelConfig, shard: TensorShard) -> Destination:
    start, end = shard.vocab_rows(config.vocab_size)
    return _rows(parameter, 0, end - start, start, config.vocab_size)


def weight_destinations(model: LlamaForCausalLM) -> dict[str, Destination]:
    """Every checkpoint tensor name the model needs, with where it goes (this rank's slice of it)."""
    config, shard = model.config, model.shard
    table = {"model.embed_tokens.weight": _vocab(model.embed_tokens, config, shard),
             "model.norm.weight": _whole(model.norm.weight)}
    if model.lm_head is not None:
        table["lm_head.weight"] = _vocab(model.lm_head, config, shard)
    for index, layer in enumerate(model.layers):
        for suffix, dest in _layer_destinations(layer, config, shard).items():
            table[f"model.layers.{index}.{suffix}"] = dest
    return table


def quant_weights(model: LlamaForCausalLM, parts: Iterable[tuple[str, QuantPart]], kernels
                  ) -> dict[str, tuple[QuantWeight, list[str]]]:
    """The model's matmul weights (and token embedding) that can be held whole as checkpoint blocks
    (quant_weight.py), by parameter name ("layers.0.self_attn.qkv_proj", "embed_tokens"), each with the
    checkpoint tensors it holds: every checkpoint tensor that writes into the parameter must come as blocks,
    unsplit (one rank holds it all)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    destinations = weight_destinations(model)
    parts_of: dict[str, list[str]] = {}
    for checkpoint_name, dest in destinations.items():
        if dest.parameter.dim() == 2:
            parts_of.setdefault(names[id(dest.parameter)], []).append(checkpoint_name)
    found = dict(parts)
    held = {}
    for name, checkpoint_names in parts_of.items():
        pieces = [found.get(part) for part in checkpoint_names]
        parameter = destinations[checkpoint_names[0]].parameter
        if any(piece is None or destinations[part].split_full is not None
               for part, piece in zip(checkpoint_names, pieces)):
            continue
        order = sorted(range(len(pieces)), key=lambda i: destinations[checkpoint_names[i]].row_start)
        weight = QuantWeight(merge_parts([pieces[i] for i in order]), parameter.shape[1], kernels)
        if weight.shape == tuple(parameter.shape) and all(p.in_features == parameter.shape[1] for p in weight.parts):
            held[name] = (weight, checkpoint_names)
    return held


def load_weights(
    model: LlamaForCausalLM,
    tensors: Iterable[tuple[str, torch.Tensor, str]],
    checkpoint: str,
    on_tensor: Callable[[], None] = lambda: None,
    held: frozenset[str] = frozenset(),
) -> None:
    """Fills every parameter of `model` from `tensors` (name, tensor, source file); fails naming what is wrong.
    Names in `held` are held otherwise (as blocks: quant_weights) and not expected.

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
        expected = dest.checkpoint_shape()
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        with torch.no_grad():
            dest.parameter[dest.row_start : dest.row_start + dest.rows].copy_(dest.take(tensor))
        written.add(name)
    missing = [name for name in destinations if name not in written and name not in held]
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
