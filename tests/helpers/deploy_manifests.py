"""deploy/'s manifests as the cluster would get them: rendered by `kubectl kustomize`, parsed into dicts."""

from __future__ import annotations

import argparse
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBECTL = shutil.which("kubectl")
needs_kubectl = pytest.mark.skipif(KUBECTL is None, reason="kubectl (with kustomize) is not installed: the "
                                                            "manifests cannot be rendered here")


def overlay_names() -> list[str]:
    return sorted(p.parent.name for p in (DEPLOY / "overlays").glob("*/kustomization.yaml"))


def render(path: Path) -> list[dict]:
    result = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@dataclass(slots=True)
class Rendered:
    docs: list[dict]

    def one(self, kind: str, name: str) -> dict:
        found = [d for d in self.docs if d["kind"] == kind and d["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
        return found[0]

    def config_map_file(self, name_prefix: str, key: str) -> str:
        """A generated ConfigMap's file (its name carries a hash suffix)."""
        maps = [d for d in self.docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].startswith(name_prefix)]
        assert len(maps) == 1, [m["metadata"]["name"] for m in maps]
        return maps[0]["data"][key]

    def mounted_config(self, pod_spec: dict, container: dict, path: str) -> str:
        """The text a container reads at `path` from a mounted ConfigMap."""
        for mount in container["volumeMounts"]:
            prefix = mount["mountPath"].rstrip("/") + "/"
            if path.startswith(prefix):
                volume = next(v for v in pod_spec["volumes"] if v["name"] == mount["name"])
                name = volume["configMap"]["name"]
                data = next(d for d in self.docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == name)
                return data["data"][path[len(prefix):]]
        raise AssertionError(f"nothing is mounted at {path}")


def container(workload: dict, name: str) -> dict:
    return next(c for c in workload["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def parse_command_line(argv: list[str], config_text: str | None, tmp_path: Path) -> argparse.Namespace:
    """argv (`serve ...` or `gateway ...`) through kvserve's real parser, with --config read from config_text."""
    from kvserve.cli import build_parser
    from kvserve.server.config_file import apply_config_file

    args = build_parser().parse_args(argv)
    if args.config:
        config = tmp_path / Path(args.config).name
        config.write_text(config_text)
        args.config = str(config)
        if args.command == "serve":
            apply_config_file(args._serve_parser, args, args.config)
    return args


def dockerfile_entrypoint() -> list[str]:
    import json

    lines = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith("ENTRYPOINT ")]
    assert len(lines) == 1
    return json.loads(lines[0].removeprefix("ENTRYPOINT "))


def gib(quantity: str) -> float:
    """A Kubernetes memory or storage quantity in GiB (Gi, Mi, G, M suffixes)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "K": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    for suffix in sorted(units, key=len, reverse=True):
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * units[suffix] / 2**30
    return float(quantity) / 2**30
