"""Turns the last-token logits of a batch into next tokens, one row per request, with its own parameters.

Order, as in vLLM: logit bias, penalties, then min_tokens (EOS banned), then temperature, top-k, top-p,
min-p, then a draw. Logprobs are those of the raw model output (before any processing), as vLLM reports by
default.
Rows are processed together (a step's cost does not grow by a sort and a vocabulary of noise per request), and
each random row draws one uniform number, from its own generator when it has a seed, by inverse CDF: its
tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F

from kvserve.engine.request import Request, TokenLogprobs

# top-p looks for its cut among the 64 most likely tokens first (a partial sort), then among 1024 for rows
# whose kept mass needs more, and only then sorts a row whole. SmolLM2 telling a story at temperature 1 keeps
# a median of 7 tokens for top_p 0.95, 101 at the 90th percentile, 320 at most.
TOP_P_CANDIDATES = (64, 1024)
CDF_BLOCK = 256  # tokens per block of the two-level inverse CDF
PROMPT_LOGPROBS_SLICE = 256  # prompt rows log-softmaxed at once


@dataclass(slots=True)
class SampledToken:
    token_id: int
    logprobs: TokenLogprobs | None


def sample(logits: torch.Tensor, requests: list[Request]) -> list[SampledToken]:
    """logits: [num_requests, vocab] in the model's dtype, row i for requests[i]; processed in fp32."""
    raw_logprobs = _raw_logprobs(logits, requests)
    if _needs_processing(requests):
        logits = logits.to(torch.float32, copy=True)
        _apply_logit_bias(logits, requests)
        _apply_repetition_penalties(logits, requests)
        _apply_presence_and_frequency_penalties(logits, requests)
        _ban_eos_before_min_tokens(logits, requests)
    token_ids = _draw(logits, requests)
    logprobs = _logprobs(raw_logprobs, token_ids, requests)
    return [SampledToken(token_id, entry) for token_id, entry in zip(token_ids, logprobs)]


def _needs_processing(requests: list[Request]) -> bool:
    for r in requests:
        p = r.sampling_params
        if (p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 or p.logit_bias
                or r.num_output_tokens < p.min_tokens):
            return True
    return False


def _raw_logprobs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
    if all(r.sampling_params.logprobs is None for r in requests):
        return None
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


def _logprobs(raw_logprobs: torch.Tensor | None, token_ids: list[int], requests: list[Request]
              ) -> list[TokenLogprobs | None]:
    """The sampled token's logprob and rank, and the top-k, for the rows that asked."""
    entries: list[TokenLogprobs | None] = [None] * len(requests)
    rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if rows:
        logprobs = raw_logprobs.index_select(0, torch.tensor(rows, device=raw_logprobs.device))
        found = _entries(logprobs, [token_ids[i] for i in rows], [requests[i].sampling_params.logprobs for i in rows])
        for i, entry in zip(rows, found):
            entries[i] = entry
    return entries


def prompt_logprobs(logits: torch.Tensor, next_tokens: list[int], num_top: int) -> list[TokenLogprobs]:
    """Row i's logprob of next_tokens[i] (the prompt token it predicts), rank and top-k; log-softmax in slices of
    rows, since a long prompt chunk's [tokens, vocab] at once in fp32 would be large."""
    entries: list[TokenLogprobs] = []
    for start in range(0, len(next_tokens), PROMPT_LOGPROBS_SLICE):
        rows = logits[start:start + PROMPT_LOGPROBS_SLICE]
        logprobs = torch.log_softmax(rows, dim=-1, dtype=torch.float32)
        entries += _entries(logprobs, next_tokens[start:start + PROMPT_LOGPROBS_SLICE], [num_top] * rows.shape[0])
    return entries


def _entries(logprobs: torch.Tensor, token_ids: list[int], num_tops: list[int]) -> list[TokenLogprobs]:
    """Per row: the token's logprob, its rank, and the row's top num_tops[row] (one host copy each)."""
    chosen = torch.tensor(token_ids, device=logprobs.device).unsqueeze(1)
    values = logprobs.gather(1, chosen)
    ranks = ((logprobs > values).sum(dim=1) + 1).tolist()
    top_values, top_ids = logprobs.topk(max(num_tops), dim=1)
    top_values, top_ids, values = top_values.tolist(), top_ids.tolist(), values.squeeze(1).tolist()
    return [TokenLogprobs(token_id, values[n], ranks[n], list(zip(top_ids[n][:k], top_values[n][:k])))
            for n, (token_id, k) in enumerate(zip(token_ids, num_tops))]


def _apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> None:
    """Each row's biases added to its logits, all rows in one indexed update."""
    rows: list[int] = []
    tokens: list[int] = []
    biases: list[float] = []
    for row, request in enumerate(requests):
        for token, bias in (request.sampling_params.logit_bias or {}).items():
            rows.append(row)
            tokens.append(token)
            biases.append(bias)
    if rows:
        logits[_cells(rows, tokens, logits.device)] += torch.tensor(biases, device=logits.device)


