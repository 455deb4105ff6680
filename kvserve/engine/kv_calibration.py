"""The key offsets of a quantized KV cache (cache/storage/kv_storage.py), measured once at start-up.

Every rank runs one forward over a built-in text (prose, dialogue, code, numbers, a few languages) before any
request arrives, through scratch caches in the pool's format: each layer's first write measures its keys'
per-channel median, and from then on that layer stores keys less it. Layers calibrate in order within the one
forward, so each measures the keys that the layers before it, already offset and quantized, produce. The text
and its length are fixed, so the offsets are the same on every start whatever the flags (the disk tier's
fingerprint includes them). Under --calculate-kv-scales the same forward sets the fp8 scales.

Only channels whose RoPE pair turns by at most a radian over the model's context get an offset: a constant
before rotation is then a constant after it at every position. A channel that turns further carries no stable
offset (its mean over positions is near zero), and the shift softmax forgives would not be one constant.
"""

from __future__ import annotations

from importlib import resources

from kvserve.cache.storage.kv_storage import LayerKVCache, adopt_calibration, calibration_caches
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.step_plan import StepInputs
from kvserve.model.rotary import slow_channels

CALIBRATION_TOKENS = 512


def calibration_text() -> str:
    return resources.files("kvserve.engine").joinpath("data/kv_calibration.txt").read_text(encoding="utf-8")


def calibrate_key_offsets(runner: ModelRunner, storage: list[LayerKVCache], token_ids: list[int]) -> int:
    """Measures every layer's key offset on the first CALIBRATION_TOKENS of `token_ids`. Returns how many."""
    model = runner.model
    token_ids = token_ids[:min(CALIBRATION_TOKENS, model.rotary.max_positions)]
    num_tokens, block_size = len(token_ids), runner.block_size
    num_blocks = -(-num_tokens // block_size)
    rotaries = [model.rotary_of(layer) for layer in range(len(storage))]  # Gemma 3: a table per layer kind
    channels = [slow_channels(rotary.inv_freq, rotary.max_positions) for rotary in rotaries]
    scratch = calibration_caches(storage, num_blocks, channels)
    positions = list(range(num_tokens))
    pool, runner.kv_caches = runner.kv_caches, scratch
    try:
        num_groups = len(runner.group_windows)
        runner.run(StepInputs(token_ids=token_ids, positions=positions, slots=[positions] * num_groups,
                              logits_rows=[num_tokens - 1], query_starts=[0, num_tokens], num_computed=[0],
                              num_decodes=0, block_tables=[[list(range(num_blocks))]] * num_groups))
    finally:
        runner.kv_caches = pool
    adopt_calibration(storage, scratch)
    return num_tokens
