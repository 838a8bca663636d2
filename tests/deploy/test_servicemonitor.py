"""components/servicemonitor: the Prometheus Operator scrapes each pool's metrics port exactly once, at
the port and path the pods serve /metrics on (and the scrape annotations name)."""
from __future__ import annotations

import copy
import tempfile
from pathlib import Path

import pytest

from tests.deploy.manifests import (
    COMPONENT,
    OWN,
    PART_OF,
    compose,
    container,
    kustomize_build,
    named_port,
    of_kind,
    render,
    selector_matches,
    workloads,
)


def scrapes(objs: list[dict]) -> tuple[dict[str, list[str]], list[str]]:
    """What the Prometheus Operator would scrape, as it resolves a ServiceMonitor: the Services its
    selector picks in its namespace, each one's port of the endpoint's name, the pods behind them.
    Returns (pool -> the scrapes that reach its pods, problems)."""
    services = of_kind(objs, "Service")
    reached: dict[str, list[str]] = {w["metadata"]["labels"][COMPONENT]: [] for w in workloads(objs)}
    problems = []
    for monitor in of_kind(objs, "ServiceMonitor"):
        ns = monitor["metadata"]["namespace"]
        names = monitor["spec"].get("namespaceSelector", {}).get("matchNames", [ns])
        selected = [s for s in services if s["metadata"]["namespace"] in names
                    and selector_matches(monitor["spec"]["selector"], s["metadata"].get("labels", {}))]
        for endpoint in monitor["spec"]["endpoints"]:
            for service in selected:
                port = next((p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"]), None)
                if port is None:
                    continue  # the operator skips a Service without a port of that name
                where = f"{monitor['metadata']['name']} -> {service['metadata']['name']}:{endpoint['port']}"
                pods = [w for w in workloads(objs) if w["metadata"]["namespace"] == service["metadata"]["namespace"]
                        and selector_matches({"matchLabels": service["spec"]["selector"]},
                                             w["spec"]["template"]["metadata"]["labels"])]
                if not pods:
                    problems.append(f"{where}: no pods behind the Service")
                for w in pods:
                    ctr, annotations = container(w), w["spec"]["template"]["metadata"]["annotations"]
                    target = port.get("targetPort", port["port"])
                    served = {p["name"]: p["containerPort"] for p in ctr["ports"]}.get(target) \
                        if isinstance(target, str) else target
                    if served != named_port(ctr, "metrics"):
                        problems.append(f"{where}: reaches port {target!r} of {w['metadata']['name']}, "
                                        f"not its metrics port {named_port(ctr, 'metrics')}")
                    if endpoint.get("path", "/metrics") != annotations["prometheus.io/path"]:
                        problems.append(f"{where}: path {endpoint.get('path')} is not where /metrics is served")
                    reached[w["metadata"]["labels"][COMPONENT]].append(where)
    return reached, problems


def render_composed(overlay: str, components: tuple[str, ...]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="handoff-kustomize-") as folder:
        return kustomize_build(compose(Path(folder), overlay, components))


def test_own_overlay_scrapes_every_pool_once():
    objs = render(OWN)
    (monitor,) = of_kind(objs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"][PART_OF] == "handoff"
    assert monitor["metadata"]["labels"]["release"], "kube-prometheus-stack picks it by its release label"
    reached, problems = scrapes(objs)
    assert problems == []
    assert {pool: len(found) for pool, found in reached.items()} == {"router": 1, "prefill": 1, "decode": 1}, reached


@pytest.mark.parametrize("components, pools", [
    (("servicemonitor",), {"router", "prefill", "decode"}),
    (("tls", "servicemonitor"), {"router", "prefill", "decode"}),  # metrics stay plain HTTP with TLS on
    (("colocated", "servicemonitor"), {"router", "decode"}),
    (("external-redis", "servicemonitor"), {"router", "prefill", "decode"}),
])
def test_the_component_composes_with_the_cpu_overlay(components, pools):
    objs = render_composed("cpu", components)
    reached, problems = scrapes(objs)
    assert problems == []
    assert {pool for pool, found in reached.items() if found} == pools, reached
    assert all(len(found) == 1 for pool, found in reached.items() if pool in pools), f"scraped twice: {reached}"
    assert not reached.get("redis"), "Redis exports no handoff metrics"


def test_it_adds_the_monitor_and_the_routers_metrics_port_and_nothing_else():
    objs, cpu = render_composed("cpu", ("servicemonitor",)), render("cpu")
    assert [o for o in objs if o["kind"] != "ServiceMonitor"] != cpu, "the router's Service changed"
    router = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "handoff-router")
    metrics = next(p for p in router["spec"]["ports"] if p["name"] == "metrics")
    ctr = container(next(w for w in workloads(objs) if w["metadata"]["name"] == "handoff-router"))
    assert metrics["port"] == named_port(ctr, "metrics") and metrics["targetPort"] == "metrics"
    router["spec"]["ports"].remove(metrics)
    assert [o for o in objs if o["kind"] != "ServiceMonitor"] == cpu


def _monitor(objs):
    return of_kind(objs, "ServiceMonitor")[0]


@pytest.mark.parametrize("mutate, pool", [
    (lambda objs: _monitor(objs)["spec"]["endpoints"][0].update(port="metric"), "router"),
    (lambda objs: _monitor(objs)["spec"]["selector"]["matchExpressions"][0]["values"].remove("decode"), "decode"),
    (lambda objs: _monitor(objs)["spec"]["selector"]["matchLabels"].update({PART_OF: "handof"}), "prefill"),
    (lambda objs: next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "handoff-router")
     ["spec"]["ports"].pop(), "router"),
])
def test_the_check_catches_a_pool_left_unscraped(mutate, pool):
    objs = render(OWN)
    mutate(objs)
    reached, _ = scrapes(objs)
    assert not reached[pool], reached


def test_the_check_catches_a_wrong_port_or_path():
    objs = render(OWN)
    other = copy.deepcopy(objs)
    next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "handoff-decode")["spec"]["ports"][-1] \
        ["targetPort"] = "grpc"
    _monitor(other)["spec"]["endpoints"][0]["path"] = "/stats"
    assert any("not its metrics port" in p for p in scrapes(objs)[1]), scrapes(objs)
    assert any("/stats" in p for p in scrapes(other)[1]), scrapes(other)
