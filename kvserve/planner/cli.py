"""`kvserve plan` (placeholder until the planner lands)."""
import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=False)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvserve plan: not built yet")
