"""Pool, block and concurrency arithmetic the engine calls to size its pool."""

import pytest

from kvserve.planner import PlannerError, kv_pool_bytes, max_concurrency, max_model_len_for_blocks, num_blocks_for_pool
from kvserve.planner.budget import max_model_len_for_seqs, max_num_seqs_for_blocks

GiB = 1024**3


def test_pool_is_utilized_memory_minus_weights_and_activations():
    assert kv_pool_bytes(80 * GiB, 0.9, 20 * GiB, 2 * GiB) == int(80 * GiB * 0.9) - 22 * GiB
    assert kv_pool_bytes(16 * GiB, 0.9, 20 * GiB, 1 * GiB) < 0


@pytest.mark.parametrize(
    "args", [(0, 0.9, 1, 1), (GiB, 0.0, 1, 1), (GiB, 1.5, 1, 1), (GiB, 0.9, -1, 0), (GiB, 0.9, 0, -5)]
)
def test_pool_rejects_bad_inputs(args):
    with pytest.raises(PlannerError):
        kv_pool_bytes(*args)


def test_blocks_floor_and_never_negative():
    assert num_blocks_for_pool(10 * 3 * 2**20 + 5, 3 * 2**20) == 10
    assert num_blocks_for_pool(-5, 1024) == 0
    with pytest.raises(PlannerError):
        num_blocks_for_pool(100, 0)


def test_longest_request_and_concurrency_round_up_to_blocks():
    assert max_model_len_for_blocks(100, 16) == 1600
    assert max_concurrency(100, 16, 16) == 100.0
    assert max_concurrency(100, 16, 17) == 50.0  # 17 tokens occupy 2 blocks
    assert max_concurrency(0, 16, 17) == 0.0
    assert max_num_seqs_for_blocks(100, 16, 17 * 16) == 5
    assert max_model_len_for_seqs(100, 16, 3) == 33 * 16
    with pytest.raises(PlannerError):
        max_concurrency(100, 16, 0)
