"""Request bodies of the OpenAI API as kvserve accepts them (pydantic), with vLLM's extra sampling fields.

Top-level fields are strict: an unknown one is a 400 "Unrecognized request argument supplied", as OpenAI does,
so a typo (`max_token`) is caught instead of silently ignored. Fields of the OpenAI API that kvserve cannot honour
are declared here and refused with a message that names them (see `routes_*.check_unsupported`), rather than
reported as unknown. Chat messages themselves are lenient (clients send back the assistant message they got,
with `refusal`, `tool_calls`, ... set to null), and only role, content and name reach the chat template.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Each choice (prompt x n) is a full request in the engine; beyond these one API request is refused.
MAX_N = 128
MAX_CHOICES_PER_REQUEST = 1024

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: usage in every chunk


class SamplingFields(StrictModel):
    """Shared by completions and chat: OpenAI's sampling fields plus vLLM's extras, with vLLM's defaults."""

    model: str | None = None  # None: the first --served-model-name (vLLM's behaviour)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = None  # None: the model's generation_config, else 1.0
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the session, for --kv-idle-offload-seconds (the X-Session-ID header wins)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    cache_salt: str | None = Field(None, min_length=1)
    truncate_prompt_tokens: int | None = Field(None, ge=1)  # keep only the last k prompt tokens
    priority: int = 0  # refused unless 0: the scheduler is fcfs / lpm, not priority
    request_id: str | None = None  # accepted for compatibility; responses carry the server's own id
    return_tokens_as_token_ids: bool = False  # logprobs tokens as "token_id:<id>"
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's: score the prompt, answered without streaming
    metadata: dict[str, Any] | None = None  # OpenAI bookkeeping fields: accepted and ignored
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # refused unless equal to n
    suffix: str | None = None  # refused: no fill-in-the-middle
    add_special_tokens: bool = True


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(StrictModel):
    type: str
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens; both work
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None  # only {"type": "text"}
    tools: list[dict[str, Any]] | None = None  # refused unless empty: tool calling is not built
    tool_choice: Literal["none", "auto"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None  # only ["text"]
    reasoning_effort: str | None = None  # accepted and ignored: no reasoning models here
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the chat template writes any BOS itself
    chat_template: str | None = None  # refused: a client-supplied template is code run on the server
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None
