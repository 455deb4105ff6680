"""The demo model (SmolLM2-135M-Instruct GGUF): kvserve matches transformers loading the same file."""

import pytest
import torch

from kvserve.config import ModelLoadError
from kvserve.model.attention import AttentionMetadata
from kvserve.model.demo import demo_model_path

try:
    DEMO = demo_model_path()
except ModelLoadError as exc:
    pytest.skip(f"demo model not installed: {exc}", allow_module_level=True)

# The bare "What is the capital of France?" is a near-tie for this 135M 4-bit model: its first token "The" leads
# "L'" by 0.08 nats in fp32, within bf16 noise, so any change of bf16 rounding can flip the greedy answer.
# With "Answer in one sentence." the lead is 0.86 nats in fp32 and in bf16, kernels or not.
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [
        {"role": "user", "content": "Write a haiku about caches."},
        {"role": "assistant", "content": "Keys wait in blocks,\nvalues hum in paged rows—\nprefix hits bloom."},
        {"role": "user", "content": "Now one in 中文, please 🙂"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO.parent, gguf_file=DEMO.name)


@pytest.fixture(scope="module")
def kv_model():
    from kvserve.model.loader import load_model

    return load_model(None, dtype="float32")


@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(conversation, add_generation_prompt, hf_tokenizer, kv_model):
    expected = hf_tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add_generation_prompt)
    got = kv_model.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
    assert got == expected


@pytest.mark.slow
def test_logits_of_64_token_prompt_match_transformers(kv_model, hf_tokenizer):
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(DEMO.parent, gguf_file=DEMO.name, dtype=torch.float32).eval()
    text = kv_model.tokenizer.apply_chat_template(CONVERSATIONS[2]) + "Keys and values, cached in blocks of sixteen"
    ids = kv_model.tokenizer.encode(text)[:64]
    assert len(ids) == 64 and ids == hf_tokenizer(text)["input_ids"][:64]
    with torch.no_grad():
        ours = kv_model.model(torch.tensor(ids), torch.arange(64), AttentionMetadata.for_prompts([64]))
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - theirs).abs().max().item() <= 1e-3


def test_demo_generates_sensible_text():
    from kvserve import LLM, SamplingParams

    llm = LLM(None, device="cpu", kv_cache_memory=0.25, max_model_len=1024)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks
