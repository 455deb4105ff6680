"""`kvserve eval-kv`: each --kv-cache-dtype's perplexity, KL divergence, top-1 and greedy agreement against the
model's own precision (kv_eval.py), on the demo model by default, as a table or --json."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
from dataclasses import dataclass

from kvserve.engine.cli import fails_in_one_line

DEFAULT_DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine.args import add_engine_arguments

    parser.add_argument("--kv-cache-dtypes", default=",".join(DEFAULT_DTYPES),
                        help="comma-separated KV dtypes to evaluate against --kv-cache-dtype (default: auto, the "
                             "model's precision)")
    parser.add_argument("--text-file", default=None,
                        help="the text to score (default: Python's own documentation, the stdlib's docstrings)")
    parser.add_argument("--num-tokens", type=int, default=2048, help="tokens of the text to score (default 2048)")
    parser.add_argument("--greedy-prompts", type=int, default=8,
                        help="prompts cut from the text and continued greedily under each dtype (default 8; 0: none)")
    parser.add_argument("--greedy-prompt-len", type=int, default=128, help="tokens per greedy prompt (default 128)")
    parser.add_argument("--greedy-tokens", type=int, default=64, help="tokens each continuation runs (default 64)")
    parser.add_argument("--max-perplexity-increase", type=float, default=1.0,
                        help="the recommendation's tolerance: perplexity increase in percent (default 1.0)")
    parser.add_argument("--min-greedy-agreement", type=float, default=0.0,
                        help="the recommendation's tolerance: greedy identical tokens in percent (default 0: any)")
    parser.add_argument("--no-noise-floor", dest="noise_floor", action="store_false",
                        help="skip the fp32-compute run that measures how far the compute dtype alone moves the "
                             "reference (run by default when the model computes in 16 bits)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_engine_arguments(parser)
    parser.set_defaults(enable_prefix_caching=False)  # every dtype computes the whole text itself


@fails_in_one_line("eval-kv")
def run(args: argparse.Namespace) -> int:
    from kvserve.engine.startup import EngineStartError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    candidates = [name.strip() for name in args.kv_cache_dtypes.split(",") if name.strip()]
    if not candidates:
        raise EngineStartError("--kv-cache-dtypes is empty", usage=True)
    if args.num_tokens < 2:
        raise EngineStartError(f"--num-tokens must be at least 2, got {args.num_tokens}", usage=True)
    if args.greedy_prompts < 0 or min(args.greedy_prompt_len, args.greedy_tokens) < 1:
        raise EngineStartError("--greedy-prompts must be 0 or more, --greedy-prompt-len and --greedy-tokens 1 or more",
                               usage=True)
    text = _read_text(args.text_file)
    reference_name = args.kv_cache_dtype
    reference = evaluate(args, reference_name, text)
    rows = []
    for name in candidates:
        rows.append(scored_against(name, reference, evaluate(args, name, text)))
        if not args.json:
            print(f"  scored {name}", file=sys.stderr)
    reference_ppl = rows[0].perplexity / (1 + rows[0].perplexity_increase)
    floor = noise_floor(args, reference, reference_name, text) if args.noise_floor else None
    pick = recommend(rows, args.max_perplexity_increase / 100, args.min_greedy_agreement / 100)
    if args.json:
        print(json.dumps({"model": reference.model_name, "reference_kv_cache_dtype": reference_name,
                          "compute_dtype": reference.compute_dtype,
                          "num_tokens": reference.num_tokens, "reference_perplexity": reference_ppl,
                          "reference_bytes_per_token": reference.bytes_per_token,
                          "greedy": {"prompts": len(reference.continuations), "prompt_len": args.greedy_prompt_len,
                                     "tokens": args.greedy_tokens},
                          "results": [row.as_dict() for row in rows],
                          "noise_floor": floor.as_dict() if floor else None,
                          "recommended": pick.kv_cache_dtype if pick else reference_name}, indent=2))
    else:
        _print_table(reference, reference_name, reference_ppl, rows, args.greedy_tokens)
        _print_verdict(args, reference, reference_name, floor, pick)
    return 0


def noise_floor(args: argparse.Namespace, reference: Evaluated, reference_name: str, text: str):
    """The reference itself scored against the same KV dtype under fp32 compute: how far the compute dtype alone
    moves every figure, the floor a quantized dtype's own figures sit on (None when it computes in fp32)."""
    if reference.compute_dtype == "float32":
        return None
    flags = copy.copy(args)
    flags.dtype = "float32"
    return scored_against(f"{reference_name}, {reference.compute_dtype} compute", evaluate(flags, reference_name, text),
                          reference)


def scored_against(name: str, reference: Evaluated, scored: Evaluated):
    """`scored`'s accuracy row against `reference`: logprob measures, greedy agreement, bytes per token."""
    from kvserve.engine.kv_eval import compare, greedy_agreement

    row = compare(name, reference.prompt_logprobs, scored.prompt_logprobs)
    row.bytes_per_token = scored.bytes_per_token
    if reference.continuations:
        row.greedy_agreement = greedy_agreement(reference.continuations, scored.continuations)
    return row


