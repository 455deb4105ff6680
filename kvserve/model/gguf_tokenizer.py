"""A `tokenizers.Tokenizer` rebuilt from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json, only the vocabulary, merges, token types and a pre-tokenizer name. The
reference is transformers' GGUF tokenizer (`AutoTokenizer.from_pretrained(dir, gguf_file=...)`): same
vocabulary spelling, same pre-tokenizer per `tokenizer.ggml.pre`, same special tokens, same BOS rule, so
`backend.encode(text).ids` equals transformers' `tokenizer(text)["input_ids"]`.

Where transformers and llama.cpp disagree, this follows transformers:
- "smollm" (and other names transformers has no split for) uses the GPT-2 byte-level regex; llama.cpp
  isolates every digit first, which changes runs of whitespace just before a digit ("x =  42", "\\n\\n1.").
- SentencePiece vocabularies always get a "▁" prefix; llama.cpp honours tokenizer.ggml.add_space_prefix.
  Gemma's (architecture gemma, gemma2, gemma3) get none, as transformers' GemmaTokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from kvserve.config import ModelLoadError
from kvserve.model.gguf_file import read_gguf_metadata

logger = logging.getLogger(__name__)

CONTROL = int(gguf.TokenType.CONTROL)
USER_DEFINED = int(gguf.TokenType.USER_DEFINED)
SENTENCEPIECE_SPACE = "\u2581"

# Split regexes of the vocabularies whose merges were learned on something other than GPT-2's split,
# keyed by llama.cpp's tokenizer.ggml.pre names (the patterns are those of the models' tokenizer.json).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3", "dbrx", "pixtral"), LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), QWEN2_SPLIT),
    **dict.fromkeys(("gpt-4o", "llama4"), GPT4O_SPLIT),
    "tekken": TEKKEN_SPLIT,
}
# Names that transformers, like llama.cpp's "gpt2", splits with the GPT-2 byte-level regex. llama.cpp
# differs for "smollm" (digits isolated first) and "default" (extra punctuation/number splits).
GPT2_SPLIT_NAMES = frozenset({None, "default", "gpt2", "smollm"})


@dataclass(slots=True)
class GGUFTokenizerData:
    backend: Tokenizer
    bos_token: str | None
    eos_token: str | None
    unk_token: str | None
    pad_token: str | None
    add_bos_token: bool
    chat_template: str | None
    special_tokens: list[str]


@dataclass(slots=True)
class GGUFVocab:
    """The tokenizer.ggml.* arrays, checked for consistency."""

    path: str
    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None

    @classmethod
    def from_metadata(cls, path: str, metadata: dict[str, Any]) -> GGUFVocab:
        tokens = metadata.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelLoadError(f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.tokens is missing)")
        token_types = metadata.get("tokenizer.ggml.token_type") or [int(gguf.TokenType.NORMAL)] * len(tokens)
        scores = metadata.get("tokenizer.ggml.scores")
        for key, values in (("token_type", token_types), ("scores", scores)):
            if values is not None and len(values) != len(tokens):
                raise ModelLoadError(f"{path}: tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens")
        return cls(
            path=path,
            model=metadata.get("tokenizer.ggml.model"),
            pre=metadata.get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=token_types,
            scores=scores,
            merges=metadata.get("tokenizer.ggml.merges"),
        )

    def token(self, metadata: dict[str, Any], key: str) -> str | None:
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        if token_id is None or not 0 <= token_id < len(self.tokens):
            return None
        return self.tokens[token_id]

    def tokens_of_type(self, token_type: int) -> list[str]:
        return [token for token, kind in zip(self.tokens, self.token_types, strict=True) if kind == token_type]


def load_gguf_tokenizer(path: str) -> GGUFTokenizerData:
    return build_gguf_tokenizer(path, read_gguf_metadata(path))


def build_gguf_tokenizer(path: str, metadata: dict[str, Any]) -> GGUFTokenizerData:
    vocab = GGUFVocab.from_metadata(path, metadata)
    if vocab.model not in TOKENIZER_BUILDERS:
        raise ModelLoadError(
            f"{path}: unsupported tokenizer.ggml.model {vocab.model!r}; kvserve builds {', '.join(TOKENIZER_BUILDERS)}"
        )
    named = {name: vocab.token(metadata, key) for name, key in NAMED_SPECIAL_TOKEN_KEYS.items()}
    if vocab.model == "llama" and metadata.get("general.architecture") in GEMMA_ARCHITECTURES:
        backend = build_gemma_sentencepiece(vocab, named["unk"])
    else:
        backend = TOKENIZER_BUILDERS[vocab.model](vocab)
    special_tokens = _add_special_tokens(backend, vocab, [token for token in named.values() if token is not None])
    # SentencePiece files from before the flag existed get BOS, as llama.cpp and transformers both do.
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", vocab.model == "llama")) and named["bos"] is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and named["eos"] is not None
    backend.post_processor = _bos_eos_processor(
        backend, named["bos"] if add_bos else None, named["eos"] if add_eos else None
    )
    return GGUFTokenizerData(
        backend=backend,
        bos_token=named["bos"],
        eos_token=named["eos"],
        unk_token=named["unk"],
        pad_token=named["pad"],
        add_bos_token=add_bos,
        chat_template=metadata.get("tokenizer.chat_template"),
        special_tokens=special_tokens,
    )


NAMED_SPECIAL_TOKEN_KEYS = {
    "bos": "bos_token_id",
    "eos": "eos_token_id",
    "unk": "unknown_token_id",
    "pad": "padding_token_id",
}


# ---------------------------------------------------------------------------------------------- byte-level BPE


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: printable bytes stand for themselves, the rest are shifted past U+00FF so
    that every vocabulary entry is a printable string."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in alphabet)
    alphabet.update({byte: chr(256 + index) for index, byte in enumerate(shifted)})
    return alphabet


BYTE_ALPHABET = byte_to_unicode()
BYTE_ALPHABET_CHARS = frozenset(BYTE_ALPHABET.values())


def byte_level_spelling(token: str) -> str:
    # Most files store tokens already in the byte alphabet; a few store raw text (spaces, newlines).
    if set(token) <= BYTE_ALPHABET_CHARS:
        return token
    return "".join(BYTE_ALPHABET[byte] for byte in token.encode("utf-8"))


def build_byte_level_bpe(vocab: GGUFVocab) -> Tokenizer:
    if vocab.merges is None:
        raise ModelLoadError(f"{vocab.path}: byte-level BPE tokenizer without tokenizer.ggml.merges")
    token_ids = {byte_level_spelling(token): index for index, token in enumerate(vocab.tokens)}
    merges = [_split_merge(vocab.path, merge) for merge in vocab.merges]
    backend = Tokenizer(
        BPE(
            vocab=token_ids,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = byte_level_pre_tokenizer(vocab.pre)
    backend.decoder = decoders.ByteLevel()
    return backend


def _split_merge(path: str, merge: str) -> tuple[str, str]:
    left, separator, right = merge.partition(" ")
    if not separator:
        raise ModelLoadError(f"{path}: malformed tokenizer.ggml.merges entry {merge!r}")
    return left, right


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    split = PRE_TOKENIZER_SPLITS.get(pre)
    if split is None:
        if pre not in GPT2_SPLIT_NAMES:
            logger.warning("GGUF pre-tokenizer %r is not known; splitting text like GPT-2 (as transformers does)", pre)
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# ---------------------------------------------------------------------------------------------- SentencePiece BPE


def build_sentencepiece_bpe(vocab: GGUFVocab) -> Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral v0.1...): "▁" marks spaces, unknown bytes fall back to <0xNN>."""
    token_ids = {token: index for index, token in enumerate(vocab.tokens)}
    if vocab.merges is not None:
        merges = [_split_merge(vocab.path, merge) for merge in vocab.merges]
    elif vocab.scores is not None:
        merges = merges_from_scores(vocab.tokens, vocab.scores, token_ids)
    else:
        raise ModelLoadError(f"{vocab.path}: SentencePiece tokenizer has neither tokenizer.ggml.merges nor scores")
    backend = Tokenizer(BPE(vocab=token_ids, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=SENTENCEPIECE_SPACE, prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(SENTENCEPIECE_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return backend


GEMMA_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})


def build_gemma_sentencepiece(vocab: GGUFVocab, unk_token: str | None) -> Tokenizer:
    """Gemma's SentencePiece BPE as transformers' GemmaTokenizer builds it from a GGUF file (its
    gguf_tokenizer_mapping.gemma_tokenizer): spaces become "▁" with no prefix space, bytes fall back to <0xNN>,
    and the merges come from the vocabulary ordered by position in the file (Gemma's scores do not follow its
    merge order). Tokens of two or more spaces are stored as spaces and looked up as "▁"s."""
    tokens = [SENTENCEPIECE_SPACE * len(token) if " " in token and not token.strip() else token
              for token in vocab.tokens]
    token_ids = {token: index for index, token in enumerate(tokens)}
    merges = merges_from_scores(tokens, [-float(index) for index in range(len(tokens))], token_ids)
    backend = Tokenizer(BPE(vocab=token_ids, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None,
                            unk_token=unk_token))
    backend.normalizer = normalizers.Replace(" ", SENTENCEPIECE_SPACE)
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    backend.decoder = decoders.Sequence(
        [decoders.Replace(SENTENCEPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return backend


def merges_from_scores(tokens: list[str], scores: list[float], token_ids: dict[str, int]) -> list[tuple[str, str]]:
    """The merges a SentencePiece BPE vocabulary implies: every split of a token into two tokens, the
    highest-scoring result first. Tie order matches transformers' generate_merges, so ids match too."""
    candidates: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores, strict=True)).items():
        pairs = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in token_ids and token[cut:] in token_ids
        ]
        pairs.sort(key=lambda pair: (token_ids[pair[0]], token_ids[pair[1]]))
        candidates.extend((left, right, score) for left, right in pairs)
    candidates.sort(key=lambda candidate: (candidate[2], len(candidate[0]), len(candidate[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


TOKENIZER_BUILDERS = {
    "gpt2": build_byte_level_bpe,
    "llama": build_sentencepiece_bpe,
}


# ---------------------------------------------------------------------------------------------- special tokens


def _add_special_tokens(backend: Tokenizer, vocab: GGUFVocab, named_tokens: list[str]) -> list[str]:
    """Control tokens (<|im_end|>) and the named BOS/EOS/UNK/PAD become special tokens, user-defined ones
    (<think>) plain added tokens: either way the text is never cut inside them. Returns the special ones."""
    control = vocab.tokens_of_type(CONTROL)
    if vocab.model == "gpt2":
        # In a byte-level vocabulary a "control" token spelled outside the byte alphabet is a llama.cpp
        # mislabel; adding it would grow the vocabulary past the embedding matrix.
        control = [token for token in control if set(token) <= BYTE_ALPHABET_CHARS]
    special = list(dict.fromkeys([*control, *named_tokens]))
    backend.add_special_tokens([AddedToken(token, normalized=False, special=True) for token in special])
    model_vocab = backend.get_vocab(with_added_tokens=True)
    user_defined = [token for token in vocab.tokens_of_type(USER_DEFINED) if token in model_vocab]
    backend.add_tokens([AddedToken(token, normalized=False, special=False) for token in user_defined])
    return special


def _bos_eos_processor(backend: Tokenizer, bos: str | None, eos: str | None) -> processors.TemplateProcessing:
    # The same template transformers writes, so a pair encodes the same way too.
    prefix = f"{bos}:0 " if bos else ""
    suffix = f" {eos}:0" if eos else ""
    single = f"{prefix}$A:0{suffix}"
    pair = f"{single}{f' {bos}:1' if bos else ''} $B:1{f' {eos}:1' if eos else ''}"
    special_tokens = [(token, backend.token_to_id(token)) for token in (bos, eos) if token]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)
