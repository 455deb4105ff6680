"""Matmul weights held as their checkpoint holds them, read in place by csrc/quant_linear.cpp for every batch
size, so the weights cost the file's bytes: a GGUF file's rows of ggml blocks, or a 16-bit or fp32 checkpoint's
plain rows (dense parts: ggml's F32, F16 and BF16, one value a "block"; dense_weight).

A weight is one or more parts, each rows of one block type: a fused weight (q/k/v, gate/up) is the rows of its
checkpoint tensors one after the other, which works because ggml blocks never straddle rows; Q4_K_M files mix
types within one fused weight (Q6_K v rows under Q4_K q and k rows), so each type is its own part and its own
kernel call, writing its columns of the output. The token embedding held this way decodes only the rows it
looks up.

Only with the CPU kernels: the portable path (KVSERVE_CPU_KERNELS=0) keeps plain tensors, and tensor-parallel
shards dequantize a GGUF file's blocks at load (their slices are then dense parts).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

from kvserve import huge_pages

# ggml type ids (gguf.GGMLQuantizationType) that quant_linear.cpp reads: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K,
# Q5_K, Q6_K.
QUANT_LINEAR_TYPES = frozenset({2, 3, 6, 7, 8, 12, 13, 14})
# ggml type ids of plain rows: F32, F16, BF16.
DENSE_TYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
_DENSE_DTYPES = {type_id: dtype for dtype, type_id in DENSE_TYPES.items()}

_NO_BIAS = torch.empty(0)


@dataclass(frozen=True, slots=True)
class QuantPart:
    """Rows of a weight in one ggml block type, as the file stores them."""

    ggml_type: int
    blocks: torch.Tensor  # uint8 [rows, row bytes], contiguous

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def in_features(self) -> int:
        values, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(self.ggml_type)]
        return self.blocks.shape[1] // nbytes * values

    def dequantize(self) -> torch.Tensor:
        """The fp32 [rows, in_features] these blocks encode, as gguf.quants decodes them (a reference)."""
        if self.ggml_type in _DENSE_DTYPES:
            return self.blocks.view(_DENSE_DTYPES[self.ggml_type]).float()
        values = gguf.quants.dequantize(self.blocks.numpy(), gguf.GGMLQuantizationType(self.ggml_type))
        return torch.from_numpy(values.copy())


@dataclass(frozen=True, slots=True, eq=False)
class QuantWeight:
    """A matmul weight [out_features, in_features] as GGUF blocks, with the kernels that read them."""

    parts: tuple[QuantPart, ...]
    in_features: int
    kernels: object  # the C++ module (cpu_kernels)

    @property
    def shape(self) -> tuple[int, int]:
        return sum(part.rows for part in self.parts), self.in_features

    def numel(self) -> int:
        rows, cols = self.shape
        return rows * cols

    def nbytes(self) -> int:
        return sum(part.blocks.numel() for part in self.parts)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ weight.T + bias, in x's dtype."""
        out = torch.empty(x.shape[0], self.shape[0], dtype=x.dtype)
        column = 0
        for part in self.parts:
            part_bias = _NO_BIAS if bias is None else bias[column : column + part.rows]
            self.kernels.quant_linear_out(x, part.blocks, part.ggml_type, part_bias, out, column)
            column += part.rows
        return out

    def lookup(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight, decoded (an embedding lookup): [len(ids), in_features] in `dtype`."""
        if len(self.parts) != 1:
            raise ValueError("row lookups read weights of one block type")
        part = self.parts[0]
        out = torch.empty(ids.shape[0], self.in_features, dtype=dtype)
        self.kernels.quant_rows_out(part.blocks, part.ggml_type, ids.long(), out)
        return out


def merge_parts(parts: list[QuantPart]) -> tuple[QuantPart, ...]:
    """Adjacent parts of one type joined into one (one kernel call, one copy of their rows); every part comes
    out contiguous and owning its bytes (not a view of a mapped file)."""
    merged: list[list[QuantPart]] = []
    for part in parts:
        if merged and merged[-1][0].ggml_type == part.ggml_type:
            merged[-1].append(part)
        else:
            merged.append([part])
    return tuple(QuantPart(run[0].ggml_type, huge_pages.cat([p.blocks for p in run])) for run in merged)


def dense_weight(weight: torch.Tensor, kernels) -> QuantWeight:
    """A plain [out, in] weight (fp32, fp16 or bf16) as one dense part over its own storage: no copy."""
    if weight.dtype not in DENSE_TYPES:
        raise ValueError(f"a dense weight is fp32, fp16 or bf16, not {weight.dtype}")
    rows = weight.contiguous()
    return QuantWeight((QuantPart(DENSE_TYPES[weight.dtype], rows.view(torch.uint8)),), weight.shape[1], kernels)
