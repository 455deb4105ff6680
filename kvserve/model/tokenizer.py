"""The tokenizer as kvserve uses it: a `tokenizers.Tokenizer` plus the model's special tokens and chat template.

Built either from a Hugging Face folder (tokenizer.json, tokenizer_config.json, chat_template.jinja) or from a
GGUF file's tokenizer.ggml.* metadata. Encoding uses the backend's own normalizer, pre-tokenizer and
post-processor, so whether a BOS is added is the model's decision, not ours.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tokenizers

from kvserve.config import ModelLoadError
from kvserve.model.chat_template import ChatTemplateError, render_chat_template, select_template
from kvserve.model.hf_checkpoint import read_json

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(slots=True)
class Tokenizer:
    backend: tokenizers.Tokenizer
    special_tokens: dict[str, str | None] = field(default_factory=dict)  # bos_token, eos_token, ...
    chat_template: str | None = None
    tool_chat_template: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("eos_token"))

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("bos_token"))

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        source = (self.tool_chat_template if tools and self.tool_chat_template else None) or self.chat_template
        if source is None:
            raise ChatTemplateError("this model has no chat template; use completions, not chat")
        return render_chat_template(
            source, messages, add_generation_prompt=add_generation_prompt, tools=tools,
            special_tokens=self.special_tokens, **extra,
        )


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_hf_tokenizer(folder: Path) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.exists():
        raise ModelLoadError(f"{folder}: missing tokenizer (no tokenizer.json; kvserve needs a fast tokenizer file)")
    try:
        backend = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises a plain Exception on malformed files
        raise ModelLoadError(f"{path}: cannot read tokenizer ({exc})") from None
    config_path = folder / "tokenizer_config.json"
    config = read_json(config_path) if config_path.exists() else {}
    special = {key: _token_content(config.get(key)) for key in SPECIAL_TOKEN_KEYS}
    templates = config.get("chat_template")
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.exists():
        templates = jinja_path.read_text(encoding="utf-8")
    return Tokenizer(
        backend=backend,
        special_tokens=special,
        chat_template=select_template(templates, use_tools=False),
        tool_chat_template=select_template(templates, use_tools=True),
    )
