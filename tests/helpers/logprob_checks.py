"""Ranks and top-k checked against a reference computed another way (transformers, or torch over the same
logits). Two correct fp32 computations may order a near-tie either way, so a rank or a top-k position is checked
against the range of ranks the reference allows once values within a tolerance count as ties, never by an exact
count of strictly greater logprobs."""

from __future__ import annotations

import torch

# The engine's logprobs are asserted within LOGPROB_TOLERANCE of transformers'. Two tokens whose reference
# logprobs are closer than twice that may swap (each can be off by it, in opposite directions); further apart
# they cannot, so a rank outside this range is a real bug.
LOGPROB_TOLERANCE = 1e-4
TIE_TOLERANCE = 2 * LOGPROB_TOLERANCE


def rank_range(reference: torch.Tensor, token_id: int, tolerance: float = TIE_TOLERANCE) -> tuple[int, int]:
    """(best, worst) 1-based rank of token_id in a computation within tolerance of this reference row."""
    target = float(reference[token_id])
    best = int((reference > target + tolerance).sum()) + 1
    worst = int((reference > target - tolerance).sum()) + 1
    return best, worst


def assert_rank_matches(rank: int, reference: torch.Tensor, token_id: int, tolerance: float = TIE_TOLERANCE) -> None:
    best, worst = rank_range(reference, token_id, tolerance)
    assert best <= rank <= worst, (
        f"token {token_id} ranked {rank}; the reference ranks it {best}..{worst} (ties within {tolerance})")


def tokens_surely_in_top(reference: torch.Tensor, k: int, tolerance: float = TIE_TOLERANCE) -> set[int]:
    """The tokens any computation within tolerance must put in its top k: no near-tie can push them out."""
    candidates = reference.topk(min(k, reference.numel())).indices.tolist()
    return {token_id for token_id in candidates if rank_range(reference, token_id, tolerance)[1] <= k}


def assert_top_matches(top_ids: list[int], reference: torch.Tensor, k: int,
                       tolerance: float = TIE_TOLERANCE) -> None:
    """top_ids is a top k in order: k distinct tokens, each at a position the reference allows, and none of the
    tokens surely in the reference's top k left out."""
    assert len(top_ids) == k and len(set(top_ids)) == k, f"top {k} expected, got {top_ids}"
    for position, token_id in enumerate(top_ids, start=1):
        assert_rank_matches(position, reference, token_id, tolerance)
    missing = tokens_surely_in_top(reference, k, tolerance) - set(top_ids)
    assert not missing, f"top {k} {top_ids} lacks {sorted(missing)}, clear of any tie in the reference"
