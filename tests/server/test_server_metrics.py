"""/metrics after a known set of requests, parsed with prometheus-client's own parser: counters equal what was
sent and what usage reported."""

import httpx
import pytest
from server_harness import MODEL_NAME

PROMPT_LENGTHS = [20, 40, 7]
MAX_TOKENS = 6


def ids(seed: int, length: int) -> list[int]:
    return [3 + (seed * 7 + i * 13) % 380 for i in range(length)]


def test_counters_match_the_requests_sent(server):
    client = server.openai()
    shared = ids(1, 48)
    prompts = [ids(i, n) for i, n in enumerate(PROMPT_LENGTHS)] + [shared + [9], shared + [10, 11]]
    usages = []
    for prompt in prompts:
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                        extra_body={"ignore_eos": True})
        usages.append(out.usage)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3, stop=None, extra_body={"ignore_eos": True})
    usages.append(chat.usage)
    stream = client.completions.create(model=MODEL_NAME, prompt="stream me", max_tokens=4, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    usages.append([c for c in stream][-1].usage)

    metrics = server.metrics()
    num_requests = len(usages)
    assert metrics["vllm:prompt_tokens_total"] == sum(u.prompt_tokens for u in usages)
    assert metrics["vllm:generation_tokens_total"] == sum(u.completion_tokens for u in usages)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in usages)
    assert cached >= 48  # the repeated 48-token prefix: three full blocks of 16
    assert metrics["vllm:prefix_cache_hits_total"] == cached
    assert metrics["vllm:prefix_cache_queries_total"] == sum(u.prompt_tokens for u in usages)
    assert metrics["vllm:request_success_total{finished_reason=length}"] == num_requests
    assert metrics["vllm:request_success_total{finished_reason=stop}"] == 0
    assert metrics["vllm:request_success_total{finished_reason=abort}"] == 0
    assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0
    assert metrics["vllm:num_preemptions_total"] == 0
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                      "request_prompt_tokens", "request_generation_tokens", "request_inference_time_seconds"):
        assert metrics[f"vllm:{histogram}_count"] == num_requests, histogram
    assert metrics["vllm:request_prompt_tokens_sum"] == metrics["vllm:prompt_tokens_total"]
    assert metrics["vllm:request_generation_tokens_sum"] == metrics["vllm:generation_tokens_total"]
    # One inter-token gap per token after the first, for each request.
    assert metrics["vllm:inter_token_latency_seconds_count"] == sum(u.completion_tokens - 1 for u in usages)


def test_labels_pool_and_info_metrics(server):
    text = httpx.get(f"{server.url}/metrics").text
    assert f'vllm:num_requests_running{{engine="0",model_name="{MODEL_NAME}"}}' in text
    metrics = server.metrics()
    blocks = {state: metrics[f"kvserve:kv_cache_blocks{{state={state}}}"] for state in ("used", "cached", "free")}
    assert sum(blocks.values()) == metrics["kvserve:kv_cache_capacity_blocks"] == 256
    assert blocks["cached"] > 0  # finished requests leave their hashed blocks behind, evictable
    block_bytes = metrics["kvserve:kv_cache_capacity_bytes"] / 256
    assert metrics["kvserve:kv_cache_bytes{state=cached}"] == blocks["cached"] * block_bytes
    assert metrics["kvserve:device_memory_used_bytes{device=cpu}"] > 0
    info = [key for key in metrics if key.startswith("vllm:cache_config_info")]
    assert len(info) == 1 and "block_size=16" in info[0] and "num_gpu_blocks=256" in info[0]


def test_metrics_are_open_and_prometheus_formatted(server):
    response = httpx.get(f"{server.url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