def _cells(rows: list[int], tokens: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, token) pairs as an index into [rows, vocab] logits, for one indexed update of a whole step."""
    return torch.tensor(rows, device=device), torch.tensor(tokens, device=device)


def _apply_repetition_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """Every token a row has seen (prompt and output): positive logits shrink, negative ones grow; all rows in
    one indexed update."""
    row_ids: list[int] = []
    seen_counts: list[int] = []
    tokens = array("q")  # int64 without a Python object per element: a long context has thousands
    for row, request in enumerate(requests):
        if request.sampling_params.repetition_penalty != 1.0:
            seen = set(request.all_token_ids)
            row_ids.append(row)
            seen_counts.append(len(seen))
            tokens.extend(seen)
    if not row_ids:
        return
    device = logits.device
    rows = torch.tensor(row_ids, device=device).repeat_interleave(torch.tensor(seen_counts, device=device),
                                                                  output_size=len(tokens))
    index = (rows, torch.frombuffer(tokens, dtype=torch.int64).to(device))
    penalties = torch.tensor([r.sampling_params.repetition_penalty for r in requests], device=device)
    values, penalty = logits[index], penalties[rows]
    logits[index] = torch.where(values > 0, values / penalty, values * penalty)


def _apply_presence_and_frequency_penalties(logits: torch.Tensor, requests: list[Request]) -> None:
    """OpenAI semantics: only generated tokens count; all rows in one indexed update."""
    rows: list[int] = []
    tokens: list[int] = []
    amounts: list[float] = []
    for row, request in enumerate(requests):
        params = request.sampling_params
        if params.presence_penalty or params.frequency_penalty:
            for token, count in Counter(request.output_token_ids).items():
                rows.append(row)
                tokens.append(token)
                amounts.append(params.frequency_penalty * count + params.presence_penalty)
    if rows:
        logits[_cells(rows, tokens, logits.device)] -= torch.tensor(amounts, device=logits.device)


def _ban_eos_before_min_tokens(logits: torch.Tensor, requests: list[Request]) -> None:
    """Rows short of min_tokens cannot end: their stop token ids (and EOS unless ignored) get -inf."""
    rows: list[int] = []
    tokens: list[int] = []
    vocab = logits.shape[1]
    for row, request in enumerate(requests):
        params = request.sampling_params
        if request.num_output_tokens < params.min_tokens:
            banned = list(params.stop_token_ids) + ([] if params.ignore_eos else list(request.eos_token_ids))
            banned = [t for t in set(banned) if 0 <= t < vocab]
            rows.extend([row] * len(banned))
            tokens.extend(banned)
    if rows:
        logits[_cells(rows, tokens, logits.device)] = float("-inf")


def _draw(logits: torch.Tensor, requests: list[Request]) -> list[int]:
    greedy = [r.sampling_params.greedy for r in requests]
    if all(greedy):
        return _most_likely(logits).tolist()
    device = logits.device
    random_rows = torch.tensor([i for i, g in enumerate(greedy) if not g], device=device)
    chosen = torch.empty(len(requests), dtype=torch.long, device=device)
    chosen[random_rows] = _draw_random(logits.index_select(0, random_rows),
                                       [r for r, g in zip(requests, greedy) if not g])
    if any(greedy):
        greedy_rows = torch.tensor([i for i, g in enumerate(greedy) if g], device=device)
        chosen[greedy_rows] = _most_likely(logits.index_select(0, greedy_rows))
    return chosen.tolist()


def _most_likely(logits: torch.Tensor) -> torch.Tensor:
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16):
        kernels = _cpu_kernels()
        if kernels is not None:  # the same indices, ~20x faster than torch's reduction over a vocabulary row
            return kernels.first_argmax(logits)
    # max's indices, not argmax: the same first maximum, but argmax has no fast CPU path for bf16 (6x slower).
    return logits.max(dim=-1).indices


@cache
def _cpu_kernels():
    from kvserve.model.cpu_kernels import cpu_kernels

    return cpu_kernels()


def _draw_random(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """One token per row from its tempered, filtered distribution; `logits` is a copy this may overwrite."""
    params = [r.sampling_params for r in requests]
    device = logits.device
    logits = logits.float()
    # Finite in fp32 even for a huge temperature: a banned token's -inf / inf would be NaN.
    temperatures = torch.tensor([p.temperature for p in params], device=device).clamp(max=torch.finfo().max)
    logits = logits.div_(temperatures.unsqueeze(1))
    logits = _top_k(logits, [p.top_k for p in params])
    probs = torch.softmax(logits, dim=-1)
    probs = _top_p(probs, [p.top_p for p in params])
    probs = _min_p(probs, [p.min_p for p in params])
    _most_likely_where_no_mass(probs, logits)
    uniforms = _uniforms(requests, device)
    return _inverse_cdf(probs, uniforms)


def _most_likely_where_no_mass(probs: torch.Tensor, logits: torch.Tensor) -> None:
    """A row with no mass left (NaN logits, every token banned) takes its most likely token, in place, rather
    than failing the step of every request in the batch."""
    empty = ~(probs.sum(dim=1) > 0)
    if bool(empty.any()):
        best = logits[empty].nan_to_num(nan=float("-inf")).argmax(dim=1)
        probs[empty] = F.one_hot(best, probs.shape[1]).to(probs.dtype)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the token where the running sum of `probs` (unnormalised) first exceeds uniform x total.

    Two levels, because a cumulative sum over a whole vocabulary is slow on CPU: first the block of CDF_BLOCK
    tokens the target falls in (from block sums), then the token within it. Sums are fp64, and targets stay
    strictly below each level's total, so the token found always has probability > 0.
    """
    rows, vocab = probs.shape
    padding = -vocab % CDF_BLOCK
    blocks = (F.pad(probs, (0, padding)) if padding else probs).view(rows, -1, CDF_BLOCK)
    block_mass = blocks.sum(dim=2).double()
    block_cdf = block_mass.cumsum(dim=1)
    targets = uniforms.clamp(max=1 - 1e-12) * block_cdf[:, -1]
    block = torch.searchsorted(block_cdf, targets.unsqueeze(1), right=True)  # [rows, 1]
    mass = block_mass.gather(1, block)
    fraction = ((targets.unsqueeze(1) - (block_cdf.gather(1, block) - mass)) / mass).clamp(0, 1 - 1e-12)
    inner_cdf = blocks[torch.arange(rows, device=probs.device), block.squeeze(1)].double().cumsum(dim=1)
    offset = torch.searchsorted(inner_cdf, fraction * inner_cdf[:, -1:], right=True)
    return (block * CDF_BLOCK + offset).squeeze(1)


