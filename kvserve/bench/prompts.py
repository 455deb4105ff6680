"""A session's turn as the request body's `messages` (chat) or `prompt` (completions).

Every turn resends the whole conversation, with the answers the server actually gave, as chat clients do: this
is what lets a prefix cache hit the history. On /v1/completions the conversation is a plain transcript.
"""

from __future__ import annotations

from kvserve.bench.sessions import Session


def chat_messages(session: Session, turn_index: int, replies: list[str]) -> list[dict]:
    assert len(replies) >= turn_index, "a turn is sent only after every earlier turn was answered"
    messages = [{"role": "system", "content": session.system_prompt}] if session.system_prompt else []
    for earlier in range(turn_index):
        messages.append({"role": "user", "content": session.turns[earlier].user_text})
        messages.append({"role": "assistant", "content": replies[earlier]})
    messages.append({"role": "user", "content": session.turns[turn_index].user_text})
    return messages


def completion_prompt(session: Session, turn_index: int, replies: list[str]) -> str:
    if turn_index == 0:
        user = session.turns[0].user_text
        return f"{session.system_prompt}\n\n{user}" if session.system_prompt else user
    parts = [session.system_prompt] if session.system_prompt else []
    for earlier in range(turn_index):
        parts.append(f"User: {session.turns[earlier].user_text}\n\nAssistant: {replies[earlier]}")
    parts.append(f"User: {session.turns[turn_index].user_text}\n\nAssistant:")
    return "\n\n".join(parts)
