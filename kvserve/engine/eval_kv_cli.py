"""`kvserve eval-kv`: each --kv-cache-dtype's perplexity, KL divergence and top-1 agreement against the model's own
precision (kv_eval.py), on the demo model by default, as a table or --json."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys

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
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_engine_arguments(parser)
    parser.set_defaults(enable_prefix_caching=False)  # every dtype computes the whole text itself


@fails_in_one_line("eval-kv")
def run(args: argparse.Namespace) -> int:
    from kvserve.engine.kv_eval import compare
    from kvserve.engine.startup import EngineStartError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    candidates = [name.strip() for name in args.kv_cache_dtypes.split(",") if name.strip()]
    if not candidates:
        raise EngineStartError("--kv-cache-dtypes is empty", usage=True)
    if args.num_tokens < 2:
        raise EngineStartError(f"--num-tokens must be at least 2, got {args.num_tokens}", usage=True)
    text = _read_text(args.text_file)
    reference_name = args.kv_cache_dtype
    reference, num_tokens, model_name = score_text(args, reference_name, text)
    rows = []
    for name in candidates:
        scored, _, _ = score_text(args, name, text)
        rows.append(compare(name, reference, scored))
        if not args.json:
            print(f"  scored {name}", file=sys.stderr)
    reference_ppl = rows[0].perplexity / (1 + rows[0].perplexity_increase)
    if args.json:
        print(json.dumps({"model": model_name, "reference_kv_cache_dtype": reference_name, "num_tokens": num_tokens,
                          "reference_perplexity": reference_ppl, "results": [row.as_dict() for row in rows]}, indent=2))
    else:
        _print_table(model_name, reference_name, num_tokens, reference_ppl, rows)
    return 0


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


def score_text(args: argparse.Namespace, kv_cache_dtype: str, text: str):
    """The text's prompt logprobs (top-20 per position) under one KV dtype, from a fresh engine."""
    from kvserve.engine.kv_eval import TOP_LOGPROBS
    from kvserve.engine.llm import LLM
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.engine.startup import engine_config_from_flags, start_engine

    flags = copy.copy(args)
    flags.kv_cache_dtype = kv_cache_dtype
    llm = LLM.from_engine(start_engine(engine_config_from_flags(flags)))
    limit = min(args.num_tokens, llm.engine.max_model_len - 1)
    token_ids = llm.get_tokenizer().encode(text)[:limit]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP_LOGPROBS)
    output = llm.generate([token_ids], params, use_tqdm=False)[0]
    return output.prompt_logprobs[1:], len(token_ids), llm.engine.loaded.name


def _print_table(model: str, reference: str, num_tokens: int, reference_ppl: float, rows) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"KV cache dtypes on {model}: {num_tokens} tokens, against --kv-cache-dtype {reference} "
                        f"(perplexity {reference_ppl:.4f})")
    for column in ("KV dtype", "perplexity", "increase", "mean KLD (top-20)", "top-1 agreement"):
        table.add_column(column, justify="left" if column == "KV dtype" else "right")
    for row in rows:
        table.add_row(row.kv_cache_dtype, f"{row.perplexity:.4f}", f"{row.perplexity_increase * 100:+.2f}%",
                      f"{row.mean_kld:.5f}", f"{row.top1_agreement * 100:.2f}%")
    Console().print(table)
