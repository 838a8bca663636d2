"""The structure of the manifests: resources, lockdown, labels, images, probes, ports, drain, autoscalers, configuration, components."""
from __future__ import annotations

import json
import re
from urllib.parse import urlparse

import pytest

from common import redis_acl

from tests.deploy.manifests import (
    API_KEYS_SECRET,
    COMPONENT,
    COMPOSED,
    NAME,
    OVERLAYS,
    OWN,
    PART_OF,
    POOL_METRICS,
    POOLS,
    TLS_FILES,
    TLS_SECRET,
    WORKERS,
    all_containers,
    bundled_redis,
    compose,
    container,
    kustomize_build,
    module_entry_exists,
    named_port,
    of_kind,
    one,
    parse_quantity,
    pod_spec,
    redis_secret,
    render,
    selector_matches,
    split_image,
    tls_on,
    workloads,
)


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
        "router": {"--host", "--port", "--http-port", "--redis-url", "--model", "--metrics-port"},
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
        assert "REDIS_USERNAME" in env, f"{component}: its own Redis ACL user"


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
            want = "liveness" if probe == "livenessProbe" else ""
            assert ctr[probe]["grpc"].get("service", "") == want, \
                f"{component}.{probe}: health service {want!r} (liveness never depends on Redis)"
        startup = ctr["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 120, f"{component}: allow for model loading"
        live = ctr["livenessProbe"]
        assert live["periodSeconds"] * live["failureThreshold"] >= 30, f"{component}: a blip must not restart it"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_agree_across_config_deployments_services_and_scrape_annotations(overlay):
    objs = render(overlay)
    config = of_kind(objs, "ConfigMap")[0]["data"]
    expected = {"router": {"grpc": "router-port", "http": "router-http-port", "metrics": "router-metrics-port"},
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
    public = [{k: p[k] for k in ("name", "port")} for p in router_service["spec"]["ports"]]
    assert {"name": "grpc", "port": 50051} in public and {"name": "http", "port": 8000} in public
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
    assert url.password is None and url.username is None, "no credentials in REDIS_URL"
    if bundled_redis(objs):
        assert url.scheme == "redis"
        redis_service = one(objs, "Service", "redis")
        assert url.hostname in (redis_service["metadata"]["name"],
                                f"{redis_service['metadata']['name']}.{redis_service['metadata']['namespace']}.svc")
        assert url.port in [p["port"] for p in redis_service["spec"]["ports"]]
        # Redis: an ACL user per role, rules from the code (common/redis_acl.py), passwords from each role's Secret.
        redis_deployment = one(objs, "Deployment", "redis")
        redis_ctr = container(redis_deployment)
        script = redis_ctr["args"][0]
        assert redis_ctr["command"] == ["sh", "-c"] and "--aclfile /tmp/users.acl" in script
        assert script.index("user default off") < script.index("exec redis-server"), "the default user is off"
        assert "for role in router prefill decode operator" in script and "sha256sum" in script
        assert "requirepass" not in script
        acl = next(o for o in of_kind(objs, "ConfigMap") if o["metadata"]["name"].startswith("handoff-redis-acl"))
        assert {k: v.strip() for k, v in acl["data"].items()} == {r: redis_acl.rules(r) for r in redis_acl.ROLES}, \
            "deploy/k8s/base/redis-acl differs from the code: python -m common.redis_acl --write deploy/k8s/base/redis-acl"
        volumes = {v["name"]: v for v in pod_spec(redis_deployment)["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in redis_ctr["volumeMounts"]}
        assert mounts["/etc/handoff/redis-acl"]["configMap"]["name"] == acl["metadata"]["name"]
        users = mounts["/etc/handoff/redis-users"]["projected"]
        assert users["defaultMode"] & 0o007 == 0
        role_secret = {src["secret"]["items"][0]["path"]: src["secret"]["name"] for src in users["sources"]}
        assert set(role_secret) == set(redis_acl.ROLES)
    else:  # components/external-redis: TLS, nothing of the bundled Redis left, the same users on the operator's Redis
        assert url.scheme == "rediss", "an external Redis is reached over TLS"
        left = [(o["kind"], o["metadata"]["name"]) for o in objs
                if o["metadata"]["name"] in ("handoff-redis", "handoff-to-redis")
                or o["metadata"]["name"].startswith("handoff-redis-acl")
                or o["metadata"].get("labels", {}).get(COMPONENT) == "redis"]
        assert not left, f"the bundled Redis's objects are left behind: {left}"
        shipped = {s["metadata"]["name"] for s in of_kind(objs, "Secret")}
        # Each role's Secret as the overlay ships it (a generated name carries a hash suffix), else as the operator creates it.
        role_secret = {r: next((n for n in shipped if n.startswith(redis_secret(r))), redis_secret(r))
                       for r in redis_acl.ROLES}
    assert all(role_secret[r].startswith(redis_secret(r)) for r in redis_acl.ROLES), role_secret
    for component in POOLS:
        ctr = container(one(objs, "Deployment", component))
        refs = {e["name"]: e.get("valueFrom", {}) for e in ctr["env"]}
        values = {e["name"]: e.get("value") for e in ctr["env"]}
        assert values["REDIS_USERNAME"] == redis_acl.username(component), f"{component}: its own Redis user"
        assert refs["REDIS_PASSWORD"]["secretKeyRef"] == {"name": role_secret[component], "key": "password"}, \
            f"{component}: its own role's password, and no other"
        others = {n for n, r in refs.items() if "secretKeyRef" in r and r["secretKeyRef"]["name"].startswith(
            "handoff-redis-") and r["secretKeyRef"]["name"] != role_secret[component]}
        assert not others, f"{component} reads another role's Redis password: {others}"
        assert refs["REDIS_URL"]["configMapKeyRef"] == {"name": config["metadata"]["name"], "key": "redis-url"}
        for name in ("HANDOFF_PORT", "HANDOFF_MODEL", "HANDOFF_METRICS_PORT"):
            assert refs[name]["configMapKeyRef"]["name"] == config["metadata"]["name"], f"{component}: {name}"
    secrets = of_kind(objs, "Secret")
    if overlay in ("gpu", OWN):
        assert not secrets, f"the {overlay} overlay ships no password: the operator supplies the Secrets"
    else:
        assert sorted(s["metadata"]["name"] for s in secrets if s["metadata"]["name"].startswith("handoff-redis")) \
            == sorted(role_secret.values())


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
    """Every pool reads its certificate, key and CA as files of its own role's Secret handoff-tls-<role>, and
    mounts no other role's; names the certificate it expects from the ConfigMap, and flags them on its command
    line; the router alone serves a public certificate (handoff-tls-public) and reads API keys, as a file of
    the Secret handoff-api-keys."""
    objs = render(overlay)
    config = of_kind(objs, "ConfigMap")[0]
    for component in POOLS:
        deployment = one(objs, "Deployment", component)
        spec, ctr = pod_spec(deployment), container(deployment)
        env = {e["name"]: e for e in ctr["env"]}
        assert tls_on(ctr), f"{component}: TLS on"
        for name, key in TLS_FILES.items():
            assert file_from_secret(spec, ctr, env[name]["value"], f"{TLS_SECRET}-{component}") == key, \
                f"{component}: {name}"
        tls_secrets = {re.sub(r"-[a-z0-9]{10}$", "", secret) for secret, _ in secret_mounts(spec, ctr).values()
                       if secret.startswith(TLS_SECRET)}  # without a generator's hash suffix
        public = {f"{TLS_SECRET}-public"} if component == "router" else set()
        assert tls_secrets == {f"{TLS_SECRET}-{component}"} | public, f"{component} mounts {tls_secrets}"
        if component == "router":
            for name, key in (("HANDOFF_PUBLIC_TLS_CERT", "tls.crt"), ("HANDOFF_PUBLIC_TLS_KEY", "tls.key")):
                assert file_from_secret(spec, ctr, env[name]["value"], f"{TLS_SECRET}-public") == key
            assert {"--public-tls-cert=$(HANDOFF_PUBLIC_TLS_CERT)", "--public-tls-key=$(HANDOFF_PUBLIC_TLS_KEY)"} \
                <= set(ctr["args"])
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


def test_cert_manager_component_issues_each_role_its_identity(tmp_path):
    """components/cert-manager writes exactly the Secrets components/tls mounts, each certificate naming its
    role as the code expects (common/pki.py): the SPIFFE ID of the overlay's namespace, and <role>.<name> of
    the ConfigMap's tls-server-name; the operator's identity too (mounted nowhere), and the public one."""
    from common import pki

    objs = kustomize_build(compose(tmp_path, "cpu", ("tls", "cert-manager", "api-keys")))
    certs = {c["spec"]["secretName"]: c["spec"] for c in of_kind(objs, "Certificate")}
    name = of_kind(objs, "ConfigMap")[0]["data"]["tls-server-name"]
    for role in pki.ROLES:
        spec = certs[f"{TLS_SECRET}-{role}"]
        namespace = one(objs, "Deployment", "router")["metadata"]["namespace"]
        assert spec["uris"] == [pki.spiffe_id(namespace, role)] and spec["dnsNames"] == [pki.server_name(role, name)]
        assert {"server auth", "client auth"} <= set(spec["usages"]), role
        assert spec["privateKey"]["rotationPolicy"] == "Always" and spec["issuerRef"]["name"] == "handoff-ca"
    mounted = {re.sub(r"-[a-z0-9]{10}$", "", secret) for component in POOLS
               for secret, _ in secret_mounts(pod_spec(one(objs, "Deployment", component)),
                                              container(one(objs, "Deployment", component))).values()
               if secret.startswith(TLS_SECRET)}
    assert mounted == set(certs) - {f"{TLS_SECRET}-operator", "handoff-ca"}, mounted
    assert "handoff-router" in certs[f"{TLS_SECRET}-public"]["dnsNames"]
