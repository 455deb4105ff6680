"""`kvserve serve --log-requests-file`: one valid line per request (chat and completions, streaming and not),
all of them in the file once the server has shut down, a bad path refused at start; and `kvserve advise` on a
log that spans a system-prompt edit shows both versions, when it changed, and the hit rate falling after it."""

import json

import pytest
from advise_scenarios import EDITED_INSTRUCTIONS, INSTRUCTIONS, send_chats
from serve_process import kvserve_serve, openai_client
from test_advise_timestamp import MODEL, advise_json, serve_flags

from kvserve.cli import main

REQUESTS_PER_VERSION = 8


@pytest.fixture(scope="module")
def edited_run(tiny_model_dir, tmp_path_factory):
    folder, _ = tiny_model_dir("llama")
    log_path = tmp_path_factory.mktemp("advise-edit") / "requests.jsonl"
    usages: dict[str, dict] = {}
    with kvserve_serve(log_path.with_suffix(".out"), *serve_flags(folder, log_path)) as server:
        client = openai_client(server.url)
        send_chats(client, MODEL, lambda index: INSTRUCTIONS, REQUESTS_PER_VERSION)
        send_chats(client, MODEL, lambda index: EDITED_INSTRUCTIONS, REQUESTS_PER_VERSION, first=REQUESTS_PER_VERSION)
        reply = client.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=4)
        usages[reply.id] = reply.usage.model_dump()
        chunks = list(client.completions.create(model=MODEL, prompt=["Paged attention", "KV caches"], max_tokens=4,
                                                stream=True, stream_options={"include_usage": True}))
        usages[chunks[-1].id] = chunks[-1].usage.model_dump()
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                     max_tokens=4, stream=True,
                                                     stream_options={"include_usage": True}))
        usages[chunks[-1].id] = chunks[-1].usage.model_dump()
    return log_path, usages  # read after the server exited: what shutdown flushed


def test_one_valid_line_per_request_flushed_at_shutdown(edited_run):
    log_path, usages = edited_run
    lines = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert len(lines) == 2 * REQUESTS_PER_VERSION + 3
    endpoints = [line["endpoint"] for line in lines]
    assert endpoints.count("/v1/chat/completions") == 2 * REQUESTS_PER_VERSION + 1
    assert endpoints.count("/v1/completions") == 2
    for line in lines:
        assert line["finished"] and line["model"] == MODEL and line["cache"]["block_size"] == 16
        assert sum(len(prompt["token_ids"]) for prompt in line["prompts"]) == line["usage"]["prompt_tokens"]
        assert all(len(prompt["output_token_ids"][0]) == 4 or line["endpoint"].endswith("chat/completions")
                   for prompt in line["prompts"])
    by_id = {line["request_id"]: line for line in lines}
    for response_id, usage in usages.items():  # the streamed and non-streamed replies' usage, as logged
        logged = by_id[response_id]["usage"]
        assert logged["prompt_tokens"] == usage["prompt_tokens"]
        assert logged["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens_details"]["cached_tokens"]
    chat = next(line for line in lines if line["endpoint"] == "/v1/chat/completions")
    assert chat["request"]["messages"][0] == {"role": "system", "content": INSTRUCTIONS}
    assert chat["prompts"][0]["text"].startswith("<|im_start|>system\n" + INSTRUCTIONS)
    two_prompts = next(line for line in lines if line["request"].get("stream") and "prompt" in line["request"])
    assert [prompt["text"] for prompt in two_prompts["prompts"]] == ["Paged attention", "KV caches"]


def test_advise_shows_both_versions_and_the_drop_after_the_edit(edited_run, capsys):
    log_path, _ = edited_run
    report = advise_json(capsys, str(log_path))
    versions = report["system_prompt_versions"]
    assert [(v["version"], v["requests"]) for v in versions] == [(1, REQUESTS_PER_VERSION), (2, REQUESTS_PER_VERSION)]
    assert versions[0]["text_start"].startswith("You are a helpful assistant")
    assert versions[1]["text_start"].startswith("You are a friendly assistant")
    assert versions[0]["last_seen"] <= versions[1]["first_seen"]
    [change] = report["version_changes"]
    assert (change["from"], change["to"], change["request"]) == (1, 2, REQUESTS_PER_VERSION)
    assert change["time"] == versions[1]["first_seen"]
    assert "helpful" in change["old_excerpt"] and "friendly" in change["new_excerpt"]
    assert change["hit_rate_after"] < change["hit_rate_before"] - 0.05
    pin = next(fix for fix in report["fixes"] if fix["finding"] == "versions")
    assert pin["action"] == "pin system prompt v1" and pin["requests_changed"] == REQUESTS_PER_VERSION
    assert pin["hit_rate"] > report["hit_rate"]["logged"]
    assert report["dynamic_spans"] == []  # an edit is not dynamic content


def test_console_report_marks_the_change(edited_run, capsys, tmp_path):
    log_path, _ = edited_run
    assert main(["advise", str(log_path), "--plot", str(tmp_path / "hit_rate.png")]) == 0
    out = capsys.readouterr().out
    assert "system-prompt versions" in out and "v1 -> v2" in out
    assert (tmp_path / "hit_rate.png").stat().st_size > 0


def test_a_bad_log_path_fails_at_start_with_one_line(tiny_model_dir, tmp_path, capsys):
    folder, _ = tiny_model_dir("llama")
    (tmp_path / "not-a-dir").write_text("")  # a missing folder is created (0700); a file in the way is not
    bad = tmp_path / "not-a-dir" / "requests.jsonl"
    capsys.readouterr()  # what building the model folder printed, when this test built it
    assert main(["serve", "--model", str(folder), "--log-requests-file", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--log-requests-file" in err and "not-a-dir" in err
