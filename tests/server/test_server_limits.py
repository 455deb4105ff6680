"""Per-request bounds a client cannot exceed: stop strings and stop token ids (a 400 with OpenAI's envelope)."""

import openai
import pytest
from server_harness import MODEL_NAME

from kvserve.server.stop_limits import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS

TINY_VOCAB_SIZE = 384


def complete(server, **fields):
    return server.openai().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2, **fields)


def chat(server, **fields):
    return server.openai().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2, **fields)


def refused(call, param: str) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    error = caught.value.body
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    return error


def test_stop_strings_up_to_the_cap_are_served(server):
    response = complete(server, stop=[f"<stop{i}>" for i in range(MAX_STOP_STRINGS)])
    assert response.choices[0].finish_reason in ("stop", "length")


def test_too_many_stop_strings_are_refused(server):
    stops = [f"<stop{i}>" for i in range(MAX_STOP_STRINGS + 1)]
    error = refused(lambda: complete(server, stop=stops), "stop")
    assert f"at most {MAX_STOP_STRINGS} stop strings" in error["message"]
    refused(lambda: chat(server, stop=stops), "stop")


def test_a_million_stop_strings_are_refused(server):
    refused(lambda: complete(server, stop=["x"] * 1_000_000), "stop")


def test_a_long_stop_string_is_refused(server):
    error = refused(lambda: complete(server, stop="y" * (MAX_STOP_STRING_CHARS + 1)), "stop")
    assert str(MAX_STOP_STRING_CHARS) in error["message"]
    refused(lambda: chat(server, stop=["ok", "z" * (MAX_STOP_STRING_CHARS + 1)]), "stop")


def test_too_many_stop_token_ids_are_refused(server):
    token_ids = [5] * (MAX_STOP_TOKEN_IDS + 1)
    error = refused(lambda: complete(server, extra_body={"stop_token_ids": token_ids}), "stop_token_ids")
    assert f"at most {MAX_STOP_TOKEN_IDS}" in error["message"]


@pytest.mark.parametrize("token_id", [TINY_VOCAB_SIZE, -1, 10**12])
def test_stop_token_ids_outside_the_vocabulary_are_refused(server, token_id):
    error = refused(lambda: chat(server, extra_body={"stop_token_ids": [5, token_id]}), "stop_token_ids")
    assert "out of vocabulary" in error["message"]


def test_stop_token_ids_within_the_vocabulary_are_served(server):
    response = complete(server, extra_body={"stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))})
    assert response.choices[0].finish_reason in ("stop", "length")
