"""The one entry point: `kvserve <command>`.

Each command lives in the module that owns it and exposes `add_arguments(parser)` and `run(args) -> int`.
Modules are imported lazily so `kvserve plan` never imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvserve.server.cli", "OpenAI-compatible server with Prometheus metrics (vLLM's flags; demo model by default)"),
    "plan": ("kvserve.planner.cli", "capacity planner: KV bytes per token, memory budget, safe concurrency"),
    "generate": ("kvserve.engine.generate_cli", "generate completions for prompts (offline, on the demo model by default)"),
    "chat": ("kvserve.engine.chat_cli", "interactive chat in the terminal (on the demo model by default)"),
    "eval-kv": ("kvserve.engine.eval_kv_cli", "accuracy of each quantized KV dtype (perplexity, KL divergence, top-1) "
                                              "against the model's precision"),
    "bench": ("kvserve.bench.cli", "load-test an OpenAI-compatible server (TTFT, TPOT, throughput, cache hits); "
                                   "compare runs; run the benchmark suite"),
    "gateway": ("kvserve.gateway.cli", "OpenAI-compatible gateway: session/prefix routing, conversations, keys, limits"),
    "advise": ("kvserve.advise.cli", "why prefix caching misses in a request log (dynamic spans, system-prompt "
                                     "versions, template variants) and the hit rate each fix would reach"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM serving built around the KV cache.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
