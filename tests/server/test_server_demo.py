"""End to end on the real demo model (SmolLM2-135M-Instruct), when its package is installed: the quickstart
(README, docs/index.md) answers sensibly through the official client."""

from importlib import metadata

import pytest
from server_harness import start_server

from kvserve.model.demo import DEMO_DISTRIBUTION, DEMO_MODEL_NAME
from kvserve.server.settings import ServerSettings

try:
    metadata.version(DEMO_DISTRIBUTION)
except metadata.PackageNotFoundError:
    pytest.skip(f"{DEMO_DISTRIBUTION} is not installed", allow_module_level=True)


@pytest.fixture(scope="module")
def server():
    running = start_server(None, ServerSettings(served_model_names=[DEMO_MODEL_NAME]), dtype="auto",
                           max_model_len=2048, num_gpu_blocks_override=256)
    yield running
    running.stop()


def test_demo_model_answers_through_the_openai_client(server):
    client = server.openai()
    assert client.models.list().data[0].id == DEMO_MODEL_NAME
    # A question whose greedy answer is far from a tie in bf16 (see QUESTION in test_demo_model.py).
    question = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    answer = client.chat.completions.create(model=DEMO_MODEL_NAME, messages=question, max_tokens=20, temperature=0)
    assert "Paris" in answer.choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(model=DEMO_MODEL_NAME, messages=question,
                                                                   max_tokens=20, temperature=0, stream=True))
    assert streamed == answer.choices[0].message.content
    again = client.chat.completions.create(model=DEMO_MODEL_NAME, messages=question, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same conversation hits the prefix cache