def _uniforms(requests: list[Request], device: torch.device) -> torch.Tensor:
    """One fp64 uniform per row: unseeded rows share one draw, a seeded row draws from its own generator."""
    uniforms = torch.rand(len(requests), dtype=torch.float64, device=device)
    for row, request in enumerate(requests):
        generator = _seeded_generator(request, device)
        if generator is not None:
            uniforms[row] = torch.rand((), dtype=torch.float64, device=device, generator=generator)
    return uniforms


def _seeded_generator(request: Request, device: torch.device) -> torch.Generator | None:
    """The request's own generator, made on first draw on the logits' device (a CUDA draw needs a CUDA one)."""
    seed = request.sampling_params.seed
    if seed is not None and request.generator is None:
        request.generator = torch.Generator(device=device).manual_seed(seed)
    return request.generator


def _top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    ks = [k if 0 < k < vocab else 0 for k in top_ks]  # 0: no cut
    if not any(ks):
        return logits
    values = logits.topk(max(ks), dim=1).values
    k = torch.tensor(ks, device=logits.device).unsqueeze(1)
    kth = values.gather(1, (k - 1).clamp(min=0)).masked_fill(k == 0, float("-inf"))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(probs: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    """Keeps each row's smallest set of most likely tokens whose mass reaches top_p (the crossing token kept)."""
    rows = [i for i, p in enumerate(top_ps) if p < 1.0]
    if not rows:
        return probs
    device, vocab = probs.device, probs.shape[1]
    index = torch.tensor(rows, device=device)
    selected = probs.index_select(0, index)
    top_p = torch.tensor([top_ps[i] for i in rows], device=device).unsqueeze(1)
    thresholds = torch.full_like(top_p, float("nan"))
    unresolved = torch.ones(len(rows), dtype=torch.bool, device=device)
    for num_candidates in [n for n in TOP_P_CANDIDATES if n < vocab] + [vocab]:
        thresholds[unresolved] = _top_p_thresholds(selected[unresolved], top_p[unresolved], num_candidates)
        unresolved = thresholds.isnan().squeeze(1)
        if not bool(unresolved.any()):
            break
    return probs.index_copy(0, index, selected.masked_fill(selected < thresholds, 0.0))


def _top_p_thresholds(probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int) -> torch.Tensor:
    """[rows, 1]: the probability of each row's last kept token, or NaN where the candidates hold too little."""
    values = probs.topk(num_candidates, dim=1).values  # descending
    mass_before = values.cumsum(dim=1) - values
    # At least one: a row with no mass (NaN) keeps a NaN threshold here, for the no-mass fallback to handle.
    num_kept = (mass_before < top_p).sum(dim=1, keepdim=True).clamp(min=1)
    thresholds = values.gather(1, num_kept.clamp(max=num_candidates) - 1)
    if num_candidates < probs.shape[1]:
        thresholds[num_kept == num_candidates] = float("nan")  # the cut may lie beyond the candidates
    return thresholds


def _min_p(probs: torch.Tensor, min_ps: list[float]) -> torch.Tensor:
    if not any(min_ps):
        return probs
    min_p = torch.tensor(min_ps, device=probs.device).unsqueeze(1)
    return probs.masked_fill(probs < min_p * probs.max(dim=1, keepdim=True).values, 0.0)
