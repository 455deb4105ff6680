"""POST /v1/completions: prompts as text, token ids, or lists of either; streaming or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import Response

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.server.body import parse_body
from kvserve.server.context import ServerContext, get_context
from kvserve.server.errors import bad_request
from kvserve.server.generation import (
    CLIENT_CLOSED_REQUEST, EngineJob, finished_outputs, merged_outputs, observe_finished,
    guarded_events, session_of, submit, usage_options,
)
from kvserve.server.logprobs import completion_logprobs, echoed_prompt_logprobs, vllm_prompt_logprobs
from kvserve.server.prompts import (
    Prompt, check_token_ids, resolve_max_tokens, split_completion_prompts, tokenize_completion_prompt, truncate_prompt,
)
from kvserve.server.request_log import log_request
from kvserve.server.protocol import CompletionRequest
from kvserve.server.responses import (
    completion_body, completion_choice, json_response, new_response_id, now_unix,
)
from kvserve.server.sampling import build_sampling_params, check_common_unsupported
from kvserve.server.sse import SSEResponse, event
from kvserve.server.stop_limits import check_stop_limits
from kvserve.server.stream_state import StreamState, final_usage

router = APIRouter()


@router.post("/v1/completions")
async def create_completion(request: Request) -> Response:
    ctx = get_context(request)
    body = await parse_body(request, CompletionRequest, ctx.settings.max_request_bytes)
    model = ctx.resolve_model(body.model)
    check_unsupported(body)
    check_stop_limits(body, ctx.vocab_size)
    prompts = await asyncio.to_thread(_tokenize, ctx, body)
    params = [_params(ctx, body, prompt) for prompt in prompts]
    job = await submit(ctx, prompts, params, body.cache_salt, "cmpl", session_of(request, body))
    response_id, created = new_response_id("cmpl"), now_unix()
    log_request(ctx.request_log, job, "/v1/completions", response_id, model, body)
    if body.stream:
        return SSEResponse(_events(request, ctx, job, body, response_id, created, model), on_close=job.close)
    finals = await finished_outputs(request, ctx, job)
    if finals is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    choices = _final_choices(ctx, body, job, finals)
    usage = final_usage(finals, body.n).as_dict()
    return json_response(completion_body(response_id, created, model, choices, usage))


def _final_choices(ctx: ServerContext, body: CompletionRequest, job: EngineJob,
                   finals: list[RequestOutput]) -> list[dict]:
    choices = []
    for prompt_index, final in enumerate(finals):
        echo = (job.prompts[prompt_index].text or "") if body.echo else ""
        for choice in final.outputs:
            logprobs = None if choice.logprobs is None else completion_logprobs(
                choice.logprobs, ctx.token_texts, len(echo), body.return_tokens_as_token_ids)
            if logprobs is not None and body.echo:
                echoed = echoed_prompt_logprobs(final.prompt_logprobs, final.prompt_token_ids[0], ctx.token_texts,
                                                body.return_tokens_as_token_ids)
                logprobs = {key: echoed[key] + logprobs[key] for key in logprobs}
            choices.append(completion_choice(prompt_index * body.n + choice.index, echo + choice.text, logprobs,
                                             choice.finish_reason, choice.stop_reason))
            if body.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = vllm_prompt_logprobs(final.prompt_logprobs, ctx.token_texts)
    return choices


def check_unsupported(body: CompletionRequest) -> None:
    check_common_unsupported(body)
    if body.suffix:
        raise bad_request("suffix (fill-in-the-middle) is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of is not supported; leave it out or set it equal to n", param="best_of")
    if body.echo and body.logprobs is not None and body.stream:
        raise bad_request("echo with logprobs is served without streaming only", param="echo")


def _tokenize(ctx: ServerContext, body: CompletionRequest) -> list[Prompt]:
    """Runs in a worker thread: tokenizing a long prompt must not stall the event loop."""
    prompts = []
    for raw in split_completion_prompts(body.prompt, body.n):
        prompt = tokenize_completion_prompt(ctx.tokenizer, raw, body.add_special_tokens)
        prompt.token_ids = truncate_prompt(prompt.token_ids, body.truncate_prompt_tokens)
        check_token_ids(prompt.token_ids, ctx.vocab_size, "prompt")
        if body.echo and prompt.text is None:
            prompt.text = ctx.tokenizer.decode(prompt.token_ids, skip_special_tokens=body.skip_special_tokens)
        prompts.append(prompt)
    return prompts


def _params(ctx: ServerContext, body: CompletionRequest, prompt: Prompt) -> SamplingParams:
    max_tokens = resolve_max_tokens(len(prompt.token_ids), body.max_tokens, ctx.max_model_len, "prompt")
    prompt_logprobs = body.logprobs if body.echo else None  # echo with logprobs scores the prompt too
    return build_sampling_params(body, max_tokens, body.logprobs, ctx.sampling_defaults, prompt_logprobs)


async def _events(request: Request, ctx: ServerContext, job: EngineJob, body: CompletionRequest, response_id: str,
                  created: int, model: str) -> AsyncIterator[str]:
    state = StreamState(body.n)
    include_usage, continuous_usage = usage_options(body.stream_options)

    def chunk(choices: list[dict]) -> str:
        return event(completion_body(response_id, created, model, choices,
                                     state.usage.as_dict() if continuous_usage else None))

    async def chunks() -> AsyncIterator[str]:
        if body.echo:
            for prompt_index, prompt in enumerate(job.prompts):
                for child in range(body.n):
                    index = prompt_index * body.n + child
                    state.start_text(index, len(prompt.text or ""))
                    yield chunk([completion_choice(index, prompt.text or "", None, None, None)])
        async for prompt_index, output in merged_outputs(job):
            for delta in state.deltas(prompt_index, output):  # one choice per chunk, as OpenAI streams
                logprobs = None if delta.logprobs is None else completion_logprobs(
                    delta.logprobs, ctx.token_texts, delta.text_offset, body.return_tokens_as_token_ids)
                yield chunk([completion_choice(delta.index, delta.text, logprobs, delta.finish_reason,
                                               delta.stop_reason)])
            observe_finished(ctx, job, prompt_index, output)
        if include_usage:
            yield event(completion_body(response_id, created, model, [], state.usage.as_dict()))

    async for item in guarded_events(request, ctx, job, chunks()):
        yield item
