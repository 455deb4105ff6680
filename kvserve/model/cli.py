"""`kvserve info` (placeholder)."""
import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=False)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvserve info: not built yet")
