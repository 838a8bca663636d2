"""The tracing component (deploy/k8s/components/tracing): with it every pool exports its spans to the
collector under its own service name, and may reach the collector's OTLP port and nothing more; without
it no pod sets an OTEL_ variable, so no service traces (common/tracing.py)."""
from __future__ import annotations

import tempfile
from pathlib import Path
from urllib.parse import urlparse

import pytest

from common import tracing
from tests.deploy.manifests import K8S_VERSION, POOLS, compose, container, kustomize_build, of_kind, one, render
from tests.deploy.test_network_policies import allowed
from tests.deploy.test_run_as_processes import Resolver

COLLECTOR = ("observability", {"app.kubernetes.io/name": "opentelemetry-collector"})


@pytest.fixture(scope="module")
def objs() -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="handoff-kustomize-") as folder:
        return kustomize_build(compose(Path(folder), "cpu", ("tracing",)))


def resolved_env(objs: list[dict], component: str) -> dict[str, str]:
    """The container's environment as the kubelet gives it ($(VAR) expanded)."""
    deployment = one(objs, "Deployment", component)
    return Resolver(objs).env(deployment, container(deployment))


def test_it_renders_and_validates(objs):
    import kubernetes_validate

    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    assert {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"} == {"handoff"}
    names = lambda found: {o["metadata"]["name"] for o in of_kind(found, "NetworkPolicy")}  # noqa: E731
    assert names(objs) == names(render("cpu")) | {"handoff-tracing-egress"}, "the base's policies are untouched"


def test_each_pool_exports_to_the_collector_under_its_own_name(objs):
    endpoint = of_kind(objs, "ConfigMap")[0]["data"]["otlp-endpoint"]
    for component in POOLS:
        env = resolved_env(objs, component)
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == endpoint, component
        assert env["OTEL_SERVICE_NAME"] == f"handoff-{component}"
        deployment = one(objs, "Deployment", component)["metadata"]["name"]
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == f"k8s.pod.name={deployment}-0,k8s.namespace.name=handoff"
        assert tracing.wanted_exporters(env) == ["otlp"], f"{component} would not trace"
    # Without the component nothing is set, and no service traces.
    for component in POOLS:
        env = resolved_env(render("cpu"), component)
        assert not [name for name in env if name.startswith("OTEL_")], component
        assert tracing.wanted_exporters(env) == []


def test_the_pools_reach_the_collectors_otlp_port_and_nothing_more(objs):
    policies = of_kind(objs, "NetworkPolicy")
    pods = {c: ("handoff", one(objs, "Deployment", c)["spec"]["template"]["metadata"]["labels"])
            for c in (*POOLS, "redis")}
    url = urlparse(of_kind(objs, "ConfigMap")[0]["data"]["otlp-endpoint"])
    # The endpoint names the Service in the namespace the policy opens, on the port it opens.
    assert url.scheme == "http" and url.hostname.split(".")[1] == COLLECTOR[0] and url.port == 4317
    for component in POOLS:
        assert allowed(policies, pods[component], COLLECTOR, 4317), component
        assert not allowed(policies, pods[component], COLLECTOR, 4318), f"{component}: only OTLP/gRPC"
        assert not allowed(policies, pods[component], ("observability", {"app": "other"}), 4317), component
        assert not allowed(policies, pods[component], ("elsewhere", COLLECTOR[1]), 4317), component
        assert not allowed(policies, pods[component], ("elsewhere", {"app": "anything"}), 443), component
        assert not allowed(of_kind(render("cpu"), "NetworkPolicy"), pods[component], COLLECTOR, 4317), \
            f"{component} reaches the collector without the component"
    assert not allowed(policies, pods["redis"], COLLECTOR, 4317), "Redis sends no spans"
