"""POST /v1/chat/completions: messages through the model's chat template; streaming `chat.completion.chunk`s."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.body import parse_body
from kvserve.server.context import ServerContext, get_context
from kvserve.server.errors import bad_request
from kvserve.server.generation import (
    CLIENT_CLOSED_REQUEST, EngineJob, finished_outputs, merged_outputs, observe_finished,
    guarded_events, session_of, submit, usage_options,
)
from kvserve.server.logprobs import chat_logprobs, vllm_prompt_logprobs
from kvserve.server.prompts import Prompt, check_token_ids, render_chat, resolve_max_tokens, truncate_prompt
from kvserve.server.request_log import log_request
from kvserve.server.protocol import ChatCompletionRequest
from kvserve.server.responses import (
    chat_body, chat_choice, chat_chunk_body, chat_chunk_choice, json_response, new_response_id, now_unix,
)
from kvserve.server.sampling import build_sampling_params, check_common_unsupported
from kvserve.server.sse import SSEResponse, event
from kvserve.server.stop_limits import check_stop_limits
from kvserve.server.stream_state import StreamState, final_usage

router = APIRouter()
MAX_TOP_LOGPROBS = 20


@router.post("/v1/chat/completions")
async def create_chat_completion(request: Request) -> Response:
    ctx = get_context(request)
    body = await parse_body(request, ChatCompletionRequest, ctx.settings.max_request_bytes)
    model = ctx.resolve_model(body.model)
    check_unsupported(body)
    check_stop_limits(body, ctx.vocab_size)
    prompt = await asyncio.to_thread(_tokenize, ctx, body)
    job = await submit(ctx, [prompt], [_params(ctx, body, prompt)], body.cache_salt, "chatcmpl",
                       session_of(request, body))
    response_id, created = new_response_id("chatcmpl"), now_unix()
    log_request(ctx.request_log, job, "/v1/chat/completions", response_id, model, body)
    if body.stream:
        return SSEResponse(_events(request, ctx, job, body, response_id, created, model), on_close=job.close)
    finals = await finished_outputs(request, ctx, job)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    final = finals[0]
    choices = [
        chat_choice(choice.index, choice.text, _logprobs(ctx, body, choice.logprobs), choice.finish_reason,
                    choice.stop_reason)
        for choice in final.outputs
    ]
    response = chat_body(response_id, created, model, choices, final_usage(finals, body.n).as_dict())
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = vllm_prompt_logprobs(final.prompt_logprobs, ctx.token_texts)
    return json_response(response)


def check_unsupported(body: ChatCompletionRequest) -> None:
    check_common_unsupported(body)
    if not body.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    if body.tools:
        raise bad_request("tool calling is not supported by kvserve yet; leave tools out", param="tools")
    if body.tool_choice not in (None, "none", "auto"):
        raise bad_request("tool_choice needs tool calling, which kvserve does not support yet", param="tool_choice")
    if body.response_format is not None and body.response_format.type != "text":
        raise bad_request(f"response_format {body.response_format.type!r} is not supported (structured output is "
                          "not built); use {\"type\": \"text\"}", param="response_format")
    if body.modalities is not None and set(body.modalities) - {"text"}:
        raise bad_request("only the text modality is supported", param="modalities")
    if body.top_logprobs is not None:
        if not body.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        if not 0 <= body.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {body.top_logprobs}",
                              param="top_logprobs")


def _params(ctx: ServerContext, body: ChatCompletionRequest, prompt: Prompt) -> SamplingParams:
    # max_completion_tokens replaced max_tokens in OpenAI's API; both are accepted, the newer one wins.
    if body.max_completion_tokens is not None:
        field, requested = "max_completion_tokens", body.max_completion_tokens
    else:
        field, requested = "max_tokens", body.max_tokens
    max_tokens = resolve_max_tokens(len(prompt.token_ids), requested, ctx.max_model_len, "messages", field)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None  # the engine's k: sampled token plus top k
    return build_sampling_params(body, max_tokens, logprobs, ctx.sampling_defaults)


def _tokenize(ctx: ServerContext, body: ChatCompletionRequest) -> Prompt:
    """Runs in a worker thread: rendering and tokenizing a long conversation must not stall the event loop."""
    text = render_chat(ctx.tokenizer, body)
    token_ids = ctx.tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    token_ids = truncate_prompt(token_ids, body.truncate_prompt_tokens)
    check_token_ids(token_ids, ctx.vocab_size, "messages")
    return Prompt(token_ids, text)


def _logprobs(ctx: ServerContext, body: ChatCompletionRequest, entries) -> dict | None:
    if entries is None:
        return None
    return chat_logprobs(entries, ctx.token_texts, body.top_logprobs or 0, body.return_tokens_as_token_ids)


async def _events(request: Request, ctx: ServerContext, job: EngineJob, body: ChatCompletionRequest,
                  response_id: str, created: int, model: str) -> AsyncIterator[str]:
    state = StreamState(body.n)
    include_usage, continuous_usage = usage_options(body.stream_options)

    def chunk(choices: list[dict]) -> str:
        return event(chat_chunk_body(response_id, created, model, choices,
                                     state.usage.as_dict() if continuous_usage else None))

    async def chunks() -> AsyncIterator[str]:
        # OpenAI opens every choice with the role and an empty content, one choice per chunk throughout.
        for index in range(body.n):
            yield chunk([chat_chunk_choice(index, {"role": "assistant", "content": ""}, None, None)])
        async for prompt_index, output in merged_outputs(job):
            for delta in state.deltas(prompt_index, output):
                yield chunk([chat_chunk_choice(delta.index, {"content": delta.text} if delta.text else {},
                                               _logprobs(ctx, body, delta.logprobs), delta.finish_reason,
                                               delta.stop_reason)])
            observe_finished(ctx, job, prompt_index, output)
        if include_usage:
            yield event(chat_chunk_body(response_id, created, model, [], state.usage.as_dict()))

    async for item in guarded_events(request, ctx, job, chunks()):
        yield item
