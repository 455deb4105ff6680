"""The OpenAI API as clients see it: the official `openai` client (and raw httpx for the wire format) against a
real server on 127.0.0.1 running a tiny model."""

import asyncio
import json

import httpx
import openai
import pytest
import torch
from logprob_checks import LOGPROB_TOLERANCE, assert_rank_matches, rank_range, tokens_surely_in_top
from server_harness import ALIAS, MAX_MODEL_LEN, MODEL_NAME

from kvserve import __version__


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def ids(seed: int, length: int) -> list[int]:
    return [3 + (seed * 131 + i * 17) % 380 for i in range(length)]


def test_models_health_version(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME, ALIAS]
    assert models.data[0].max_model_len == MAX_MODEL_LEN
    assert client.models.retrieve(ALIAS).id == ALIAS
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


def test_completion_text_prompt(client):
    out = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=7, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion" and out.id.startswith("cmpl-") and out.model == MODEL_NAME
    choice = out.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert out.usage.completion_tokens == 7
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7
    assert isinstance(out.usage.prompt_tokens_details.cached_tokens, int)


def test_default_max_tokens_is_16_and_alias_works(client):
    out = client.completions.create(model=ALIAS, prompt=ids(1, 5), temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.model == ALIAS


def test_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL_NAME, prompt=ids(2, 12), max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    full = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_token_id_prompts_batch_and_n(client):
    prompts = [ids(3, 6), ids(4, 9)]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=4, temperature=1.0, seed=7,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 6 + 9
    assert out.usage.completion_tokens == 4 * 4
    again = client.completions.create(model=MODEL_NAME, prompt=prompts, n=2, max_tokens=4, temperature=1.0, seed=7,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == \
           [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_list_of_text_prompts_streamed_with_usage(client):
    stream = client.completions.create(model=MODEL_NAME, prompt=["Paged attention", "KV caches"], max_tokens=5,
                                       temperature=0, stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_logprobs_and_echo(client):
    out = client.completions.create(model=MODEL_NAME, prompt=ids(5, 8), max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value <= 0 and token in top and len(top) >= 3
        assert value == pytest.approx(max(top.values()))  # greedy: the sampled token is the most likely
    echoed = client.completions.create(model=MODEL_NAME, prompt="Paged attention", max_tokens=3, temperature=0,
                                       echo=True)
    assert echoed.choices[0].text.startswith("Paged attention")


def test_echo_with_logprobs_scores_the_prompt(client, tiny_model_dir):
    """What log-likelihood evaluations send (lm-eval's local-completions: a batch of token-id prompts, echo,
    logprobs 1, max_tokens 1): each prompt token after the first gets transformers' logprob; the first has none."""
    _, hf_model = tiny_model_dir("llama")
    prompts = [ids(4, 20), ids(5, 9)]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1, seed=1234, extra_body={"return_tokens_as_token_ids": True})
    for prompt, choice in zip(prompts, sorted(out.choices, key=lambda c: c.index)):
        scored = choice.logprobs
        assert scored.tokens[:-1] == [f"token_id:{t}" for t in prompt] and len(scored.tokens) == len(prompt) + 1
        assert scored.token_logprobs[0] is None and scored.top_logprobs[0] is None
        with torch.no_grad():
            reference = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
        for position in range(1, len(prompt)):
            expected = reference[position - 1]
            assert scored.token_logprobs[position] == pytest.approx(float(expected[prompt[position]]),
                                                                    abs=LOGPROB_TOLERANCE)
            # lm-eval's greedy check: the token's logprob is the best of its top logprobs exactly when it is argmax
            # (up to a near-tie with the runner-up, which two fp32 computations may break either way)
            is_best = scored.token_logprobs[position] == max(scored.top_logprobs[position].values())
            best_rank, worst_rank = rank_range(expected, prompt[position])
            assert (best_rank == 1) if is_best else (worst_rank > 1)
    with pytest.raises(openai.BadRequestError, match="without streaming"):
        client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=3, echo=True, logprobs=1, stream=True)


def test_vllm_prompt_logprobs_field_on_both_routes(server, tiny_model_dir):
    """vLLM's extra: per prompt token, None first, then {token id: {logprob, rank, decoded_token}} holding the
    prompt token and the top k; on a completion choice, at the top of a chat response."""
    _, hf_model = tiny_model_dir("llama")
    prompt = ids(6, 15)
    body = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 3}, timeout=30).json()
    scored = body["choices"][0]["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    with torch.no_grad():
        reference = hf_model(torch.tensor([prompt])).logits[0].log_softmax(-1)
    for position in range(1, len(prompt)):
        expected = reference[position - 1]
        entry = scored[position][str(prompt[position])]
        assert entry["logprob"] == pytest.approx(float(expected[prompt[position]]), abs=LOGPROB_TOLERANCE)
        # Every listed token (the prompt token and the top 3) at a rank the reference allows up to near-ties;
        # the tokens no near-tie can push out of the top 3 are all there, and at most the prompt token besides.
        listed = {int(token): value for token, value in scored[position].items()}
        for token, value in listed.items():
            assert value["logprob"] == pytest.approx(float(expected[token]), abs=LOGPROB_TOLERANCE)
            assert_rank_matches(value["rank"], expected, token)
        assert tokens_surely_in_top(expected, 3) <= set(listed) and len(listed) <= 4
    chat = httpx.post(f"{server.url}/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0},
        timeout=30).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    streamed = httpx.post(f"{server.url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 1, "stream": True}, timeout=30)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


def test_logit_bias_bans_and_forces_tokens(client):
    as_ids = {"ignore_eos": True, "return_tokens_as_token_ids": True}

    def greedy_ids(**kwargs) -> list[int]:
        out = client.completions.create(model=MODEL_NAME, prompt=ids(9, 12), max_tokens=4, temperature=0, logprobs=0,
                                        extra_body=as_ids, **kwargs)
        return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]

    plain = greedy_ids()
    assert greedy_ids(logit_bias={str(plain[0]): -100})[0] != plain[0]
    forced = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=5, temperature=1.0, seed=3, logprobs=True,
                                            logit_bias={"77": 100}, extra_body=as_ids)
    assert [entry.token for entry in forced.choices[0].logprobs.content] == ["token_id:77"] * 5


def test_stop_string_and_stop_reason(client):
    base = client.completions.create(model=MODEL_NAME, prompt=ids(6, 10), max_tokens=16, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(base) > 6
    stop = base[3:5]
    out = client.completions.create(model=MODEL_NAME, prompt=ids(6, 10), max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert out.text == base[: base.index(stop)]
    assert out.finish_reason == "stop" and out.model_extra["stop_reason"] == stop


def test_chat_non_stream_and_stream(client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": [{"type": "text", "text": "Name a"}, {"type": "text", "text": "colour"}]}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_completion_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")
    message = out.choices[0].message
    assert message.role == "assistant" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    usage = chunks.pop().usage  # the same prompt again: every whole block of it but the last token's is cached
    prompt_tokens = out.usage.prompt_tokens
    assert usage.prompt_tokens == prompt_tokens and usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_logprobs_n_and_usage_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4, n=2, temperature=0.8, seed=3,
        logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(tokens) == 8
    assert all(len(t.top_logprobs) == 2 and isinstance(t.bytes, list) for t in tokens)
    assert chunks[-1].usage.completion_tokens == 8
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         logprobs=True, temperature=0, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(t.top_logprobs == [] and t.logprob <= 0 for t in content)


def test_chat_without_max_tokens_uses_the_room_left(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}],
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens + out.usage.completion_tokens == MAX_MODEL_LEN
    assert out.choices[0].finish_reason == "length"


def test_cached_tokens_on_a_repeated_prefix(client):
    shared = ids(9, 80)
    first = client.completions.create(model=MODEL_NAME, prompt=shared + [5, 6], max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=shared + [7, 8, 9], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens < 64
    assert second.usage.prompt_tokens_details.cached_tokens >= 64  # the shared full blocks of 16


def test_sixteen_concurrent_streams(server, client):
    prompts = [ids(20 + i, 5 + i) for i in range(16)]
    expected = [client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text for p in prompts]

    async def one(aclient, prompt):
        text = ""
        finish = None
        async for chunk in await aclient.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def all_streams():
        async with server.async_openai() as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(all_streams())
    assert [text for text, _ in results] == expected
    assert all(finish == "length" for _, finish in results)


def test_sse_wire_format(server):
    body = {"model": MODEL_NAME, "prompt": "fox", "max_tokens": 4, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = b"".join(response.iter_bytes()).decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ") and "\n" not in event
        json.loads(event[len("data: "):])
    usage = json.loads(events[-3][len("data: "):])["usage"]
    assert usage["completion_tokens"] == 4 and "cached_tokens" in usage["prompt_tokens_details"]


def test_chat_sse_wire_format(server):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True, "ignore_eos": True}
    raw = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).text
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    first = json.loads(events[0][len("data: "):])
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = json.loads(events[-2][len("data: "):])
    assert last["choices"][0]["finish_reason"] == "length"


def test_model_field_may_be_omitted(server):
    out = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30).json()
    assert out["model"] == MODEL_NAME
