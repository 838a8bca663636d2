"""deploy/: the image recipe and the Kubernetes manifests — rendered, validated, scanned, and run.

Everything here works offline except the first policy scan on a new machine, which installs
checkov into its own virtual environment (in the user's cache, ~/.cache/handoff/checkov-<version>-py<X.Y>,
so that a fresh clone on the same machine does not install it again) from the package
index: checkov pins networkx<2.7 and packaging 23, which would downgrade what torch and
transformers use in the project's venv.

The last tests (marked `cluster`) start the three services exactly as the cpu overlay's
Deployments describe them — same command, args and environment, with ConfigMap, Secret and
downward-API references resolved, Secret volumes mounted and `$(VAR)` expanded as the kubelet
does — against a real local Redis, and send a Generate through the router and a completion
through its HTTP port: once as the cpu overlay stands, once with the TLS and API-key components
(deploy/k8s/components) added, once with the model from a claim and Redis reached over TLS
(model-pvc, external-redis).

This module holds the shared parts (rendering, lookups); tests/deploy/test_*.py hold one subject each.
"""
from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


DEPLOY = ROOT / "deploy"


DOCKERFILE = DEPLOY / "Dockerfile"


DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"  # BuildKit's per-Dockerfile ignore file


# An overlay, or an overlay plus components (rendered from a kustomization written to a temporary
# folder): the components must compose with the kind overlay too, not only with gpu.
COMPOSED = {"cpu+tls": ("cpu", ("tls", "api-keys"))}


# Your own model, Redis and scraping: the model-pvc, external-redis and servicemonitor components, as a
# user copies the overlay (docs/deploy.md, "Deploy your own").
OWN = "example-own"


OVERLAYS = ("cpu", "gpu", OWN, *COMPOSED)


# Kinds from CustomResourceDefinitions, which the Kubernetes schemas do not cover; each has its own
# tests (test_servicemonitor.py) instead.
CUSTOM_KINDS = {("monitoring.coreos.com/v1", "ServiceMonitor")}


MODELS_CLAIM, MODELS_PATH = "handoff-models", "/models"  # components/model-pvc


REDIS_TLS_SECRET = "handoff-redis-tls"  # components/external-redis: the CA of the operator's Redis


def redis_secret(role: str) -> str:
    """The Secret holding the password (key `password`) of `role`'s Redis ACL user, bundled Redis or not."""
    return f"handoff-redis-{role}"


TLS_SECRET, API_KEYS_SECRET = "handoff-tls", "handoff-api-keys"  # TLS: handoff-tls-<role>, handoff-tls-public


TLS_FILES = {"HANDOFF_TLS_CERT": "tls.crt", "HANDOFF_TLS_KEY": "tls.key", "HANDOFF_TLS_CA": "ca.crt"}


K8S_VERSION = "1.30.0"  # oldest Kubernetes the manifests must work on (native gRPC probes are GA in 1.27)


POOLS = ("router", "prefill", "decode")


WORKERS = ("prefill", "decode")


PART_OF = "app.kubernetes.io/part-of"


COMPONENT = "app.kubernetes.io/component"


NAME = "app.kubernetes.io/name"


# The Pods metric each pool's autoscaler follows; the services must export these names.
POOL_METRICS = {"prefill": "handoff_prefill_queue_depth", "decode": "handoff_decode_kv_blocks_used_ratio"}


CHECKOV_VERSION = "3.3.30"


CHECKOV_VENV = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "handoff"
                / f"checkov-{CHECKOV_VERSION}-py{sys.version_info[0]}.{sys.version_info[1]}")


# Checks skipped for every rendered manifest, and why; everything else checkov has must pass.
CHECKOV_SKIPS = {
    # Tags are exact versions (handoff:<version>, redis:7.2.5-alpine); a digest is known only
    # once an image is pushed, and a release pins it with `kustomize edit set image name@sha256:`.
    "CKV_K8S_43": "Image should use digest",
    # IfNotPresent with immutable version tags pulls each version once; Always would make every
    # restart depend on the registry, and breaks images loaded into kind with `kind load`.
    "CKV_K8S_15": "Image Pull Policy should be Always",
    # The service contract reads REDIS_PASSWORD from the environment (as redis-server's
    # requirepass does via args); the Secret is never written into the pod spec itself.
    "CKV_K8S_35": "Prefer using secrets as files over secrets as environment variables",
    # Kubernetes ignores a Dockerfile HEALTHCHECK; the pods use native gRPC probes on the
    # standard health service, which would need an extra probe binary inside the image.
    "CKV_DOCKER_2": "Ensure that HEALTHCHECK instructions have been added to container images",
}


