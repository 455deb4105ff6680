"""The PromQL expressions deploy/ ships (rules, dashboard) and the metric names they read.

Names are found by taking out of each expression what is not a metric: strings and label matchers, range and
subquery brackets, `by (...)`-style label lists, function calls' names, keywords and numbers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULE_FILES = sorted((DEPLOY / "prometheus").glob("*.yaml"))
DASHBOARD = DEPLOY / "grafana" / "kvserve-dashboard.json"
# Grafana's variables, given values Prometheus parses, for checking the dashboard's expressions.
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$model_name": ".*", "$instance": ".*"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan"}
_IDENTIFIER = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def rules() -> list[dict]:
    return [rule for path in RULE_FILES for group in yaml.safe_load(path.read_text())["groups"]
            for rule in group["rules"]]


def recorded_names() -> set[str]:
    return {rule["record"] for rule in rules() if "record" in rule}


def dashboard_expressions() -> list[str]:
    """Every panel's queries and every variable's query (label_values(METRIC, label) reads METRIC)."""
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("query")
        if isinstance(query, dict):
            exprs.append(re.sub(r"^label_values\((.*),\s*\w+\)$", r"\1", query["query"]))
    return exprs


def with_grafana_variables(expr: str) -> str:
    for variable, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(variable, value)
    return expr


def metric_names(expr: str) -> set[str]:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)  # label lists
    text = re.sub(r"\b[A-Za-z_]+\s*\(", "(", text)  # function and aggregation names
    text = re.sub(r"\b\d+(\.\d+)?(e[+-]?\d+)?\b", " ", text)  # numbers
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in KEYWORDS}