def recommend(rows: list, max_increase: float, min_greedy: float):
    """The candidate with the fewest bytes per token within both tolerances; None: none is, keep the reference."""
    within = [row for row in rows if row.perplexity_increase <= max_increase
              and (row.greedy_agreement is None or row.greedy_agreement >= min_greedy)]
    return min(within, key=lambda row: row.bytes_per_token, default=None)


def _read_text(path: str | None) -> str:
    from kvserve.engine.kv_eval import stdlib_text
    from kvserve.engine.startup import EngineStartError

    if path is None:
        return stdlib_text()
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError as exc:
        raise EngineStartError(f"--text-file {path}: {exc.strerror or exc}", usage=True) from None


@dataclass(slots=True)
class Evaluated:
    """What one KV dtype produced: the text's prompt logprobs and the greedy continuations of prompts cut from it."""
    prompt_logprobs: list
    continuations: list[list[int]]
    num_tokens: int
    model_name: str
    compute_dtype: str  # the model's dtype as the engine runs it (what --dtype auto resolved to)
    bytes_per_token: float  # the pool's KV bytes per token, scales included (the planner's figure)


def evaluate(args: argparse.Namespace, kv_cache_dtype: str, text: str) -> Evaluated:
    """The text's prompt logprobs (top-20 per position) and the greedy continuations, from a fresh engine."""
    from kvserve.engine.llm import LLM
    from kvserve.engine.startup import engine_config_from_flags, start_engine

    flags = copy.copy(args)
    flags.kv_cache_dtype = kv_cache_dtype
    llm = LLM.from_engine(start_engine(engine_config_from_flags(flags)))
    try:
        return _evaluate(args, llm, text)
    finally:
        llm.close()  # one engine at a time: each holds the weights and a pool


def _evaluate(args: argparse.Namespace, llm, text: str) -> Evaluated:
    from kvserve.engine.kv_eval import TOP_LOGPROBS, greedy_prompts
    from kvserve.engine.sampling_params import SamplingParams

    limit = min(args.num_tokens, llm.engine.max_model_len - 1)
    token_ids = llm.get_tokenizer().encode(text)[:limit]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_LOGPROBS)
    scored = llm.generate([token_ids], params, use_tqdm=False)[0].prompt_logprobs[1:]
    continuations: list[list[int]] = []
    if args.greedy_prompts:
        prompt_len = min(args.greedy_prompt_len, llm.engine.max_model_len - args.greedy_tokens)
        prompts = greedy_prompts(token_ids, args.greedy_prompts, max(1, prompt_len))
        greedy = SamplingParams(temperature=0.0, max_tokens=args.greedy_tokens, ignore_eos=True)
        continuations = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    engine = llm.engine
    return Evaluated(scored, continuations, len(token_ids), engine.loaded.name, str(engine.loaded.dtype).removeprefix("torch."),
                     engine.pool.block_bytes / engine.pool.block_size)


def _print_table(reference: Evaluated, reference_name: str, reference_ppl: float, rows, greedy_tokens: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV cache dtypes on {reference.model_name}: {reference.num_tokens} tokens, against "
                        f"--kv-cache-dtype {reference_name} (perplexity {reference_ppl:.4f})")
    columns = ["KV dtype", "B/token", "perplexity", "increase", "mean KLD (top-20)", "top-1 agreement"]
    if reference.continuations:
        columns.append(f"greedy identical ({len(reference.continuations)} x {greedy_tokens} tokens)")
    for column in columns:
        table.add_column(column, justify="left" if column == "KV dtype" else "right")
    for row in rows:
        cells = [row.kv_cache_dtype, f"{row.bytes_per_token:,.0f}", f"{row.perplexity:.4f}", f"{row.perplexity_increase * 100:+.2f}%",
                 f"{row.mean_kld:.5f}", f"{row.top1_agreement * 100:.2f}%"]
        if row.greedy_agreement is not None:
            cells.append(f"{row.greedy_agreement * 100:.1f}%")
        table.add_row(*cells)
    Console(width=None if sys.stdout.isatty() else 160).print(table)  # a pipe gets every column whole


def _print_verdict(args: argparse.Namespace, reference: Evaluated, reference_name: str, floor, pick) -> None:
    if floor is not None:
        greedy = "" if floor.greedy_agreement is None else f", greedy identical {floor.greedy_agreement * 100:.1f}%"
        print(f"Noise floor: {reference.compute_dtype} compute against float32 compute, same KV dtype: perplexity "
              f"{floor.perplexity_increase * 100:+.2f}%, mean KLD {floor.mean_kld:.5f}, top-1 "
              f"{floor.top1_agreement * 100:.2f}%{greedy}")
    tolerance = f"perplexity within +{args.max_perplexity_increase:g}%"
    if args.min_greedy_agreement:
        tolerance += f" and greedy identical >= {args.min_greedy_agreement:g}%"
    if pick is None:
        print(f"Recommended: --kv-cache-dtype {reference_name} (no candidate keeps {tolerance})")
        return
    print(f"Recommended: --kv-cache-dtype {pick.kv_cache_dtype}, the fewest bytes with {tolerance}: "
          f"{pick.bytes_per_token:,.0f} B/token, {reference.bytes_per_token / pick.bytes_per_token:.2f}x the tokens "
          f"of {reference_name} in the same memory")
