import os
import sys
from pathlib import Path

import pytest
import torch

# The Triton kernels' tests run them on CPU tensors through Triton's interpreter, which must be chosen before
# triton is first imported (its own library functions are defined then). With a GPU they compile instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from tiny_models import save_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """Returns a function kind -> (folder, transformers model), building each checkpoint once per session."""
    built: dict[str, tuple[Path, object]] = {}

    def get(kind: str):
        if kind not in built:
            folder = tmp_path_factory.mktemp(f"tiny-{kind}")
            built[kind] = (folder, save_model(kind, folder))
        return built[kind]

    return get


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    """A real kvserve server on 127.0.0.1 serving the tiny llama, one per test module (a module may override)."""
    from server_harness import start_server

    folder, _ = tiny_model_dir("llama")
    running = start_server(folder)
    yield running
    running.stop()
