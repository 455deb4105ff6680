"""What a quantized KV cache costs in accuracy: perplexity, KL divergence and top-1 agreement of each KV dtype
against the model's own precision, on one text, through the engine's prompt_logprobs (the paged cache, its
kernels and chunked prefill are what is measured, not a separate reference implementation).

KL divergence needs both distributions at every position; prompt_logprobs carries each row's top-20, so the
divergence is computed over the reference's top-20 tokens plus one bucket for the rest of the vocabulary (a
coarse-graining of the two distributions, hence a lower bound of the full-vocabulary KL). A reference token
missing from the candidate's top-20 gets the candidate's 20th logprob, the most it can have.
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

    def as_dict(self) -> dict:
        return {"kv_cache_dtype": self.kv_cache_dtype, "num_tokens": self.num_tokens, "perplexity": self.perplexity,
                "perplexity_increase": self.perplexity_increase, "mean_kld": self.mean_kld,
                "top1_agreement": self.top1_agreement}


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


def compare(kv_cache_dtype: str, reference: list[TokenLogprobs], candidate: list[TokenLogprobs]) -> KVAccuracy:
    """The candidate's accuracy against the reference, position by position (the same prompt scored twice)."""
    assert len(reference) == len(candidate) and reference, "score the same non-empty prompt"
    ref_ppl, cand_ppl = perplexity(reference), perplexity(candidate)
    kld = sum(position_kld(r, c) for r, c in zip(reference, candidate)) / len(reference)
    agree = sum(r.top[0][0] == c.top[0][0] for r, c in zip(reference, candidate)) / len(reference)
    return KVAccuracy(kv_cache_dtype, len(reference), cand_ppl, cand_ppl / ref_ppl - 1.0, kld, agree)
