"""What one tensor-parallel rank holds of the model, and the collectives its forward needs.

Megatron's split, as vLLM does it: q/k/v and gate/up are split by output rows (column-parallel), o_proj and
down_proj by input columns (row-parallel) and summed across ranks with one all-reduce each, so every rank
ends each layer with the whole hidden state. Attention heads are independent, so each rank computes and caches
only its query heads and their KV heads. With fewer KV heads than ranks each KV head is replicated on the
ranks whose query heads read it (the planner's `kv_heads_per_gpu`). The embedding and the LM head are split by
vocabulary: a token's row lives on one rank (the others add zeros in the all-reduce), and the head's logit
columns are gathered to rank 0, the only rank that samples. The collectives run in the engine's own group of
ranks (`TensorShard.group`), never torch's default process group, so two engines can live in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvserve.config import ModelConfig


@dataclass(slots=True, frozen=True)
class TensorShard:
    """Rank `rank` of `size`: which slice of each weight it holds. size 1 is the whole model."""

    rank: int = 0
    size: int = 1
    # The engine's ranks (engine/tp_process_group.RankGroup): all_reduce(x) and gather(x, dst) run in it.
    group: object = field(default=None, compare=False, repr=False)

    def heads(self, config: ModelConfig) -> tuple[int, int]:
        """(query heads, KV heads) this rank holds."""
        return config.num_attention_heads // self.size, max(1, config.num_key_value_heads // self.size)

    def first_kv_head(self, config: ModelConfig) -> int:
        kv_heads = config.num_key_value_heads
        if kv_heads >= self.size:
            return self.rank * (kv_heads // self.size)
        return self.rank // (self.size // kv_heads)  # replicated: the KV head this rank's query heads read

    def vocab_rows(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of the vocabulary this rank's embedding and head rows cover (the last may run short:
        its shard is padded with zero rows up to `vocab_rows_per_rank`)."""
        per_rank = self.vocab_rows_per_rank(vocab_size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size)

    def vocab_rows_per_rank(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)


WHOLE_MODEL = TensorShard()


def check_shardable(hf_config: dict, config: ModelConfig, size: int, source: str) -> None:
    """Refuses a TP size the model does not split into: the planner's head rules, and whole MLP columns."""
    from kvserve.planner.parallel import validate_parallelism
    from kvserve.planner.specs import spec_from_hf_config

    validate_parallelism(spec_from_hf_config(hf_config, source=source), size)
    if config.intermediate_size % size:
        raise ValueError(f"--tensor-parallel-size {size} does not divide {source}'s intermediate_size "
                         f"{config.intermediate_size}")


def all_reduce(x: torch.Tensor, shard: TensorShard) -> torch.Tensor:
    if shard.size > 1:
        shard.group.all_reduce(x)
    return x


def embed(input_ids: torch.Tensor, weight: torch.Tensor, vocab_size: int, shard: TensorShard) -> torch.Tensor:
    """Rows of a vocabulary-split embedding: each rank looks up the ids it holds, zeros elsewhere, summed."""
    if shard.size == 1:
        return torch.nn.functional.embedding(input_ids, weight)
    start, end = shard.vocab_rows(vocab_size)
    local = input_ids - start
    outside = (input_ids < start) | (input_ids >= end)
    rows = torch.nn.functional.embedding(local.masked_fill(outside, 0), weight)
    rows.masked_fill_(outside.unsqueeze(1), 0)
    shard.group.all_reduce(rows)
    return rows


def gather_logits(local: torch.Tensor, vocab_size: int, shard: TensorShard) -> torch.Tensor | None:
    """Rank 0 gets the whole [rows, vocab] logits; the other ranks get None."""
    if shard.size == 1:
        return local
    parts = shard.group.gather(local.contiguous(), dst=0)
    if parts is None:
        return None
    return torch.cat(parts, dim=1)[:, :vocab_size]
