"""Conversations (kvserve's extension to chat completions): a request names a `conversation` and sends only its
new messages; the gateway sends the backend the stored history followed by them, then stores them with the
answer. The history goes back exactly as it was first sent (roles, contents, every field), so the backend renders
the same prompt text turn after turn and its prefix cache keeps hitting (a gateway that rewrote earlier turns
would change the token blocks and miss). A turn is stored only once its answer is complete: a failed or
abandoned turn leaves the history as it was, ready to be sent again. A request sent with an `Idempotency-Key`
header stores its turn once, however often a client retries it (the first may have been stored after all)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.gateway.store import Store
from kvserve.server.errors import bad_request

MAX_CONVERSATION_ID_CHARS = 256
IDEMPOTENCY_HEADER = "idempotency-key"  # the IETF draft's name, as Stripe and others use it
MAX_IDEMPOTENCY_KEY_CHARS = 256


def stored_id(conversation_id: str, owner: str | None) -> str:
    """A conversation belongs to the key that started it: another key naming the same id gets its own."""
    return f"{owner}/{conversation_id}" if owner else conversation_id


@dataclass(slots=True)
class ConversationTurn:
    conversation_id: str  # as stored: the owner's key id and the client's id
    new_messages: list[dict]
    request_id: str | None = None  # the client's Idempotency-Key: its retries store the turn once

    @property
    def session_id(self) -> str:
        return f"conversation:{self.conversation_id}"


def take_conversation(body: dict, owner: str | None, request_id: str | None = None) -> ConversationTurn | None:
    """Takes `conversation` out of `body` (the backend would reject it): the turn to expand, None without one.
    `owner`: the key id of the request (None without keys); `request_id`: its Idempotency-Key header."""
    conversation_id = body.pop("conversation", None)
    if conversation_id is None:
        return None
    if not isinstance(conversation_id, str) or not 0 < len(conversation_id) <= MAX_CONVERSATION_ID_CHARS:
        raise bad_request(f"conversation must be a string of 1 to {MAX_CONVERSATION_ID_CHARS} characters",
                          param="conversation")
    new_messages = body.get("messages")
    if not isinstance(new_messages, list) or not new_messages or not all(isinstance(m, dict) for m in new_messages):
        raise bad_request("messages must be a non-empty list of message objects", param="messages")
    if request_id is not None and not 0 < len(request_id) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise bad_request(f"the Idempotency-Key header must be 1 to {MAX_IDEMPOTENCY_KEY_CHARS} characters")
    return ConversationTurn(stored_id(conversation_id, owner), new_messages, request_id)


def put_history_first(body: dict, turn: ConversationTurn, history: list[dict]) -> None:
    body["messages"] = [*history, *turn.new_messages]


async def record_turn(store: Store, turn: ConversationTurn, answer: str) -> None:
    await store.conversation_append(turn.conversation_id,
                                    [*turn.new_messages, {"role": "assistant", "content": answer}], turn.request_id)


def answer_of(completion: dict) -> str | None:
    """Choice 0's message content of a chat completion body, None if it has none."""
    choices = completion.get("choices") or []
    if not choices or not isinstance(choices[0], dict):
        return None
    message = choices[0].get("message") or {}
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None
