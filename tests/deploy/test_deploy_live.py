"""deploy/ against live `kvserve serve`s: the rules in a real Prometheus scraping them, every metric the rules and
the Grafana dashboard query on their /metrics, and the gateway pod's wait for its engines.

Two engines on the tiny test model, told apart by --served-model-name: one gets prompts that share nothing
(random token ids), the other prompts that share a 192-token prefix. With the rules' windows and `for:`
shortened to seconds (the expressions unchanged), the low-hit-rate alert fires for the first and never for
the second."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import httpx
import pytest
import yaml
from deploy_manifests import DEPLOY, Rendered, needs_kubectl, render
from deploy_server import running_kvserve
from ports import free_port
from prometheus_harness import PROMETHEUS, running_prometheus
from promql_names import dashboard_expressions, metric_names, recorded_names, rules

UNIQUE, SHARED = "unique-prompts", "shared-prompts"
JOB = "kvserve-engine"  # the job the alerts select
HIT_RATE = "kvserve:prefix_cache_hit_rate:ratio_rate15m"
# Names Prometheus makes itself, not any target's /metrics.
PROMETHEUS_SERIES = {"up", "ALERTS", "ALERTS_FOR_STATE"}
# Older vLLM names, each allowed only in an expression that also reads kvserve's (and current vLLM's) name.
VLLM_ONLY = {"vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
             "vllm:gpu_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
             "vllm:gpu_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
             "vllm:time_per_output_token_seconds_bucket": "vllm:inter_token_latency_seconds_bucket"}
SHARED_PREFIX = [5 + (i * 7) % 370 for i in range(192)]

pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (Debian: apt-get install "
                                                           "prometheus; .ci/run does it)")


def engine_args(folder, name: str) -> list[str]:
    # A host tier so that the kvserve:kv_tier_* series exist; a small pool so two engines fit in memory.
    return ["--model", str(folder), "--device", "cpu", "--dtype", "float32", "--max-model-len", "512",
            "--num-gpu-blocks-override", "256", "--kv-offloading-size", "0.01", "--served-model-name", name]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    with running_kvserve(engine_args(folder, UNIQUE)) as unique, running_kvserve(engine_args(folder, SHARED)) as shared:
        yield {UNIQUE: unique, SHARED: shared}


def complete(url: str, prompt: list[int]) -> None:
    response = httpx.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=60)
    assert response.status_code == 200, response.text


def unique_prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(5, 380) for _ in range(64)]


def shared_prompt(rng: random.Random) -> list[int]:
    return SHARED_PREFIX + [rng.randrange(5, 380) for _ in range(8)]


def drive(url: str, make_prompt, stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    while not stop.is_set():
        complete(url, make_prompt(rng))


def exported_names(url: str) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {sample.name for family in text_string_to_metric_families(text) for sample in family.samples}


def test_every_metric_the_rules_and_the_dashboard_query_is_exported(engines):
    complete(engines[SHARED], SHARED_PREFIX)  # histograms and tier series get their first observations
    exported = exported_names(engines[SHARED])
    recorded = recorded_names()
    exprs = [rule["expr"] for rule in rules()] + dashboard_expressions()
    for expr in exprs:
        names = metric_names(expr)
        assert names, expr
        for name in names - recorded - PROMETHEUS_SERIES:
            if name in VLLM_ONLY:
                assert VLLM_ONLY[name] in names, f"{name} without kvserve's {VLLM_ONLY[name]} in: {expr}"
            else:
                assert name in exported, f"{name} (in {expr!r}) is not on kvserve's /metrics"


def test_low_hit_rate_alert_fires_without_a_shared_prefix_and_not_with_one(engines, tmp_path):
    complete(engines[SHARED], SHARED_PREFIX)  # the prefix is cached before Prometheus's first scrape
    targets = [url.removeprefix("http://") for url in engines.values()]
    stop = threading.Event()
    load = [threading.Thread(target=drive, args=(engines[UNIQUE], unique_prompt, stop, 1), daemon=True),
            threading.Thread(target=drive, args=(engines[SHARED], shared_prompt, stop, 2), daemon=True)]
    with running_prometheus(JOB, targets, tmp_path) as prometheus:
        for thread in load:
            thread.start()
        try:
            firing = wait_for_alert(prometheus, "KvservePrefixCacheHitRateLow", UNIQUE, timeout_s=90)
            rates = {r["metric"]["model_name"]: float(r["value"][1]) for r in prometheus.query(HIT_RATE)}
            # The shared engine has been scraped and evaluated as long as the unique one, never below 40%.
            history = prometheus.query(f'min_over_time({HIT_RATE}{{model_name="{SHARED}"}}[5m])')
            # ALERTS has a sample for every evaluation an alert was pending or firing.
            never_alerted = prometheus.query(f'count_over_time(ALERTS{{alertname="KvservePrefixCacheHitRateLow",'
                                             f'model_name="{SHARED}"}}[5m])')
            unique_alerted = prometheus.query(f'count_over_time(ALERTS{{alertname="KvservePrefixCacheHitRateLow",'
                                              f'model_name="{UNIQUE}"}}[5m])')
        finally:
            stop.set()
            for thread in load:
                thread.join(timeout=60)
    assert firing["labels"]["severity"] == "warning" and firing["labels"]["job"] == JOB
    assert "below 40%" in firing["annotations"]["summary"]
    assert rates[UNIQUE] < 0.4 < rates[SHARED]
    assert float(history[0]["value"][1]) > 0.4
    assert never_alerted == [] and unique_alerted  # the query sees alerts: the shared engine's has none


def wait_for_alert(prometheus, name: str, model_name: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for alert in prometheus.alerts():
            labels = alert["labels"]
            if labels["alertname"] == name and labels.get("model_name") == model_name and alert["state"] == "firing":
                return alert
        time.sleep(0.5)
    raise AssertionError(f"{name} for {model_name} did not fire in {timeout_s} s: {prometheus.alerts()}")


@needs_kubectl
def test_gateway_pod_waits_until_every_engine_answers_health(engines, tmp_path):
    """The gateway's init container, run for real on the backends its config lists: done once all are healthy,
    still waiting while one is not (the gateway itself would refuse to start then)."""
    gateway = Rendered(render(DEPLOY / "overlays" / "cpu")).one("Deployment", "kvserve-gateway")
    init = gateway["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][:2] == ["python", "-c"]
    script = init["command"][2]

    def wait_for(backends: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        config = tmp_path / "gateway.yaml"
        config.write_text(yaml.safe_dump({"backend": backends}))
        return subprocess.run([sys.executable, "-c", script.replace("/etc/kvserve/gateway.yaml", str(config))],
                              capture_output=True, text=True, timeout=timeout_s)

    assert wait_for(list(engines.values()), 60).returncode == 0
    with pytest.raises(subprocess.TimeoutExpired):
        wait_for([*engines.values(), f"http://127.0.0.1:{free_port()}"], 3)
