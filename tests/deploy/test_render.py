"""The overlays render with kubectl kustomize and validate against the Kubernetes schemas."""
from __future__ import annotations

import copy

import pytest

from tests.deploy.manifests import (
    COMPONENT,
    CUSTOM_KINDS,
    K8S_VERSION,
    OVERLAYS,
    OWN,
    POOLS,
    container,
    of_kind,
    one,
    render,
)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_with_every_pool(overlay):
    objs = render(overlay)
    for component in POOLS:
        one(objs, "Deployment", component)
        one(objs, "HorizontalPodAutoscaler", component)
        one(objs, "PodDisruptionBudget", component)
    if overlay == OWN:  # the external-redis component: no Redis object left behind, its ACL rules included
        left = [(o["kind"], o["metadata"]["name"]) for o in objs
                if o["metadata"]["labels"].get(COMPONENT) == "redis"
                or o["metadata"]["name"] in ("handoff-redis", "handoff-to-redis")
                or o["metadata"]["name"].startswith("handoff-redis-acl")]
        assert not left, left
    else:
        one(objs, "Deployment", "redis")
        one(objs, "Service", "redis")
    one(objs, "Service", "router")
    # The services' configuration first (tests read it as ConfigMap [0]), then the bundled Redis's ACL rules.
    assert [c["metadata"]["name"].rsplit("-", 1)[0] for c in of_kind(objs, "ConfigMap")
            if not c["metadata"].get("labels", {}).get("grafana_dashboard")] \
        == ["handoff-config"] + (["handoff-redis-acl"] if overlay != OWN else [])
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    assert namespaces == {"handoff"}, f"every object goes into the overlay's namespace, got {namespaces}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schema(overlay):
    import kubernetes_validate

    errors = []
    for obj in render(overlay):
        if (obj["apiVersion"], obj["kind"]) in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{obj['kind']}/{obj['metadata']['name']}: {'.'.join(map(str, exc.path))}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            errors.append(exc.message)
    assert not errors, "\n".join(errors)


def test_schema_validation_rejects_a_misspelt_field():
    """The validator is not a no-op: a typo in a probe (as in a hand edit) fails strict validation."""
    import kubernetes_validate

    deployment = copy.deepcopy(one(render("cpu"), "Deployment", "prefill"))
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    container(deployment)["readinessProbe"]["grpc"]["prot"] = 50061
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
