"""Prompts to token ids: completion prompts (text or ids) and chat conversations through the chat template.

Also the two checks vLLM makes before a request reaches the engine: token ids in the vocabulary and
prompt + max_tokens within max-model-len (`context_length_exceeded`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.model.chat_template import ChatTemplateError
from kvserve.model.tokenizer import Tokenizer
from kvserve.server.errors import bad_request
from kvserve.server.protocol import MAX_CHOICES_PER_REQUEST, ChatCompletionRequest, ChatMessage

CHAT_ROLES = ("system", "developer", "user", "assistant")
# Names the chat template renders with itself; chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools", "documents", "special_tokens",
                            "bos_token", "eos_token", "unk_token", "pad_token")


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    text: str | None  # the prompt as text, for echo; None until decoded


# ---- completions ------------------------------------------------------------------------------------------

def split_completion_prompts(prompt: str | list[str] | list[int] | list[list[int]], n: int) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of single prompts (text or token ids)."""
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    elif isinstance(prompt[0], int):
        prompts = [list(prompt)]  # type: ignore[arg-type]
    else:
        prompts = list(prompt)  # type: ignore[arg-type]
    if len(prompts) * n > MAX_CHOICES_PER_REQUEST:
        raise bad_request(f"at most {MAX_CHOICES_PER_REQUEST} choices (prompts x n) per request, got "
                          f"{len(prompts)} x {n}", param="prompt")
    return prompts


def tokenize_completion_prompt(tokenizer: Tokenizer, prompt: str | list[int], add_special_tokens: bool) -> Prompt:
    if isinstance(prompt, str):
        return Prompt(tokenizer.encode(prompt, add_special_tokens=add_special_tokens), prompt)
    return Prompt(list(prompt), None)


# ---- chat ---------------------------------------------------------------------------------------------------

def render_chat(tokenizer: Tokenizer, request: ChatCompletionRequest) -> str:
    messages = [template_message(index, message) for index, message in enumerate(request.messages)]
    if not messages:
        raise bad_request("messages must hold at least one message", param="messages")
    extra = dict(request.chat_template_kwargs or {})
    clash = sorted(set(extra) & set(RESERVED_TEMPLATE_KWARGS))
    if clash:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    if request.chat_template is not None:
        # As vLLM without --trust-request-chat-template: a client-supplied template is code run on the server.
        raise bad_request("per-request chat templates are not accepted; the model's chat template is used",
                          param="chat_template")
    add_generation_prompt = request.add_generation_prompt and not request.continue_final_message
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                             documents=request.documents, **extra)
    except ChatTemplateError as exc:
        raise bad_request(f"the chat template refused these messages: {exc}", param="messages") from None
    except Exception as exc:  # a template may fail in any way on odd input (TypeError, KeyError, ...)
        raise bad_request(f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
                          param="messages") from None
    if request.continue_final_message:
        text = _cut_after_final_message(text, messages)
    return text


def template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    role = message.role
    if role in ("tool", "function"):
        raise bad_request(f"messages[{index}]: {role} messages need tool calling, which kvserve does not support yet",
                          param=f"messages[{index}].role")
    if role not in CHAT_ROLES:
        raise bad_request(f"messages[{index}]: unknown role {role!r} (expected one of {', '.join(CHAT_ROLES)})",
                          param=f"messages[{index}].role")
    out: dict[str, Any] = {
        # Open-model templates know "system", not OpenAI's newer "developer".
        "role": "system" if role == "developer" else role,
        "content": message_text(index, message),
    }
    if message.name is not None:
        out["name"] = message.name
    return out


def message_text(index: int, message: ChatMessage) -> str:
    content = message.content
    if content is None:
        if message.role == "assistant":
            return ""
        raise bad_request(f"messages[{index}].content is required for role {message.role!r}",
                          param=f"messages[{index}].content")
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part_index, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"messages[{index}].content[{part_index}]: content of type {part.type!r} is not supported; "
                "kvserve serves text-only models (send {\"type\": \"text\", \"text\": ...})",
                param=f"messages[{index}].content[{part_index}]",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _cut_after_final_message(text: str, messages: list[dict[str, Any]]) -> str:
    final = messages[-1]
    if final["role"] != "assistant":
        raise bad_request("continue_final_message needs the last message to be from the assistant", param="messages")
    position = text.rfind(final["content"]) if final["content"] else -1
    if position < 0:
        raise bad_request("continue_final_message: the chat template does not render the final message verbatim",
                          param="messages")
    return text[: position + len(final["content"])]


# ---- checks -------------------------------------------------------------------------------------------------

def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    if not token_ids:
        raise bad_request("the prompt is empty; send at least one token", param=param)
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of vocabulary (0..{vocab_size - 1})", param=param)


def truncate_prompt(token_ids: list[int], keep_last: int | None) -> list[int]:
    return token_ids if keep_last is None or keep_last >= len(token_ids) else token_ids[-keep_last:]


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int, param: str,
                       max_tokens_field: str = "max_tokens") -> int:
    """max_tokens within the context window; None means all the room left (vLLM's rule)."""
    if max_tokens is not None and max_tokens < 1:
        raise bad_request(f"{max_tokens_field} must be at least 1, got {max_tokens}", param=max_tokens_field)
    room = max_model_len - num_prompt_tokens
    if room < 1 and max_tokens is None:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please reduce the length of "
            f"the {param}.", param=param, code="context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the {param}, {max_tokens} in the "
            f"completion). Please reduce the length of the {param} or completion.",
            param=param, code="context_length_exceeded",
        )
    return room if max_tokens is None else max_tokens
