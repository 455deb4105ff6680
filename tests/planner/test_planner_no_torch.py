"""The planner is pure Python: importing and running it never imports torch."""

import subprocess
import sys
from pathlib import Path

import kvserve.planner

PLANNER_DIR = Path(kvserve.planner.__file__).parent


def test_planner_modules_do_not_import_torch():
    code = (
        "import sys, pkgutil, importlib, kvserve.planner as p\n"
        "for m in pkgutil.iter_modules(p.__path__): importlib.import_module('kvserve.planner.' + m.name)\n"
        "from kvserve.planner.cli import run, add_arguments\n"
        "import argparse; parser = argparse.ArgumentParser(); add_arguments(parser)\n"
        "run(parser.parse_args(['--model', 'Qwen/Qwen2.5-14B-Instruct', '--gpu', 'A100-80GB', '--json']))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_no_torch_import_statement_in_the_package():
    for path in PLANNER_DIR.glob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path
