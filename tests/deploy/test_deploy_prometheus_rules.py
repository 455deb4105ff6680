"""deploy/prometheus/ checked by Prometheus's own tool: `promtool check rules` and the unit tests in
deploy/prometheus/tests/ (`promtool test rules`); the Grafana dashboard's queries parse as PromQL."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml
from promql_names import DASHBOARD, DEPLOY, RULE_FILES, dashboard_expressions, metric_names, rules, \
    with_grafana_variables

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install "
                                                             "prometheus; .ci/run does it)")
RULE_TESTS = sorted((DEPLOY / "prometheus" / "tests").glob("*.test.yaml"))
SEED_ALERTS = {"KvservePrefixCacheHitRateLow", "KvserveKVCacheNearlyFull", "KvservePreemptionsRising",
               "KvserveWaitingQueueGrowing", "KvserveTTFTHigh", "KvserveEngineDown"}


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)


@needs_promtool
def test_promtool_accepts_the_rule_files():
    result = promtool("check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(RULE_FILES)


@needs_promtool
def test_promtool_unit_tests_of_the_alerts_pass():
    assert RULE_TESTS
    result = promtool("test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_the_issues_alerts_exist_each_with_a_severity_and_summary():
    alerts = {rule["alert"]: rule for rule in rules() if "alert" in rule}
    assert SEED_ALERTS <= set(alerts)
    for rule in alerts.values():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    unit_tests = "".join(path.read_text() for path in RULE_TESTS)
    assert all(f"alertname: {name}" in unit_tests for name in alerts)  # every alert has a promtool test


@needs_promtool
def test_every_dashboard_query_parses_as_promql(tmp_path):
    """Wrapped as recording rules, the dashboard's queries go through promtool's PromQL parser."""
    exprs = dashboard_expressions()
    assert len(exprs) > 20
    groups = [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": with_grafana_variables(e)}
                                              for i, e in enumerate(exprs)]}]
    rule_file = tmp_path / "dashboard-queries.yaml"
    rule_file.write_text(yaml.safe_dump({"groups": groups}))
    result = promtool("check", "rules", str(rule_file))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_dashboard_has_the_seeds_four_panels_and_the_rest():
    dashboard = json.loads(DASHBOARD.read_text())
    titles = [panel["title"] for panel in dashboard["panels"] if panel["type"] != "row"]
    for title in ("Device memory used", "KV pool free", "Prefix-cache hit rate", "Average prompt tokens per request",
                  "Time to first token", "Inter-token latency", "Requests running and waiting", "Preemptions",
                  "Tier hits"):
        assert title in titles
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"  # the user picks the Prometheus at import
    names = set().union(*(metric_names(e) for e in dashboard_expressions()))
    assert {"kvserve:device_memory_used_bytes", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
            "vllm:request_prompt_tokens_sum", "kvserve:kv_tier_hits_total"} <= names


def test_metric_names_are_read_out_of_promql():
    expr = ('histogram_quantile(0.95, sum by (le, model_name) (rate(vllm:x_bucket{model_name=~"a|b"}[5m])))'
            ' / on (instance) group_left () up{job="kvserve-engine"} > 2 or absent(foo)')
    assert metric_names(expr) == {"vllm:x_bucket", "up", "foo"}
