"""The Grafana dashboard: its PromQL names only metrics the services export, and its component renders."""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
from prometheus_client.metrics import MetricWrapperBase

from common import metrics
from tests.deploy.manifests import DEPLOY, K8S_VERSION, PART_OF, compose, kustomize_build, of_kind, render

COMPONENT_DIR = DEPLOY / "k8s" / "components" / "grafana-dashboard"
DASHBOARD = COMPONENT_DIR / "handoff.json"
# Labels Prometheus adds when it scrapes a pod; the dashboard may filter on these too.
TARGET_LABELS = {"namespace", "pod", "job", "instance"}
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}


def exported_series() -> dict[str, set[str]]:
    """Every series name common/metrics.py exposes -> its label names (a histogram's _bucket adds le)."""
    series = {}
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            for suffix in _SUFFIXES[metric._type]:
                series[metric._name + suffix] = set(metric._labelnames) | ({"le"} if suffix == "_bucket" else set())
    return series


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_MATCHERS = re.compile(r"\{([^}]*)\}")
_NAME = re.compile(r"(?<![\w$:.])([a-zA-Z_:][\w:]*)\s*(\()?")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan"}


def promql_problems(expr: str, series: dict[str, set[str]]) -> list[str]:
    """Metric names in `expr` that the services do not export, and label names none of them carry."""
    labels_used = set()
    for matchers in _MATCHERS.findall(expr):
        labels_used |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", _STRING.sub('""', matchers)))
    bare = _STRING.sub('""', expr)
    for grouping in _GROUPING.findall(bare):
        labels_used |= {label.strip() for label in grouping.split(",") if label.strip()}
    bare = _MATCHERS.sub("", _GROUPING.sub("", re.sub(r"\[[^\]]*\]", "", bare)))
    names = {name for name, call in _NAME.findall(bare) if not call and name not in _KEYWORDS}
    problems = [f"metric {name!r} is not exported by common/metrics.py" for name in sorted(names - set(series))]
    if not names:
        problems.append("no metric name found")
    known_labels = set().union(TARGET_LABELS, *(series.get(name, set()) for name in names))
    problems += [f"label {label!r} is on none of {sorted(names)}" for label in sorted(labels_used - known_labels)]
    return problems


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def expressions(dash: dict) -> list[str]:
    return [t["expr"] for p in panels(dash) for t in p["targets"]]


def test_every_expression_names_only_exported_metrics_and_their_labels():
    series = exported_series()
    assert "handoff_router_ttft_seconds_bucket" in series and "handoff_router_requests_total" in series
    problems = [f"{expr}: {problem}" for expr in expressions(dashboard()) for problem in promql_problems(expr, series)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("typo, found", [
    ("handoff_router_ttft_seconds_bucket", "handoff_router_ttft_second_bucket"),
    ("handoff_decode_kv_blocks_used{", "handoff_decode_kv_block_used{"),
    ("by (finish_reason)", "by (finish_reasons)"),
    ('namespace=~"$namespace"', 'namepsace=~"$namespace"'),
])
def test_the_check_catches_a_misspelt_metric_or_label(typo, found):
    exprs = [e for e in expressions(dashboard()) if typo in e]
    assert exprs, f"no expression contains {typo!r}"
    assert promql_problems(exprs[0].replace(typo, found, 1), exported_series())


def test_the_dashboard_covers_latency_traffic_queues_and_kv():
    exprs = expressions(dashboard())
    for histogram in ("handoff_router_ttft_seconds", "handoff_router_inter_token_seconds"):
        quantiles = {q for e in exprs if f"{histogram}_bucket" in e
                     for q in re.findall(r"histogram_quantile\(([0-9.]+)", e)}
        assert quantiles >= {"0.5", "0.9", "0.99"}, f"{histogram}: p50, p90 and p99, got {quantiles}"
    wanted = {
        "request rate by finish reason": r"sum by \(finish_reason\) \(rate\(handoff_router_requests_total",
        "queue depth": r"handoff_router_waiting_requests|handoff_prefill_queue_depth",
        "KV blocks used per decode worker": r"sum by \(worker\) \(handoff_decode_kv_blocks_used\{",
        "KV bytes/s by direction": r"sum by \(direction\) \(rate\(handoff_kv_transfer_bytes_total",
        "KV transfer failures by reason": r"sum by \(reason\) \(rate\(handoff_kv_transfer_failures_total",
        "retries by reason": r"sum by \(reason\) \(rate\(handoff_router_retries_total",
    }
    missing = [what for what, pattern in wanted.items() if not any(re.search(pattern, e) for e in exprs)]
    assert not missing, f"no panel for: {missing}"


def test_the_dashboard_is_well_formed():
    dash = dashboard()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    cells = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{p['title']} overlaps another panel"
        cells |= area
    for p in panels(dash):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert p["targets"] and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            assert "rate(" not in t["expr"] or "[$__rate_interval]" in t["expr"], \
                f"{p['title']}: rate() over $__rate_interval"
            assert 'namespace=~"$namespace"' in t["expr"], f"{p['title']}: filtered by the namespace variable"


def test_the_component_renders_with_the_cpu_overlay_and_validates():
    import kubernetes_validate

    with tempfile.TemporaryDirectory(prefix="handoff-kustomize-") as folder:
        objs = kustomize_build(compose(Path(folder), "cpu", ("grafana-dashboard",)))
    dashboards = [o for o in of_kind(objs, "ConfigMap") if o["metadata"].get("labels", {}).get("grafana_dashboard")]
    assert len(dashboards) == 1
    cm = dashboards[0]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # the sidecar's default label and value
    assert cm["metadata"]["labels"][PART_OF] == "handoff"
    assert (cm["metadata"]["name"], cm["metadata"]["namespace"]) == ("handoff-grafana-dashboard", "handoff")
    assert json.loads(cm["data"]["handoff.json"]) == dashboard()
    # The component adds the dashboard and changes nothing else.
    assert [o for o in objs if o is not cm] == render("cpu")
    errors = []
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
    assert not errors, "\n".join(errors)
