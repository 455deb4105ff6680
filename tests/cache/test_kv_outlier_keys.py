"""Quantized KV when keys sit far from zero in a few channels, as Qwen2's k biases put them (a real Qwen2.5 has
a channel at 317 +- 1.3 beside channels of +- 1): the per-layer key offsets keep every format's attention close
to the unquantized one, where the same formats without them lose it (fp8 by far). int4 keys are scaled per
channel over each block, so an outlier channel gets its own step and zero point: they stay close either way."""

from __future__ import annotations

import pytest
import torch
from kernel_families import FAMILIES, kernels_for

from kvserve import LLM
from kvserve.cache.storage.kv_storage import allocate_kv_storage
from kvserve.model.attention import Attention, AttentionMetadata
from kvserve.model.cpu_kernels import kv_writer, prefill_kernel
from kvserve.model.paged_attention import PagedAttentionMetadata, PrefillGroup, PrefillSegment, paged_attention

HEADS, KV_HEADS, HEAD_DIM, TOKENS, BLOCK = 8, 2, 64, 96, 16
# channel -> the constant its keys sit at (both halves of a RoPE pair, as a slow pair's bias puts them)
OUTLIERS = {28: 150.0, 60: -110.0, 31: 300.0, 63: 80.0}


ATTENTION = Attention(HEADS, KV_HEADS, HEAD_DIM, sliding_window=None)


def outlier_qkv(generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(TOKENS, HEADS, HEAD_DIM, generator=generator)
    k = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=generator)
    for channel, value in OUTLIERS.items():
        k[:, :, channel] += value
        q[:, :, channel] *= 0.1  # queries meet the outliers softly, so scores stay in softmax's useful range
    return q, k, torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=generator)


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    group = HEADS // KV_HEADS
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * ATTENTION.scale
    scores.masked_fill_(torch.ones(TOKENS, TOKENS, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.repeat_interleave(group, 1)).reshape(TOKENS, -1)


def quantized_attention(q, k, v, kv_dtype: str, kernels, offsets: bool) -> torch.Tensor:
    """One prompt through paged_attention over a fresh quantized cache: the CPU kernels' path when `kernels`
    is given, else the portable one. `offsets`: the cache measures its key offset on these keys first."""
    cache = allocate_kv_storage(1, TOKENS // BLOCK, BLOCK, KV_HEADS, HEAD_DIM, torch.float32,
                                kv_cache_dtype=kv_dtype)[0]
    if offsets:
        cache.key_offset_channels = torch.ones(HEAD_DIM, dtype=torch.bool)
    slots = torch.arange(TOKENS)
    if kernels is None:
        group = PrefillGroup([PrefillSegment(0, TOKENS, 0, None)], kernel_inputs=None)
    else:
        cache.writer = kv_writer(kernels, cache)
        kernel_inputs = (torch.arange(TOKENS // BLOCK).view(1, -1), torch.tensor([0, TOKENS]), torch.tensor([0]))
        group = PrefillGroup([], kernel_inputs, prefill_kernel(kernels, torch.float32, HEAD_DIM, cache))
    metadata = AttentionMetadata([0, TOKENS], [0], PagedAttentionMetadata(slots, prefill=group))
    return paged_attention(ATTENTION, q, k, v, cache, metadata)


def _errors(kv_dtype, kernels):
    q, k, v = outlier_qkv(torch.Generator().manual_seed(5))
    expected = dense(q, k, v)
    return [(quantized_attention(q, k, v, kv_dtype, kernels, offsets) - expected).abs().max().item()
            for offsets in (True, False)]


# (the largest error allowed with offsets, how many times larger it is without them at least; None: within the
# same bound without them)
BOUNDS = {"int8": (0.05, 20), "fp8_e4m3": (0.25, 10), "int4": (0.6, None)}


def _check(with_offsets: float, without: float, kv_dtype: str) -> None:
    bound, factor = BOUNDS[kv_dtype]
    assert with_offsets < bound, (with_offsets, without)
    assert without < bound if factor is None else without > factor * with_offsets, (with_offsets, without)


@pytest.mark.parametrize("kv_dtype", list(BOUNDS))
def test_key_offsets_keep_the_portable_paths_attention_close(kv_dtype):
    _check(*_errors(kv_dtype, kernels=None), kv_dtype)


@FAMILIES
@pytest.mark.parametrize("kv_dtype", list(BOUNDS))
def test_key_offsets_keep_the_kernels_attention_close(isa, kv_dtype):
    kernels = kernels_for(isa)
    if prefill_kernel(kernels, torch.float32, HEAD_DIM, allocate_kv_storage(1, 1, BLOCK, 1, HEAD_DIM, torch.float32,
                                                                           kv_cache_dtype=kv_dtype)[0]) is None:
        pytest.skip(f"no fp32 prefill kernel in the {isa} family")
    _check(*_errors(kv_dtype, kernels), kv_dtype)


def test_the_offset_is_each_channels_median_after_the_first_token_in_slow_channels_only():
    cache = allocate_kv_storage(1, 1, BLOCK, KV_HEADS, HEAD_DIM, torch.float32, kv_cache_dtype="int8")[0]
    k = torch.zeros(5, KV_HEADS, HEAD_DIM)
    k[:, :, 3] = torch.tensor([1000.0, 1.0, 2.0, 3.0, 50.0]).view(5, 1)  # the first token (a sink) is left out
    k[:, :, 40] = 7.0
    slow = torch.zeros(HEAD_DIM, dtype=torch.bool)
    slow[3] = True
    cache.key_offset_channels = slow
    cache.measure_key_offset(k)
    assert cache.key_offset_channels is None  # measured once
    assert cache.key_offset[:, 3].tolist() == [2.0, 2.0]  # the median of 1, 2, 3, 50
    assert cache.key_offset[:, 40].tolist() == [0.0, 0.0]  # a channel that turns with position keeps no offset


@pytest.mark.parametrize("kind", ["qwen2", "llama3"])
def test_engines_measure_the_same_offsets_on_every_start_and_only_for_quantized_kv(tiny_model_dir, kind):
    folder, _ = tiny_model_dir(kind)
    args = dict(dtype="float32", device="cpu", max_model_len=256)

    def offsets(kv_dtype: str, **overrides):
        return [layer.key_offset for layer in LLM(str(folder), kv_cache_dtype=kv_dtype, **(args | overrides)
                                                  ).engine.runner.kv_caches]

    first = offsets("int8")
    assert all(o is not None and o.shape == (2, 16) and o.abs().sum() > 0 for o in first)
    # The same text and tokens whatever the flags: max-model-len, batch size and pool size leave them alone.
    again = offsets("int8", max_model_len=128, max_num_batched_tokens=64, num_gpu_blocks_override=40)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert all(o is None for o in offsets("auto"))
