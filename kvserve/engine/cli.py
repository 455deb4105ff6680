"""`kvserve generate "prompt"` and the interactive `kvserve chat`, on the demo model by default."""

from __future__ import annotations

import argparse
import logging
import sys
import time


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256)
    group.add_argument("--temperature", type=float, default=0.0)
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--min-p", type=float, default=0.0)
    group.add_argument("--repetition-penalty", type=float, default=1.0)
    group.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine.args import add_engine_arguments

    parser.add_argument("prompt", nargs="+", help="one or more prompts")
    parser.add_argument("--chat-template", action="store_true", help="wrap each prompt as a user chat turn")
    add_sampling_arguments(parser)
    add_engine_arguments(parser)


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    from kvserve.engine.args import add_engine_arguments

    parser.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(parser)
    add_engine_arguments(parser)


def _sampling_params(args: argparse.Namespace):
    from kvserve.engine.sampling_params import SamplingParams
    from kvserve.engine.startup import EngineStartError

    try:
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
            repetition_penalty=args.repetition_penalty, seed=args.sampling_seed, max_tokens=args.max_tokens,
            stop=args.stop, ignore_eos=args.ignore_eos,
        )
    except ValueError as exc:
        raise EngineStartError(str(exc), usage=True) from None


def _make_llm(args: argparse.Namespace):
    from kvserve.engine.llm import LLM
    from kvserve.engine.startup import engine_config_from_flags, start_engine

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return LLM.from_engine(start_engine(engine_config_from_flags(args)))


def fails_in_one_line(command: str):
    """Runs the command; a start-up failure ends with one line on stderr and exit status 2 (usage) or 1."""

    def wrap(run):
        def run_reporting_failures(args: argparse.Namespace) -> int:
            from kvserve.engine.startup import EngineStartError

            try:
                return run(args)
            except EngineStartError as exc:
                print(f"kvserve {command}: error: {exc}", file=sys.stderr)
                return 2 if exc.usage else 1

        return run_reporting_failures

    return wrap


@fails_in_one_line("generate")
def run_generate(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    started = time.perf_counter()
    if args.chat_template:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    elapsed = time.perf_counter() - started
    num_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    for output in outputs:
        print(output.outputs[0].text)
        if len(outputs) > 1:
            print("-" * 40)
    print(f"[{num_tokens} tokens in {elapsed:.2f} s, {num_tokens / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


@fails_in_one_line("chat")
def run_chat(args: argparse.Namespace) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    engine = llm.engine
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kvserve chat: type a message, empty line or Ctrl-D to quit.", file=sys.stderr)
    for turn in range(10**9):
        try:
            user = input("> ").strip()
        except EOFError:
            break
        if not user:
            break
        messages.append({"role": "user", "content": user})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        engine.add_request(f"chat-{turn}", engine.tokenizer.encode(text, add_special_tokens=False), params)
        reply = ""
        while engine.has_unfinished_requests():
            for output in engine.step():
                delta = output.outputs[0].delta_text
                reply += delta
                print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})
    return 0
