"""Synthetic prompt text of a requested length in tokens.

With the target's tokenizer (`--tokenizer`: an HF folder or its tokenizer.json, read with the `tokenizers`
library) lengths are exact up to a token at the seams where texts are joined. Without it, text is made of
common English words and the number of words comes from a tokens-per-word ratio measured against the server
(see calibrate.py): lengths are then right on average, not per prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvserve.bench.errors import BenchError

# Frequent English words: nearly all are one token (with their leading space) in the BPE vocabularies of
# Llama, Qwen2, Mistral and SmolLM, so a word count is a good first guess of a token count.
WORDS = tuple(dict.fromkeys((
    "the of and to in is was for that on as with by he at from his an were are which this be or had not but "
    "first one their its new after who they have her she two been other when there all during into school "
    "time may years more most only over city some world would where later up such used many can state about "
    "national out known university united then made under between american these three while team film "
    "being both through war north south year second also game season well than population part born before "
    "including league since released called music early family long group each work century became series "
    "several government could against life county large following four however area district public last "
    "album end river church day back around high based water house number home will made old system still "
    "what five like because best city great place made way general period small main local major people "
    "form history open short began support common record began station game line power light field design "
    "order company market paper report result road short side space story table word color model point"
).split()))


class TextMaker(Protocol):
    def text(self, rng: random.Random, num_tokens: int) -> str: ...

    def count_tokens(self, text: str) -> int: ...


def random_words(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


@dataclass(slots=True)
class WordText:
    """No tokenizer at hand: `tokens_per_word` words-to-tokens ratio, measured against the server or assumed."""

    tokens_per_word: float = 1.0

    def text(self, rng: random.Random, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        return random_words(rng, max(1, round(num_tokens / self.tokens_per_word)))

    def count_tokens(self, text: str) -> int:
        return round(len(text.split()) * self.tokens_per_word)


@dataclass(slots=True)
class TokenizerText:
    """Exact lengths with the target's own tokenizer (a `tokenizers.Tokenizer`)."""

    tokenizer: object

    def text(self, rng: random.Random, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        words = random_words(rng, num_tokens)
        ids = self.tokenizer.encode(words, add_special_tokens=False).ids
        while len(ids) < num_tokens:  # a vocabulary may merge several words into one token
            words += " " + random_words(rng, num_tokens)
            ids = self.tokenizer.encode(words, add_special_tokens=False).ids
        return self.tokenizer.decode(ids[:num_tokens])

    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)


def load_tokenizer(path: str) -> TokenizerText:
    """An HF model folder (its tokenizer.json) or a tokenizer.json file."""
    from tokenizers import Tokenizer

    file = Path(path)
    if file.suffix == ".gguf":
        raise BenchError(f"--tokenizer {path}: GGUF tokenizers are not read by the load tester; pass the HF folder "
                         "(or its tokenizer.json), or leave --tokenizer out to calibrate lengths against the server")
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise BenchError(f"--tokenizer {path}: no tokenizer.json there")
    return TokenizerText(Tokenizer.from_file(str(file)))
