"""deploy/Dockerfile, checked without docker: what it copies is in the build context, what it installs matches
the project's pins, and its entrypoint is a kvserve command that starts the demo model on the manifests' port."""

from __future__ import annotations

import re
import tomllib

from deploy_manifests import DEPLOY, REPO, dockerfile_entrypoint

from kvserve.cli import build_parser
from kvserve.model.demo import INSTALL_HINT

DOCKERFILE = (DEPLOY / "Dockerfile").read_text()


def instructions(name: str) -> list[str]:
    """The arguments of every `NAME ...` instruction, continuation lines joined."""
    joined = re.sub(r"\\\n\s*", " ", DOCKERFILE)
    return [line[len(name) + 1:].strip() for line in joined.splitlines() if line.startswith(name + " ")]


def test_everything_copied_is_in_the_build_context_and_not_ignored():
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copies = instructions("COPY")
    assert copies
    for copy in copies:
        *sources, _ = copy.split()
        for source in sources:
            assert (REPO / source).exists(), source
            assert source in allowed, f"{source} is excluded by Dockerfile.dockerignore"


def test_the_image_installs_the_pinned_torch_and_the_demo_model():
    pins = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(p for p in pins if p.startswith("torch"))
    runs = " ".join(instructions("RUN"))
    assert f"pip install --index-url ${{TORCH_INDEX_URL}} {torch_pin}" in runs
    assert INSTALL_HINT in runs  # the demo model kvserve serve falls back to
    assert instructions("ARG")[0].startswith("BASE_IMAGE=") and instructions("FROM") == ["${BASE_IMAGE}"]


def test_entrypoint_is_kvserve_serve_on_the_exposed_port():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    entrypoint = dockerfile_entrypoint()
    assert entrypoint == ["kvserve", "serve"] and entrypoint[0] in scripts
    args = build_parser().parse_args(entrypoint[1:])  # no flags: the demo model, every interface
    assert args.model is None and args.host == "0.0.0.0"
    assert instructions("EXPOSE") == [str(args.port)]
    assert instructions("USER") == ["10001"]  # the manifests' runAsUser: the disk tier's volume is writable
