"""Which blocks still filling keep their unquantized keys, and where: the int4 keys' staging.

int4 keys are quantized per channel over a block's tokens (kv_quant.py), so a block that fills over many steps
is requantized at every write. Requantizing from its own codes would round the earlier keys again each time;
instead the writer keeps the block's keys as they came (in the model dtype, one staging row per block, every
layer alike) and quantizes rows [0, n) from them, so each block carries one rounding of its keys. A row is
released when its block fills; a block written whole in one step needs none.

The rows are bounded (one per --max-num-seqs, what the planner counts beside the pool): when none is free the
least recently written row is taken, and a block that lost its row, or finds none, is requantized from its
decoded codes instead (still correct, a little less exact). Every layer of a step writes the same slots, so
the plan is made for the step's first layer and reused by the others (they share the slot-mapping tensor).
"""

from __future__ import annotations

import torch

# A plan row: the block, its first token in the step's batch, the first and last offsets written, the staging
# row (-1: none), and how many leading rows to fill from the cache's codes first.
PLAN_COLUMNS = ("block", "first_token", "lo", "hi", "row", "decode")


class KeyStaging:
    def __init__(self, rows: int, block_size: int) -> None:
        self.capacity = rows
        self.block_size = block_size
        self.row_of_block: dict[int, int] = {}
        self.block_of_row = [-1] * rows
        self.filled = [0] * rows  # rows of its block a staging row holds
        self.last_step = [-1] * rows
        self.free = list(range(rows - 1, -1, -1))
        self.completed: list[int] = []  # blocks that filled in the last plan: their rows are released next step
        self.step = 0
        self._planned_for: torch.Tensor | None = None
        self._plan: torch.Tensor | None = None

    def plan(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """[runs, 6] int64 (PLAN_COLUMNS) for the step writing `slot_mapping`; the same tensor for every layer."""
        if slot_mapping is self._planned_for:
            return self._plan
        self._release_completed()
        self.step += 1
        entries = [self._assign(*run) for run in self._runs(slot_mapping.detach().cpu())]
        self._planned_for = slot_mapping
        self._plan = torch.tensor(entries, dtype=torch.long).view(-1, len(PLAN_COLUMNS))
        return self._plan

    def _runs(self, slots: torch.Tensor) -> list[tuple[int, int, int, int]]:
        """(block, first token, lo, hi) for each stretch of consecutive offsets in one block."""
        if slots.numel() == 0:
            return []
        blocks, offsets = slots // self.block_size, slots % self.block_size
        breaks = (blocks[1:] != blocks[:-1]) | (offsets[1:] != offsets[:-1] + 1)
        starts = torch.cat((torch.zeros(1, dtype=torch.long), breaks.nonzero().flatten() + 1))
        ends = torch.cat((starts[1:], torch.tensor([slots.numel()])))
        return [(b, s, lo, lo + e - s - 1) for b, s, e, lo in
                zip(blocks[starts].tolist(), starts.tolist(), ends.tolist(), offsets[starts].tolist())]

    def _assign(self, block: int, first: int, lo: int, hi: int) -> tuple[int, int, int, int, int, int]:
        row = self.row_of_block.get(block)
        if lo == 0 and hi == self.block_size - 1:  # written whole: quantized from this step's keys alone
            if row is not None:
                self._drop(row)
            return block, first, lo, hi, -1, 0
        decode = 0
        if row is None or self.filled[row] < lo:
            decode = lo  # the rows before this stretch come from the cache's codes
            if row is None:
                row = self._take(block)
        if row < 0:
            return block, first, lo, hi, -1, lo
        self.filled[row] = hi + 1
        self.last_step[row] = self.step
        if hi == self.block_size - 1:
            self.completed.append(block)
        return block, first, lo, hi, row, decode

    def _take(self, block: int) -> int:
        """A free row for `block`, else the least recently written one not in use this step; -1 if none."""
        if self.free:
            row = self.free.pop()
        else:
            row = min(range(self.capacity), key=self.last_step.__getitem__, default=-1)
            if row < 0 or self.last_step[row] == self.step:
                return -1
            del self.row_of_block[self.block_of_row[row]]
        self.row_of_block[block] = row
        self.block_of_row[row] = block
        self.filled[row] = 0
        return row

    def _drop(self, row: int) -> None:
        del self.row_of_block[self.block_of_row[row]]
        self.block_of_row[row] = -1
        self.free.append(row)

    def _release_completed(self) -> None:
        for block in self.completed:
            row = self.row_of_block.get(block)
            if row is not None:
                self._drop(row)
        self.completed = []
