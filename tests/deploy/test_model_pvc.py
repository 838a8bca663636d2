"""components/model-pvc: every pod that loads the model mounts the claim read-only, and `model` names a
path on it; loader.yaml fills that claim at the path the component reads."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest
import yaml

from tests.deploy.manifests import (
    COMPONENT,
    DEPLOY,
    K8S_VERSION,
    MODELS_CLAIM,
    MODELS_PATH,
    OWN,
    compose,
    container,
    kustomize_build,
    of_kind,
    pod_spec,
    render,
    split_image,
    workloads,
)

LOADER = DEPLOY / "k8s" / "components" / "model-pvc" / "loader.yaml"


def loads_model(ctr: dict) -> bool:
    """Whether the container is given the ConfigMap's `model` (router: tokenizer and shape; workers: weights)."""
    return any(e.get("valueFrom", {}).get("configMapKeyRef", {}).get("key") == "model" for e in ctr.get("env", []))


def model_mount_problems(objs: list[dict]) -> list[str]:
    """Why some pod that loads the model would not find it on the claim, read-only."""
    model = of_kind(objs, "ConfigMap")[0]["data"]["model"]
    problems = [] if model.startswith(MODELS_PATH + "/") else [f"model={model!r} is not under {MODELS_PATH}/"]
    for w in workloads(objs):
        spec, ctr = pod_spec(w), container(w)
        if not loads_model(ctr):
            continue
        name = w["metadata"]["name"]
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        mounts = [m for m in ctr.get("volumeMounts", []) if m["mountPath"].rstrip("/") == MODELS_PATH]
        if not mounts:
            problems.append(f"{name}: nothing mounted at {MODELS_PATH}")
            continue
        claim = volumes[mounts[0]["name"]].get("persistentVolumeClaim") or {}
        if claim.get("claimName") != MODELS_CLAIM:
            problems.append(f"{name}: {MODELS_PATH} is not the claim {MODELS_CLAIM} ({volumes[mounts[0]['name']]})")
        if mounts[0].get("readOnly") is not True or claim.get("readOnly") is not True:
            problems.append(f"{name}: mount the model claim read-only (volumeMount and claim)")
    return problems


def model_loaders(objs: list[dict]) -> set[str]:
    return {w["metadata"]["labels"][COMPONENT] for w in workloads(objs) if loads_model(container(w))}


def render_composed(overlay: str, components: tuple[str, ...]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="handoff-kustomize-") as folder:
        return kustomize_build(compose(Path(folder), overlay, components))


def test_own_overlay_mounts_the_claim_wherever_the_model_is_loaded():
    objs = render(OWN)
    assert model_loaders(objs) == {"router", "prefill", "decode"}, "the router reads the tokenizer from the file"
    assert model_mount_problems(objs) == []
    # The overlay's file wins over the component's default (a patch, run after the components).
    assert of_kind(objs, "ConfigMap")[0]["data"]["model"] == f"{MODELS_PATH}/my-model.gguf"


@pytest.mark.parametrize("components, loaders", [
    (("model-pvc",), {"router", "prefill", "decode"}),
    (("tls", "model-pvc"), {"router", "prefill", "decode"}),
    (("colocated", "model-pvc"), {"router", "decode"}),  # either order: a patch on a name pattern
    (("model-pvc", "colocated"), {"router", "decode"}),
])
def test_the_component_composes_with_the_cpu_overlay(components, loaders):
    objs = render_composed("cpu", components)
    assert model_loaders(objs) == loaders
    assert model_mount_problems(objs) == []
    assert of_kind(objs, "ConfigMap")[0]["data"]["model"] == f"{MODELS_PATH}/model.gguf"


def _drop_mount(objs: list[dict], component: str) -> None:
    ctr = container(next(w for w in workloads(objs) if w["metadata"]["labels"][COMPONENT] == component))
    ctr["volumeMounts"] = [m for m in ctr["volumeMounts"] if m["mountPath"] != MODELS_PATH]


def _set_on_models(objs: list[dict], key: str, value) -> None:
    for w in workloads(objs):
        for v in pod_spec(w).get("volumes", []):
            if v["name"] == "models":
                v["persistentVolumeClaim"][key] = value


@pytest.mark.parametrize("mutate, problem", [
    (lambda objs: _drop_mount(objs, "router"), "handoff-router: nothing mounted"),
    (lambda objs: _drop_mount(objs, "decode"), "handoff-decode: nothing mounted"),
    (lambda objs: _set_on_models(objs, "readOnly", False), "read-only"),
    (lambda objs: _set_on_models(objs, "claimName", "models"), "is not the claim"),
    (lambda objs: of_kind(objs, "ConfigMap")[0]["data"].update(model="/opt/my-model.gguf"), "not under"),
])
def test_the_check_catches_a_pod_without_the_model(mutate, problem):
    objs = render(OWN)
    mutate(objs)
    assert any(problem in p for p in model_mount_problems(objs)), model_mount_problems(objs)


def test_the_loader_fills_the_claim_where_the_component_reads():
    """loader.yaml: the claim the component mounts, a pod that mounts it writable at the same path and
    passes the restricted Pod Security Standard, and a recipe that copies to the component's default."""
    import kubernetes_validate

    objs = [doc for doc in yaml.safe_load_all(LOADER.read_text()) if doc]
    for obj in objs:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    (claim,) = [o for o in objs if o["kind"] == "PersistentVolumeClaim"]
    (pod,) = [o for o in objs if o["kind"] == "Pod"]
    assert claim["metadata"]["name"] == MODELS_CLAIM
    namespaces = {o["metadata"]["namespace"] for o in render(OWN) if o["kind"] != "Namespace"}
    assert {claim["metadata"]["namespace"], pod["metadata"]["namespace"]} == namespaces, "where the pods look"
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (ctr,) = pod["spec"]["containers"]
    mount = next(m for m in ctr["volumeMounts"] if m["mountPath"] == MODELS_PATH)
    assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] == MODELS_CLAIM
    assert not mount.get("readOnly"), "the loader writes the model"
    # restricted: non-root, no privilege escalation, no capabilities, RuntimeDefault seccomp
    spec, sc = pod["spec"], ctr["securityContext"]
    assert spec["securityContext"]["runAsNonRoot"] and sc["runAsNonRoot"] and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["readOnlyRootFilesystem"] is True
    assert spec["securityContext"]["seccompProfile"]["type"] == sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    # what it writes, the services (uid/gid 10001) read
    services = workloads(render(OWN))
    assert {pod_spec(w)["securityContext"]["fsGroup"] for w in services} == {spec["securityContext"]["fsGroup"]}
    _, tag = split_image(ctr["image"])
    assert tag and tag != "latest", ctr["image"]
    copies = re.findall(r"kubectl -n \S+ cp \S+ " + re.escape(pod["metadata"]["name"]) + r":(\S+)",
                        LOADER.read_text())
    default_model = of_kind(render_composed("cpu", ("model-pvc",)), "ConfigMap")[0]["data"]["model"]
    assert copies == [default_model], f"the recipe copies to {copies}, the component reads {default_model}"
