"""Decode steps replayed as CUDA graphs: a step of only decodes runs the whole forward as one graph launch
instead of hundreds of kernel launches from Python (vLLM's CUDA graphs; off with --enforce-eager).

One graph is captured per batch-size bucket (1, 2, 4, then multiples of 8 up to --max-num-seqs, at most
MAX_CAPTURED_BATCH), over static input buffers. A step of n decodes copies its inputs into the first n rows of
the smallest bucket that holds them and pads the rest: token 0 at position 0, slot -1 (the Triton writer skips
it) and context length 0 (the Triton decode kernel gives zeros), so padded rows touch no block of the pool. Only
kernels that take such rows and launch nothing from the host (the Triton backend's) can be captured.

The capture itself is CUDA's; the bucket and padding logic is the same on CPU, where tests replay the captured
forward eagerly over the same static buffers (`eager_capture`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.engine.step_plan import StepInputs

MAX_CAPTURED_BATCH = 256
PADDING_SLOT = -1


def capture_sizes(max_num_seqs: int, largest: int = MAX_CAPTURED_BATCH) -> list[int]:
    """The batch sizes captured: 1, 2, 4, multiples of 8, and the cap itself, up to min(max_num_seqs, largest)."""
    cap = min(max_num_seqs, largest)
    sizes = {size for size in (1, 2, 4) if size <= cap} | set(range(8, cap + 1, 8)) | {cap}
    return sorted(sizes)


def bucket_for(sizes: list[int], num_seqs: int) -> int | None:
    """The smallest captured size that holds num_seqs rows; None past the largest."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


@dataclass(slots=True)
class DecodeBuffers:
    """The static inputs every captured graph reads, sized for the largest bucket."""

    token_ids: torch.Tensor  # [max_batch] int64
    positions: torch.Tensor  # [max_batch] int64
    slots: torch.Tensor  # [groups, max_batch] int64
    block_tables: torch.Tensor  # [groups, max_batch, max_blocks] int64
    context_lens: torch.Tensor  # [groups, max_batch] int64
    logits_rows: torch.Tensor  # [max_batch] int64: 0, 1, 2, ...

    @classmethod
    def allocate(cls, max_batch: int, num_groups: int, max_blocks: int, device: torch.device) -> "DecodeBuffers":
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        slots = torch.full((num_groups, max_batch), PADDING_SLOT, dtype=torch.long, device=device)
        return cls(zeros(max_batch), zeros(max_batch), slots, zeros(num_groups, max_batch, max_blocks),
                   zeros(num_groups, max_batch), torch.arange(max_batch, device=device))

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[2]

    def fill(self, inputs: StepInputs, bucket: int) -> None:
        """The step's n decodes into rows [0, n), padding rows into [n, bucket)."""
        num_seqs = len(inputs.token_ids)
        padding = bucket - num_seqs
        self.token_ids[:bucket].copy_(torch.tensor(inputs.token_ids + [0] * padding), non_blocking=True)
        self.positions[:bucket].copy_(torch.tensor(inputs.positions + [0] * padding), non_blocking=True)
        context_lens = [computed + 1 for computed in inputs.num_computed] + [0] * padding
        for group, (slots, tables) in enumerate(zip(inputs.slots, inputs.block_tables)):
            self.slots[group, :bucket].copy_(torch.tensor(slots + [PADDING_SLOT] * padding), non_blocking=True)
            self.context_lens[group, :bucket].copy_(torch.tensor(context_lens), non_blocking=True)
            rows = [table + [0] * (self.max_blocks - len(table)) for table in tables]
            rows += [[0] * self.max_blocks] * padding
            self.block_tables[group, :bucket].copy_(torch.tensor(rows, dtype=torch.long), non_blocking=True)


Replay = Callable[[], None]
# capture(forward) -> (replay, output): `forward()` returns the logits tensor; after replay() `output` holds what
# forward() would return for the buffers' current contents.
Capture = Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]


def eager_capture(forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
    """A stand-in for CUDA's capture where there is none (CPU tests): replay runs the forward again over the
    static buffers, into the same output tensor."""
    output = forward()

    def replay() -> None:
        output.copy_(forward())

    return replay, output


class CudaGraphCapture:
    """Captures on CUDA into one memory pool shared by every bucket's graph (captured largest first)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, forward: Callable[[], torch.Tensor]) -> tuple[Replay, torch.Tensor]:
        forward()  # outside the graph: compiles the Triton kernels and sets up library workspaces
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = forward()
        self.graphs.append(graph)
        return graph.replay, output


class DecodeGraphs:
    """Captured decode forwards, one per bucket, and the replay of a step through the smallest that fits."""

    def __init__(self, buffers: DecodeBuffers, sizes: list[int],
                 forward_of: Callable[[DecodeBuffers, int], Callable[[], torch.Tensor]], capture: Capture) -> None:
        """`forward_of(buffers, size)`: the model's forward over the buffers' first `size` rows."""
        self.buffers = buffers
        self.sizes = sizes
        self.captured: dict[int, tuple[Replay, torch.Tensor]] = {}
        self.num_replays = 0
        for size in reversed(sizes):
            self.captured[size] = capture(forward_of(buffers, size))

    def replay(self, inputs: StepInputs) -> torch.Tensor | None:
        """The logits of a step of decodes only ([n, vocab], a copy), or None when the step is not one a graph
        runs (a prefill in it, more decodes than the largest bucket, a table wider than the buffers)."""
        num_seqs = len(inputs.token_ids)
        if inputs.num_decodes != len(inputs.num_computed) or inputs.logits_rows != list(range(num_seqs)):
            return None
        bucket = bucket_for(self.sizes, num_seqs)
        if bucket is None or any(len(t) > self.buffers.max_blocks for tables in inputs.block_tables for t in tables):
            return None
        self.buffers.fill(inputs, bucket)
        replay, logits = self.captured[bucket]
        replay()
        self.num_replays += 1
        return logits[:num_seqs].clone()
