"""kvserve's forward pass computes what transformers computes, on the same weights (fp32)."""

import pytest
import torch

from kvserve.model.attention import AttentionMetadata
from kvserve.model.loader import load_model
from tiny_models import save_model

KINDS = ["llama", "llama3", "qwen2", "mistral"]


def kvserve_logits(loaded, token_ids: list[int]) -> torch.Tensor:
    ids = torch.tensor(token_ids)
    with torch.no_grad():
        return loaded.model(ids, torch.arange(len(token_ids)), AttentionMetadata.for_prompts([len(token_ids)]))


def reference_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.mark.parametrize("kind", KINDS)
def test_logits_match_transformers(kind, tiny_model_dir):
    folder, hf_model = tiny_model_dir(kind)
    loaded = load_model(str(folder), dtype="float32")
    generator = torch.Generator().manual_seed(1)
    # 100 tokens: past Mistral's 24-token window and Llama 3's 64-token original context.
    token_ids = torch.randint(0, 384, (100,), generator=generator).tolist()
    diff = (kvserve_logits(loaded, token_ids) - reference_logits(hf_model, token_ids)).abs().max().item()
    assert diff <= 1e-4, f"{kind}: max abs logits diff {diff}"


def test_batch_of_sequences_matches_each_alone(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2")
    loaded = load_model(str(folder), dtype="float32")
    prompts = [[5, 6, 7], list(range(10, 60)), [42]]
    flat = [t for p in prompts for t in p]
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        batched = loaded.model(torch.tensor(flat), positions, AttentionMetadata.for_prompts([len(p) for p in prompts]))
    start = 0
    for prompt in prompts:
        alone = kvserve_logits(loaded, prompt)
        # The batch's matmuls and a lone prompt's take different kernels (oneDNN's GEMM, the 1-2 row path),
        # which sum in different orders: up to 5e-5 apart on logits of magnitude ~8 (Intel Xeon, AVX2 family).
        assert torch.allclose(batched[start : start + len(prompt)], alone, atol=1e-4)
        start += len(prompt)


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    save_model("llama", single)
    save_model("llama", sharded, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = load_model(str(single), dtype="float32"), load_model(str(sharded), dtype="float32")
    for (name, pa), (_, pb) in zip(a.model.named_parameters(), b.model.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name


def test_bfloat16_close_to_float32(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    ids = list(range(3, 40))
    fp32 = kvserve_logits(load_model(str(folder), dtype="float32"), ids)
    bf16 = kvserve_logits(load_model(str(folder), dtype="bfloat16"), ids)
    relative = (fp32 - bf16).abs().max().item() / fp32.abs().max().item()
    assert relative < 0.15, relative  # bf16 keeps 8 mantissa bits; this model is deliberately sharp
