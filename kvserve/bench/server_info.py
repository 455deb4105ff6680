"""What the load tester asks a server before the run: which model it serves, and how long its context is."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from kvserve.bench.errors import BenchError
from kvserve.bench.sessions import RequestSize


@dataclass(slots=True)
class ServedModel:
    name: str
    max_model_len: int | None  # vLLM and kvserve say so in /v1/models; others may not


async def served_model(http: httpx.AsyncClient, base_url: str, api_key: str | None,
                       wanted: str | None) -> ServedModel:
    """The first model of /v1/models (or `wanted`, if the server lists it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = await http.get(f"{base_url}/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise BenchError(f"cannot reach {base_url}: {type(exc).__name__}: {exc}") from None
    if response.status_code != 200:
        if wanted:
            return ServedModel(wanted, None)
        raise BenchError(f"GET {base_url}/v1/models answered {response.status_code}; pass --model")
    cards = response.json().get("data") or []
    if not cards and not wanted:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --model")
    card = next((c for c in cards if c.get("id") == wanted), None) if wanted else cards[0]
    if card is None:
        return ServedModel(wanted, None)
    return ServedModel(card["id"], card.get("max_model_len"))


def check_fits_context(model: ServedModel, longest: RequestSize) -> None:
    """Refuses a workload whose longest request the server would reject (400, context length exceeded), before
    anything is sent; a server that does not say its max_model_len is not checked."""
    limit = model.max_model_len
    if limit is None or longest.total_tokens <= limit:
        return
    raise BenchError(
        f"the workload's longest request needs about {longest.total_tokens:,} tokens ({longest.prompt_tokens:,} "
        f"prompt + {longest.max_output_tokens:,} output), more than the server's max_model_len of {limit:,} for "
        f"{model.name}: start the server with a larger --max-model-len, or shorten the workload "
        f"({longest.flags}); --no-context-check sends it anyway"
    )
