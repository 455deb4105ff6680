"""Turns the last-token logits of a batch into next tokens, one row per request, with its own parameters.

Order, as in vLLM: penalties, then min_tokens (EOS banned), then temperature, top-k, top-p, min-p, then
a draw. Logprobs are those of the raw model output (before any processing), as vLLM reports by default.
A request with a seed draws from its own generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.request import Request, TokenLogprobs


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


def sample(logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
    """logits: [num_requests, vocab] fp32, row i for requests[i]."""
    raw_logprobs = _raw_logprobs(logits, requests)
    logits = logits.clone() if _needs_processing(requests) else logits
    for row, request in enumerate(requests):
        _apply_penalties(logits[row], request)
        _ban_eos_before_min_tokens(logits[row], request)
    token_ids = _draw(logits, requests)
    return [
        SampledToken(token_id, None if raw_logprobs is None else _token_logprobs(raw_logprobs[row], token_id, request))
        for row, (token_id, request) in enumerate(zip(token_ids, requests))
    ]


def _needs_processing(requests: list[Request]) -> bool:
    for r in requests:
        p = r.sampling_params
        if (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                or r.num_output_tokens < p.min_tokens or not p.greedy):
            return True
    return False


def _raw_logprobs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
    if all(r.sampling_params.logprobs is None for r in requests):
        return None
    return torch.log_softmax(logits, dim=-1)


def _token_logprobs(logprobs: torch.Tensor, token_id: int, request: Request) -> TokenLogprobs | None:
    k = request.sampling_params.logprobs
    if k is None:
        return None
    value = logprobs[token_id]
    rank = int((logprobs > value).sum().item()) + 1
    top: list[tuple[int, float]] = []
    if k > 0:
        top_values, top_ids = logprobs.topk(k)
        top = list(zip(top_ids.tolist(), top_values.tolist()))
    return TokenLogprobs(token_id, float(value), rank, top)


def _apply_penalties(row: torch.Tensor, request: Request) -> None:
    params = request.sampling_params
    if params.repetition_penalty != 1.0:
        # Applies to every token seen (prompt and output): shrink positive logits, grow negative ones.
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long, device=row.device)
        values = row[seen]
        row[seen] = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
    if (params.presence_penalty or params.frequency_penalty) and request.num_output_tokens:
        # OpenAI semantics: only generated tokens count.
        output = torch.tensor(request.output_token_ids, dtype=torch.long, device=row.device)
        counts = torch.bincount(output, minlength=row.shape[0])[: row.shape[0]].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def _ban_eos_before_min_tokens(row: torch.Tensor, request: Request) -> None:
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        return
    banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
    banned = [t for t in banned if 0 <= t < row.shape[0]]
    if banned:
        row[banned] = float("-inf")


def _draw(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.greedy]
    token_ids = [0] * len(requests)
    if greedy_rows:
        chosen = logits[greedy_rows].argmax(dim=-1).tolist() if len(greedy_rows) < len(requests) else logits.argmax(dim=-1).tolist()
        for row, token in zip(greedy_rows, chosen):
            token_ids[row] = token
    for row, request in enumerate(requests):
        if not request.sampling_params.greedy:
            token_ids[row] = _draw_one(logits[row], request)
    return token_ids


def _draw_one(row: torch.Tensor, request: Request) -> int:
    params = request.sampling_params
    row = row / params.temperature
    if params.top_k and params.top_k < row.shape[0]:
        kth = row.topk(params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if params.top_p < 1.0:
        probs = _top_p(probs, params.top_p)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p; one generator call per token.
    noise = torch.empty_like(probs).exponential_(1.0, generator=_seeded_generator(request, probs.device))
    return int((probs / noise).argmax().item())


def _seeded_generator(request: Request, device: torch.device) -> torch.Generator | None:
    """The request's own generator, made on first draw on the logits' device (a CUDA draw needs a CUDA one)."""
    seed = request.sampling_params.seed
    if seed is not None and request.generator is None:
        request.generator = torch.Generator(device=device).manual_seed(seed)
    return request.generator


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the token that crosses it is kept).
    drop_sorted = (cumulative - sorted_probs) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return probs.masked_fill(drop, 0.0)
