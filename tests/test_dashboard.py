"""deploy/grafana/card-serving.json: a Grafana dashboard that loads (a standard dashboard model:
a Prometheus datasource variable, panels on the 24-column grid, none overlapping) and whose every
PromQL query names only metrics the services export, with label names those metrics carry (a
renamed metric or label fails here, not as an empty panel). The check itself is tested on made-up
metrics and labels (it can fail)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.metric_names import exported_metrics, metric_labels

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "card-serving.json"

# PromQL's words that are not metric names: the functions, aggregations and keywords queries use
PROMQL = frozenset({
    "sum", "min", "max", "avg", "count", "topk", "bottomk", "quantile", "stddev", "rate", "irate",
    "increase", "delta", "deriv", "histogram_quantile", "scalar", "vector", "abs", "clamp_min",
    "clamp_max", "time", "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "label_values",
})
PANEL_TYPES = frozenset({"row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"})
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
SELECTOR = re.compile(r"([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")


def problems(expr: str, exported: set[str], labels: dict[str, frozenset[str]]) -> list[str]:
    """What in one PromQL expression names nothing the services export: a metric that is not
    exported, a label matched on a metric that lacks it, a grouping label no metric of the
    expression carries; an expression with no metric at all."""
    # a variable's label_values(metric, label): the label must be the metric's
    text = re.sub(r"label_values\(\s*([\w:]+)\s*,\s*(\w+)\s*\)", r'\1{\2=""}', expr)
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)  # string literals: label values, regexes
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors ([5m], [$__rate_interval])
    text = re.sub(r"\$\{?\w+\}?", "", text)  # Grafana's variables
    found = []
    for metric, matchers in SELECTOR.findall(text):
        for label in MATCHER.findall(matchers):
            if metric in labels and label not in labels[metric]:
                found.append(f"{metric} has no label {label!r}")
    grouping = [g for kind, g in GROUPING.findall(text) if kind in ("by", "without")]
    bare = GROUPING.sub(" ", re.sub(r"\{[^}]*\}", "", text))
    names = set(re.findall(r"(?<![\w.])[a-zA-Z_:][\w:]*", bare)) - PROMQL
    found += [f"{name} is not exported" for name in sorted(names - exported)]
    carried = frozenset().union(*(labels.get(n, frozenset()) for n in names))
    for group in grouping:
        found += [f"no metric carries {label!r}" for label in re.findall(r"\w+", group)
                  if label not in carried]
    if not names:
        found.append("no metric")
    return found


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dashboard: dict) -> list[dict]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out += panel.get("panels", [])  # a collapsed row holds its panels
    return out


def _queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and query variable."""
    queries = [(f"panel {p['title']!r} {t['refId']}", t["expr"]) for p in _panels(dashboard)
               for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            queries.append((f"variable {var['name']!r}", query))
    return queries


def test_every_query_names_exported_metrics_and_their_labels(dashboard):
    exported, labels = exported_metrics(), metric_labels()
    queries = _queries(dashboard)
    assert len(queries) > 30
    bad = {where: found for where, expr in queries if (found := problems(expr, exported, labels))}
    assert not bad, bad
    # what the dashboard is for: vLLM's request series, acceptance, the cache, its pools, Redis
    used = {n for _, expr in queries for n in re.findall(r"card_\w+", expr)}
    want = {"card_target_time_to_first_token_seconds_bucket",
            "card_target_inter_token_latency_seconds_bucket",
            "card_target_e2e_request_latency_seconds_bucket",
            "card_target_request_queue_time_seconds_bucket", "card_target_kv_cache_usage_perc",
            "card_target_num_requests_running", "card_target_num_requests_waiting",
            "card_target_generation_tokens_total", "card_target_prompt_tokens_total",
            "card_target_spec_decode_num_drafts_total", "card_target_spec_decode_num_draft_tokens_total",
            "card_target_spec_decode_num_accepted_tokens_total",
            "card_target_spec_decode_num_accepted_tokens_per_pos_total", "card_cache_outcomes_total",
            "card_cache_pool_accepted_tokens_total", "card_cache_pool_workers", "card_cache_redis_up",
            "card_target_http_requests_total"}
    assert want <= used, want - used


@pytest.mark.parametrize("expr, why", [
    ("sum(rate(card_target_made_up_total[5m]))", "card_target_made_up_total is not exported"),
    ("histogram_quantile(0.9, sum by (le) (rate(card_target_time_to_first_token_seconds[5m])))",
     "card_target_time_to_first_token_seconds is not exported"),  # the histogram has only _bucket etc.
    ('sum(card_cache_pool_workers{model_name="m"})', "card_cache_pool_workers has no label 'model_name'"),
    ("sum by (pool) (rate(card_target_generation_tokens_total[5m]))", "no metric carries 'pool'"),
    ("vllm:num_requests_running", "vllm:num_requests_running is not exported"),
    ("1 + 2", "no metric"),
])
def test_the_check_catches_what_is_not_exported(expr, why):
    assert why in problems(expr, exported_metrics(), metric_labels())


def test_the_dashboard_is_a_loadable_grafana_model(dashboard):
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables["datasource"]
    assert source["type"] == "datasource" and source["query"] == "prometheus"
    panels = _panels(dashboard)
    assert len({p["id"] for p in panels}) == len(panels)
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        assert panel["type"] in PANEL_TYPES, panel["title"]
        grid = panel["gridPos"]
        assert grid["w"] > 0 and grid["h"] > 0, panel["title"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):  # no two panels share a cell
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, (panel["title"], cells[x, y])
                cells[x, y] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(set(refs)) == len(refs) and all(t["expr"] for t in panel["targets"])
    # every query that filters by model uses the variable, and the variable lists the served names
    assert "card_target_num_requests_running" in variables["model_name"]["definition"]
