"""The CPU report's pieces that need no server: the real-size random model's tokenizer (benchmarks/random_llama.py)
and the machine bounds figures are divided by (benchmarks/model_bounds.py), on the demo GGUF."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import model_bounds  # noqa: E402
import random_llama  # noqa: E402

from kvserve.model.demo import demo_model_path  # noqa: E402
from kvserve.model.loader import load_tokenizer  # noqa: E402

TEXT = "The cache grows with every token of every conversation, and on a busy server it decides."


def test_widened_tokenizer_has_llama3_vocab_size_and_encodes_like_the_demo():
    widened = random_llama.widened_demo_tokenizer(128256)
    demo = load_tokenizer(None)
    assert len(widened) == 128256
    assert widened.convert_ids_to_tokens([128255]) == ["<filler_128255>"]
    assert widened(TEXT, add_special_tokens=False)["input_ids"] == demo.encode(TEXT, add_special_tokens=False)
    assert widened.bos_token == "<|im_start|>" and widened.eos_token == "<|im_end|>"


@pytest.fixture
def unit_machine(monkeypatch):
    """1 GB/s and 1 GFLOP/s, so bounds read as bytes and FLOPs in billions."""
    monkeypatch.setattr(model_bounds, "memory_bandwidth", lambda: 1e9)
    monkeypatch.setattr(model_bounds, "compute_peak", lambda: 1e9)


def test_demo_cost_counts_the_tied_embedding_once_and_f16_kv():
    cost = model_bounds.gguf_cost(demo_model_path())
    # SmolLM2-135M: 30 layers, 3 KV heads of 64, f16 K and V.
    assert cost.kv_token_bytes == 2 * 30 * 3 * 64 * 2
    assert 130e6 < cost.matmul_params < 140e6  # the tied embedding is the output matmul, counted once
    assert cost.matmul_bytes < cost.matmul_params  # block formats: under a byte a weight
    assert cost.attention_flops_per_pair == 4 * 30 * 9 * 64


def test_bounds_take_the_larger_of_bytes_and_flops(unit_machine):
    cost = model_bounds.ModelCost(matmul_params=1000, matmul_bytes=500, kv_token_bytes=10, attention_flops_per_pair=2)
    # One sequence of 100 tokens: 500 + 1000 bytes against 2,000 + 200 FLOPs.
    assert cost.decode_bound_s([100]) == pytest.approx(2200e-9)
    # Four sequences sharing 90 tokens read those once: 500 + 10 x (400 - 270) bytes, 8,000 + 800 FLOPs.
    assert cost.decode_bound_s([100] * 4, shared_tokens=90) == pytest.approx(8800e-9)
    assert cost.decode_bound_s([10_000]) == pytest.approx((500 + 100_000) * 1e-9)
    # Prefill of 3 tokens after 2 cached: 2 x 1000 x 3 matmul FLOPs, pairs 3 x 2 + 6.
    assert cost.prefill_bound_s(3, cached=2) == pytest.approx((6000 + 2 * 12) * 1e-9)


def test_shared_prefix_bound_is_lower_when_the_prefix_is_computed_once(unit_machine):
    cost = model_bounds.ModelCost(matmul_params=1000, matmul_bytes=500, kv_token_bytes=10, attention_flops_per_pair=2)
    cached = cost.shared_prefix_bound_s([430] * 32, 400, 64, cached=True)
    uncached = cost.shared_prefix_bound_s([430] * 32, 400, 64, cached=False)
    assert cached < uncached
    assert model_bounds.fraction(2.0, 1.0) == "50%"
