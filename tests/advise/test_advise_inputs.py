"""`kvserve advise` on OpenAI request bodies (rendered with the model's own template and tokenizer) and on bad
input: one clear line and a non-zero exit for what cannot be read; malformed lines skipped with a warning."""

import json
import subprocess
import sys
import uuid

import pytest
from advise_scenarios import INSTRUCTIONS, question

from kvserve.cli import main

NAMES = ["Alice", "Bob", "Carol", "Dave", "Erin", "Frank", "Grace", "Heidi"]
UUIDS = [str(uuid.UUID(int=(index + 1) * 0x9E3779B97F4A7C15F39CC0605CEDC835 % 2**128)) for index in range(len(NAMES))]


def write_lines(path, entries) -> str:
    path.write_text("".join((entry if isinstance(entry, str) else json.dumps(entry)) + "\n" for entry in entries))
    return str(path)


def chat_body(system: str, user: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            **extra}


def run_advise(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["advise", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(scope="module")
def tiny_folder(tiny_model_dir):
    return str(tiny_model_dir("llama")[0])


def test_request_bodies_with_a_request_id_and_a_name_at_the_head(tmp_path, tiny_folder, capsys):
    bodies = [chat_body(INSTRUCTIONS, f"Request ID: {UUIDS[i]}. Hello, {NAMES[i]}. {INSTRUCTIONS} "
                                      f"{question(i)}") for i in range(8)]
    path = write_lines(tmp_path / "bodies.jsonl", bodies)
    code, out, err = run_advise(capsys, path, "--model", tiny_folder, "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["hit_rate"]["logged"] is None and report["pool"]["num_blocks"] is None
    kinds = {(span["kind"], span["message"], span["role"], span["anchor"]) for span in report["dynamic_spans"]}
    assert ("uuid", 1, "user", "Request ID: ") in kinds
    assert ("varying word", 1, "user", "Hello, ") in kinds
    # Each value alone still breaks the prefix where the other one is; both moved, the user's long text is shared.
    combined = next(fix for fix in report["fixes"] if fix["finding"] == "all")
    singles = [fix["hit_rate"] for fix in report["fixes"] if fix["finding"].startswith("span")]
    assert combined["hit_rate"] > max(singles) + 0.1


def test_whitespace_variants_of_one_system_prompt(tmp_path, tiny_folder, capsys):
    variants = [INSTRUCTIONS, INSTRUCTIONS.replace(". ", ".  ", 1)]
    bodies = [chat_body(variants[i % 2], question(i)) for i in range(8)]
    code, out, err = run_advise(capsys, write_lines(tmp_path / "bodies.jsonl", bodies), "--model", tiny_folder,
                                "--json")
    assert code == 0, err
    report = json.loads(out)
    [group] = report["template_variants"]
    assert group["variants"] == 2 and group["requests"] == 8 and group["causes"] == ["whitespace in the content"]
    fix = next(fix for fix in report["fixes"] if fix["finding"] == "template 1")
    assert fix["requests_changed"] == 4 and fix["hit_rate"] > report["hit_rate"]["replayed"]


def test_completion_prompts_with_a_counter_at_the_head(tmp_path, tiny_folder, capsys):
    bodies = [{"prompt": f"Ticket {1000 + 17 * i}. {INSTRUCTIONS}\n\n{question(i)}"} for i in range(8)]
    code, out, err = run_advise(capsys, write_lines(tmp_path / "bodies.jsonl", bodies), "--model", tiny_folder,
                                "--json", "--num-blocks", "512")
    assert code == 0, err
    report = json.loads(out)
    [span] = report["dynamic_spans"]
    assert (span["kind"], span["role"], span["anchor"]) == ("number", "prompt", "Ticket ")
    move = next(fix for fix in report["fixes"] if fix["action"].startswith("move"))
    assert move["hit_rate"] > report["hit_rate"]["replayed"] + 0.3


def test_missing_file(tmp_path, capsys):
    code, _, err = run_advise(capsys, str(tmp_path / "nope.jsonl"))
    assert code == 1 and err.strip() == f"kvserve advise: error: {tmp_path / 'nope.jsonl'}: no such file"


def test_empty_log(tmp_path, capsys):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    code, _, err = run_advise(capsys, str(path))
    assert code == 1 and err.strip() == f"kvserve advise: error: {path}: no requests in it"


def test_only_malformed_lines(tmp_path, capsys):
    code, _, err = run_advise(capsys, write_lines(tmp_path / "bad.jsonl", ["{not json", '{"neither": 1}']))
    assert code == 1 and err.count("\n") == 1
    assert "no requests in it (2 malformed lines; line 1: not JSON" in err


def test_malformed_lines_are_skipped_with_a_warning(tmp_path, tiny_folder, capsys):
    bodies = [chat_body(INSTRUCTIONS, question(i)) for i in range(3)]
    path = write_lines(tmp_path / "mixed.jsonl", [bodies[0], "{truncated", bodies[1], '[1, 2]', bodies[2]])
    code, out, err = run_advise(capsys, path, "--model", tiny_folder)
    assert code == 0
    assert err.strip() == "kvserve advise: warning: skipped 2 malformed lines (line 2: not JSON (Expecting " \
                          "property name enclosed in double quotes))"
    assert "3 requests (3 prompts)" in out


def test_a_model_that_cannot_be_read(tmp_path, capsys):
    path = write_lines(tmp_path / "bodies.jsonl", [chat_body("s", "u")])
    code, _, err = run_advise(capsys, path, "--model", str(tmp_path / "no-model"))
    assert code == 1 and err.count("\n") == 1 and "no-model: no such file or folder" in err


def server_line(index: int, body: dict, text: str, token_ids: list[int], cached_tokens: int,
                block_size: int = 4, num_blocks: int = 64) -> dict:
    """A line as `kvserve serve --log-requests-file` writes it."""
    return {"version": 1, "time": 1796140000.0 + index, "request_id": f"chatcmpl-{index}",
            "endpoint": "/v1/chat/completions", "model": "m", "cache_salt": None, "request": body,
            "prompts": [{"token_ids": token_ids, "text": text, "cached_tokens": cached_tokens,
                         "output_token_ids": [[5, 6]], "finish_reasons": ["length"]}],
            "usage": {"prompt_tokens": len(token_ids), "prompt_tokens_details": {"cached_tokens": cached_tokens}},
            "finished": True, "cache": {"block_size": block_size, "num_blocks": num_blocks, "hash_algo": "xxh3_128"}}


def test_a_server_log_without_findings_is_read_without_torch(tmp_path):
    body = chat_body("s", "u")
    lines = [server_line(index, body, "s u", list(range(1, 21)), 16 if index else 0) for index in range(3)]
    path = write_lines(tmp_path / "requests.jsonl", lines)
    code = ("import json, sys; from kvserve.cli import main\n"
            f"assert main(['advise', {path!r}, '--json']) == 0\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # 16 of every 20 tokens after the first request: the log says so, and the replay (blocks of 4, hit capped
    # at 19 tokens, so 4 full blocks) agrees.
    assert report["hit_rate"]["logged"] == pytest.approx(32 / 60)
    assert report["hit_rate"]["replayed"] == pytest.approx(32 / 60)
    assert report["fixes"] == [] and report["pool"] == {"block_size": 4, "num_blocks": 64, "hash_algo": "xxh3_128"}


def test_two_chat_templates_for_the_same_messages(tmp_path, tiny_folder, capsys):
    """A log from two servers whose templates differ (one writes a BOS first): same messages, two prefixes."""
    from kvserve.model.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_folder)
    lines = []
    for index in range(8):
        body = chat_body(INSTRUCTIONS, question(index))
        text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True)
        text = ("<s>" if index % 2 else "") + text
        lines.append(server_line(index, body, text, tokenizer.encode(text, add_special_tokens=False), 0, 16, 1024))
    code, out, err = run_advise(capsys, write_lines(tmp_path / "requests.jsonl", lines), "--model", tiny_folder,
                                "--json")
    assert code == 0
    assert "4 of 8 sampled prompts render to other token ids" in err  # the other server's half
    report = json.loads(out)
    [group] = report["template_variants"]
    assert group["causes"] == ["another chat template or template arguments"] and group["variants"] == 2
    fix = next(fix for fix in report["fixes"] if fix["finding"] == "template 1")
    # Each variant misses once and then holds its own copy of the prefix; one rendering misses once in all.
    assert fix["requests_changed"] == 4 and fix["hit_rate"] > report["hit_rate"]["replayed"] + 0.05


def test_a_system_message_that_is_only_a_date(tmp_path, tiny_folder, capsys):
    """The shared text is in the next message: the date moves to the end of the last one."""
    bodies = [chat_body(f"Today is 2026-12-{index + 1:02d}.", f"{INSTRUCTIONS} {question(index)}")
              for index in range(8)]
    code, out, err = run_advise(capsys, write_lines(tmp_path / "bodies.jsonl", bodies), "--model", tiny_folder,
                                "--json")
    assert code == 0, err
    report = json.loads(out)
    [span] = report["dynamic_spans"]
    assert (span["kind"], span["message"], span["anchor"]) == ("date", 0, "Today is ")
    move = next(fix for fix in report["fixes"] if fix["action"].startswith("move"))
    assert "to the end of message 1 (user)" in move["action"]
    assert move["hit_rate"] > report["hit_rate"]["replayed"] + 0.3
