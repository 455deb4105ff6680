"""What a quantized KV cache costs in accuracy: perplexity, KL divergence and top-1 agreement of each KV dtype
against the model's own precision, on one text, through the engine's prompt_logprobs (the paged cache, its
kernels and chunked prefill are what is measured, not a separate reference implementation).

KL divergence needs both distributions at every position; prompt_logprobs carries each row's top-20, so the
divergence is computed over the reference's top-20 tokens plus one bucket for the rest of the vocabulary (a
coarse-graining of the two distributions, hence a lower bound of the full-vocabulary KL). A reference token
missing from the candidate's top-20 gets the candidate's 20th logprob, the most it can have.

Greedy agreement is what a user sees: prompts cut from the same text are continued greedily under each KV dtype,
and each continuation counts the tokens it shares with the reference's before the first that differs (after
that the two condition on different text, so later matches say nothing).
"""

from __future__ import annotations

import importlib
import inspect
import math
import warnings
from dataclasses import dataclass

from kvserve.engine.request import TokenLogprobs

TOP_LOGPROBS = 20  # vLLM's default max_logprobs
# Python's own documentation, present on every machine with Python: the docstrings of these stdlib modules.
STDLIB_TEXT_MODULES = ("collections", "functools", "itertools", "argparse", "json", "logging", "pathlib", "typing",
                       "unittest", "dataclasses", "contextlib", "enum", "asyncio", "subprocess", "string", "re")
_TAIL_FLOOR = 1e-12


def stdlib_text() -> str:
    """The default evaluation text: the stdlib modules' docstrings and their public functions' docstrings."""
    parts: list[str] = []
    with warnings.catch_warnings():  # typing.io / typing.re warn when their docs are read
        warnings.simplefilter("ignore", DeprecationWarning)
        for name in STDLIB_TEXT_MODULES:
            parts += _module_docs(name)
    return "\n\n".join(parts)


def _module_docs(name: str) -> list[str]:
    """A module's docstring, then its public functions' and classes' docstrings, by name."""
    module = importlib.import_module(name)
    parts = [inspect.cleandoc(module.__doc__)] if module.__doc__ else []
    for attr in sorted(vars(module)):
        value = getattr(module, attr)
        doc = getattr(value, "__doc__", None)
        if not attr.startswith("_") and (inspect.isfunction(value) or inspect.isclass(value)) and isinstance(doc, str):
            parts.append(f"{attr}: {inspect.cleandoc(doc)}")
    return parts


@dataclass(slots=True)
class KVAccuracy:
    kv_cache_dtype: str
    num_tokens: int
    perplexity: float
    perplexity_increase: float  # relative to the reference, e.g. 0.004 = +0.4%
    mean_kld: float  # nats per token, top-20 + tail estimate (a lower bound)
    top1_agreement: float  # share of positions whose most likely token is the reference's
    greedy_agreement: float | None = None  # share of greedy continuation tokens identical to the reference's
    bytes_per_token: float | None = None  # the candidate pool's KV bytes per token, scales included

    def as_dict(self) -> dict:
        return {"kv_cache_dtype": self.kv_cache_dtype, "num_tokens": self.num_tokens, "perplexity": self.perplexity,
                "perplexity_increase": self.perplexity_increase, "mean_kld": self.mean_kld,
                "top1_agreement": self.top1_agreement, "greedy_agreement": self.greedy_agreement,
                "bytes_per_token": self.bytes_per_token}


def perplexity(entries: list[TokenLogprobs]) -> float:
    return math.exp(-sum(e.logprob for e in entries) / len(entries))


def position_kld(reference: TokenLogprobs, candidate: TokenLogprobs) -> float:
    """KL(reference || candidate) over the reference's top tokens plus a tail bucket."""
    candidate_top = dict(candidate.top)
    floor = min(candidate_top.values())
    kld, p_mass, q_mass = 0.0, 0.0, 0.0
    for token, ref_logprob in reference.top:
        cand_logprob = candidate_top.get(token, floor)
        p = math.exp(ref_logprob)
        kld += p * (ref_logprob - cand_logprob)
        p_mass += p
        q_mass += math.exp(cand_logprob)
    p_tail, q_tail = max(1.0 - p_mass, _TAIL_FLOOR), max(1.0 - q_mass, _TAIL_FLOOR)
    return max(0.0, kld + p_tail * math.log(p_tail / q_tail))


def greedy_prompts(token_ids: list[int], num_prompts: int, prompt_len: int) -> list[list[int]]:
    """`num_prompts` prompts of `prompt_len` tokens, evenly spaced through the scored text (fewer if it is short)."""
    starts = range(0, max(1, len(token_ids) - prompt_len + 1), max(1, len(token_ids) // max(1, num_prompts)))
    return [token_ids[start:start + prompt_len] for start in starts][:num_prompts]


def greedy_agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """The share of the reference's continuation tokens the candidate reproduces before its first different one."""
    assert len(reference) == len(candidate) and reference, "continue the same prompts"
    shared = 0
    for ref, cand in zip(reference, candidate):
        shared += next((i for i, (a, b) in enumerate(zip(ref, cand)) if a != b), min(len(ref), len(cand)))
    return shared / max(1, sum(len(ref) for ref in reference))


def compare(kv_cache_dtype: str, reference: list[TokenLogprobs], candidate: list[TokenLogprobs]) -> KVAccuracy:
    """The candidate's accuracy against the reference, position by position (the same prompt scored twice)."""
    assert len(reference) == len(candidate) and reference, "score the same non-empty prompt"
    ref_ppl, cand_ppl = perplexity(reference), perplexity(candidate)
    kld = sum(position_kld(r, c) for r, c in zip(reference, candidate)) / len(reference)
    agree = sum(r.top[0][0] == c.top[0][0] for r, c in zip(reference, candidate)) / len(reference)
    return KVAccuracy(kv_cache_dtype, len(reference), cand_ppl, cand_ppl / ref_ppl - 1.0, kld, agree)
