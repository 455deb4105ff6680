"""`--workload file:PATH.jsonl`: prompts or conversations from a JSON-lines file, one entry per line.

Accepted lines:
  {"prompt": "...", "max_tokens": 128}                        (max_tokens / output_len optional)
  {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]}           (OpenAI style)
  {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}            (ShareGPT style)
A conversation is replayed as a multi-turn session: its user turns are sent in order, each with the whole
history and the server's own answers so far; the file's assistant messages only set how many tokens each answer
may have (unless --output-len is given). Entries are used in file order and repeat when the run needs more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from kvserve.bench.errors import BenchError
from kvserve.bench.sessions import RequestSize, Session, Turn, conversation_turn_size
from kvserve.bench.text import TextMaker

DEFAULT_OUTPUT_LEN = 128
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system"}


@dataclass(slots=True)
class FileWorkload:
    path: Path
    text: TextMaker  # counts the file's reference answers in tokens
    output_len: int | None = None  # None: each answer's reference length, or DEFAULT_OUTPUT_LEN for bare prompts
    name: str = "file"
    prefers_chat: bool = False
    entries: list[Session] = field(init=False)

    def __post_init__(self) -> None:
        self.entries, self.prefers_chat = read_entries(self.path, self.text, self.output_len)

    def session(self, index: int) -> Session:
        entry = self.entries[index % len(self.entries)]
        return Session(index, entry.turns, entry.system_prompt)

    def describe(self) -> dict:
        return {"workload": f"file:{self.path}", "entries": len(self.entries), "output_len": self.output_len}

    def longest_request(self) -> RequestSize:
        sizes = [conversation_turn_size(entry, turn_index, self.text.count_tokens)
                 for entry in self.entries for turn_index in range(len(entry.turns))]
        prompt, output = max(sizes, key=sum)
        return RequestSize(prompt, output, f"--output-len, or shorter entries in {self.path}")


def read_entries(path: Path, text: TextMaker, output_len: int | None) -> tuple[list[Session], bool]:
    if not path.is_file():
        raise BenchError(f"workload file {path} not found")
    entries: list[Session] = []
    has_conversations = False
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{path}:{line_number}: not JSON ({exc.msg})") from None
        session = entry_session(item, text, output_len, f"{path}:{line_number}")
        has_conversations = has_conversations or not isinstance(item.get("prompt"), str)
        entries.append(session)
    if not entries:
        raise BenchError(f"{path} holds no entries")
    return entries, has_conversations


def entry_session(item: object, text: TextMaker, output_len: int | None, where: str) -> Session:
    if not isinstance(item, dict):
        raise BenchError(f"{where}: each line must be a JSON object")
    if isinstance(item.get("prompt"), str):
        max_tokens = output_len or item.get("max_tokens") or item.get("output_len") or DEFAULT_OUTPUT_LEN
        return Session(0, [Turn(item["prompt"], int(max_tokens))])
    messages = item.get("messages") or sharegpt_messages(item.get("conversations") or item.get("conversation"), where)
    if not isinstance(messages, list) or not messages:
        raise BenchError(f"{where}: expected a 'prompt', 'messages' or 'conversations' field")
    return conversation_session(messages, text, output_len, where)


def sharegpt_messages(turns: object, where: str) -> list[dict] | None:
    if turns is None:
        return None
    if not isinstance(turns, list):
        raise BenchError(f"{where}: 'conversations' must be a list")
    messages = []
    for turn in turns:
        role = SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()) if isinstance(turn, dict) else None
        if role is None:
            raise BenchError(f"{where}: a ShareGPT turn needs 'from' (human/gpt/system) and 'value'")
        messages.append({"role": role, "content": str(turn.get("value", ""))})
    return messages


def conversation_session(messages: list[dict], text: TextMaker, output_len: int | None, where: str) -> Session:
    system = "\n".join(m["content"] for m in messages if m.get("role") == "system") or None
    turns: list[Turn] = []
    for position, message in enumerate(messages):
        if message.get("role") != "user":
            continue
        reply = next((m for m in messages[position + 1:] if m.get("role") in ("assistant", "user")), None)
        reference = reply["content"] if reply is not None and reply.get("role") == "assistant" else None
        max_tokens = output_len or (max(1, text.count_tokens(reference)) if reference else DEFAULT_OUTPUT_LEN)
        turns.append(Turn(str(message.get("content") or ""), max_tokens))
    if not turns:
        raise BenchError(f"{where}: the conversation has no user turn")
    return Session(0, turns, system)
