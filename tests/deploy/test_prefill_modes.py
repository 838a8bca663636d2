"""Where prompts are prefilled is the ConfigMap's prefill-mode, read by the router; the colocated
component runs no prefill pool at all, and still renders and validates."""
from __future__ import annotations

import tempfile
from pathlib import Path

from tests.deploy.manifests import K8S_VERSION, compose, container, kustomize_build, of_kind, one, render


def env(ctr: dict) -> dict[str, dict]:
    return {e["name"]: e for e in ctr.get("env", [])}


def test_router_reads_the_prefill_mode_from_the_configmap():
    objs = render("cpu")
    data = of_kind(objs, "ConfigMap")[0]["data"]
    assert data["prefill-mode"] == "disaggregated" and int(data["remote-prefill-min-tokens"]) >= 1
    assert data["dtype"] == "auto", "CPU pods must not default to bf16 that their CPU may only emulate"
    router = env(container(one(objs, "Deployment", "router")))
    for var, key in (("HANDOFF_PREFILL_MODE", "prefill-mode"),
                     ("HANDOFF_REMOTE_PREFILL_MIN_TOKENS", "remote-prefill-min-tokens"),
                     ("HANDOFF_REMOTE_PREFILL_MAX_QUEUE_RATIO", "remote-prefill-max-queue-ratio")):
        assert router[var]["valueFrom"]["configMapKeyRef"]["key"] == key


def test_colocated_component_drops_the_prefill_pool():
    import kubernetes_validate

    with tempfile.TemporaryDirectory(prefix="handoff-kustomize-") as folder:
        objs = kustomize_build(compose(Path(folder), "cpu", ("colocated",)))
    assert of_kind(objs, "ConfigMap")[0]["data"]["prefill-mode"] == "colocated"
    names = {(o["kind"], o["metadata"]["name"]) for o in objs}
    assert not {n for n in names if n[1] == "handoff-prefill"}, names
    for kind in ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget"):
        one(objs, kind, "decode")
        one(objs, kind, "router")
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