_rendered: dict[str, list[dict]] = {}


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is not on PATH; the deploy tests render the overlays with `kubectl kustomize`. "
                    "Install kubectl v1.27 or newer (it bundles kustomize v5), e.g. `apt-get install kubectl` "
                    "from the Kubernetes apt repository, then re-run.")
    return found


def kustomize_build(path: Path) -> list[dict]:
    proc = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize {path.relative_to(ROOT)} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def compose(folder: Path, overlay: str, components: tuple[str, ...],
            secrets: dict[str, dict[str, bytes]] | None = None) -> Path:
    """A kustomization in `folder`: the overlay, the components and Secrets generated from files."""
    k8s = DEPLOY / "k8s"
    kustomization = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                     "resources": [os.path.relpath(k8s / "overlays" / overlay, folder)],
                     "components": [os.path.relpath(k8s / "components" / c, folder) for c in components]}
    generators = []
    for name, files in (secrets or {}).items():
        (folder / name).mkdir()
        for key, data in files.items():
            (folder / name / key).write_bytes(data)
        generators.append({"name": name, "namespace": "handoff", "options": {"labels": {PART_OF: "handoff"}},
                           "files": [f"{key}={name}/{key}" for key in files]})
    if generators:
        kustomization["secretGenerator"] = generators
    (folder / "kustomization.yaml").write_text(yaml.safe_dump(kustomization, sort_keys=False))
    return folder


def render(overlay: str) -> list[dict]:
    """The overlay's objects (a fresh copy each call: tests may edit them)."""
    if overlay not in _rendered:
        if overlay in COMPOSED:
            with tempfile.TemporaryDirectory(prefix="handoff-kustomize-") as folder:
                _rendered[overlay] = kustomize_build(compose(Path(folder), *COMPOSED[overlay]))
        else:
            _rendered[overlay] = kustomize_build(DEPLOY / "k8s" / "overlays" / overlay)
    return copy.deepcopy(_rendered[overlay])


def bundled_redis(objs: list[dict]) -> bool:
    """Whether the rendered objects run their own Redis (not the external-redis component)."""
    return any(o["kind"] == "Deployment" and o["metadata"]["labels"].get(COMPONENT) == "redis" for o in objs)


def tls_on(ctr: dict) -> bool:
    """Whether the container is configured for TLS (the tls component was applied)."""
    return any(e["name"] == "HANDOFF_TLS_CERT" for e in ctr.get("env", []))


def of_kind(objs: list[dict], kind: str) -> list[dict]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict], kind: str, component: str) -> dict:
    found = [o for o in of_kind(objs, kind) if o["metadata"].get("labels", {}).get(COMPONENT) == component]
    assert len(found) == 1, f"expected one {kind} labelled {COMPONENT}={component}, found {len(found)}"
    return found[0]


def split_image(image: str) -> tuple[str, str]:
    """(name, tag) of an image reference; tag "" when there is none (a registry port is no tag)."""
    ref = image.partition("@")[0]
    name, sep, tag = ref.rpartition(":")
    return (name, tag) if sep and "/" not in tag else (ref, "")


def pod_spec(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]


def container(deployment: dict) -> dict:
    containers = pod_spec(deployment)["containers"]
    assert len(containers) == 1, f"{deployment['metadata']['name']}: one container per pod"
    return containers[0]


def named_port(ctr: dict, name: str) -> int:
    ports = {p["name"]: p["containerPort"] for p in ctr.get("ports", [])}
    assert name in ports, f"container {ctr['name']} has no port named {name!r} (has {sorted(ports)})"
    return ports[name]


def workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job")]


def all_containers(objs: list[dict]):
    for w in workloads(objs):
        spec = pod_spec(w)
        for ctr in spec.get("initContainers", []) + spec["containers"]:
            yield w, spec, ctr


def selector_matches(selector: dict, labels: dict) -> bool:
    """A Kubernetes LabelSelector (matchLabels + matchExpressions) against a label set."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def parse_quantity(text: str | int | float) -> float:
    """A Kubernetes resource quantity ("500m", "2", "1536Mi") as a plain number."""
    text = str(text)
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
                "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    match = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", text)
    assert match and match.group(2) in ("", *suffixes), f"not a quantity: {text!r}"
    return float(match.group(1)) * suffixes.get(match.group(2), 1)


def module_entry_exists(module: str) -> bool:
    path = ROOT / module.replace(".", "/")
    return (path / "__main__.py").is_file() or path.with_suffix(".py").is_file()
