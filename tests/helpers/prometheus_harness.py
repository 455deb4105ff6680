"""A real Prometheus (Debian's `prometheus`) on a free port of 127.0.0.1, scraping given targets every second
and evaluating a shortened copy of deploy/prometheus's rules; always stopped."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import yaml
from deploy_server import stop, wait_ready
from ports import free_port
from promql_names import RULE_FILES

PROMETHEUS = shutil.which("prometheus")


def shortened_rules(text: str, window: str, hold: str) -> str:
    """The rules with every range `[Nm]` as `[window]` and every `for: Nm` as `for: hold`: the expressions are
    otherwise the shipped ones, so what fires here in seconds fires in production in minutes."""
    text = re.sub(r"\[\d+m\]", f"[{window}]", text)
    return re.sub(r"(?m)^(\s*for:) \d+m$", rf"\1 {hold}", text)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10).json()
        assert body["status"] == "success", body
        return body["data"]["result"]

    def alerts(self) -> list[dict]:
        return httpx.get(f"{self.url}/api/v1/alerts", timeout=10).json()["data"]["alerts"]


@contextlib.contextmanager
def running_prometheus(job: str, targets: list[str], workdir: Path, window: str = "20s",
                       hold: str = "5s") -> Iterator[Prometheus]:
    rule_paths = []
    for path in RULE_FILES:
        copy = workdir / path.name
        copy.write_text(shortened_rules(path.read_text(), window, hold))
        rule_paths.append(str(copy))
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"}, "rule_files": rule_paths,
              "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets}]}]}
    config_path = workdir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    port = free_port()
    log = open(workdir / "prometheus.log", "w")
    process = subprocess.Popen(
        [PROMETHEUS, f"--config.file={config_path}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/-/ready", process, str(workdir / "prometheus.log"), timeout_s=60)
        yield Prometheus(url)
    finally:
        stop(process)
        log.close()
