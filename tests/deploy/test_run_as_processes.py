"""The cpu overlay's services started as local processes, exactly as the Deployments describe them."""
from __future__ import annotations

import base64
import json
import math
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from secrets import token_urlsafe
from urllib.parse import urlparse, urlunparse

import grpc
import pytest

from common.ports import free_port
from tests.deploy.manifests import (
    API_KEYS_SECRET,
    COMPOSED,
    MODELS_CLAIM,
    OWN,
    POOLS,
    REDIS_TLS_SECRET,
    ROOT,
    TLS_SECRET,
    bundled_redis,
    compose,
    container,
    kustomize_build,
    named_port,
    of_kind,
    one,
    parse_quantity,
    pod_spec,
    redis_secret,
    render,
)


class Resolver:
    """Turns a rendered container into the argv and environment the kubelet would give it."""

    def __init__(self, objs: list[dict], pod_ip: str = "127.0.0.1", rewrite=lambda value: value,
                 secrets: dict[str, dict[str, str]] | None = None) -> None:
        """rewrite(value) is applied to every ConfigMap value and literal env value (to move
        ports and the Redis address onto this machine) before any $(VAR) expansion. `secrets`
        (name -> key -> value): those the operator creates beside the rendered ones."""
        self.rewrite = rewrite
        self.config = {o["metadata"]["name"]: {k: rewrite(v) for k, v in o.get("data", {}).items()}
                       for o in of_kind(objs, "ConfigMap")}
        self.secrets = {o["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in o.get("data", {}).items()}
                        for o in of_kind(objs, "Secret")}
        for o in of_kind(objs, "Secret"):
            self.secrets[o["metadata"]["name"]].update(o.get("stringData", {}))
        self.secrets.update(secrets or {})
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

    def mount_volumes(self, deployment: dict, ctr: dict, root: Path,
                      claims: dict[str, Path] | None = None) -> dict[str, Path]:
        """The container's Secret volumes written under `root`, one file per key with the volume's
        defaultMode, as the kubelet mounts them, and its PersistentVolumeClaims as the local folders
        `claims` names; returns mountPath -> local folder."""
        volumes = {v["name"]: v for v in pod_spec(deployment).get("volumes", [])}
        mounted = {}
        for mount in ctr.get("volumeMounts", []):
            claim = volumes[mount["name"]].get("persistentVolumeClaim")
            if claim is not None:
                assert claim["claimName"] in (claims or {}), f"{ctr['name']}: no local folder for claim {claim}"
                mounted[mount["mountPath"].rstrip("/")] = claims[claim["claimName"]]
                continue
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


def redis_users_of(objs: list[dict], deployment: dict, root: Path) -> dict[str, str]:
    """Run the Redis container's start script (up to its exec) on the rendered rules and passwords, as the
    kubelet mounts them; check the ACL file it writes is the code's users; role -> password."""
    from common import redis_acl

    resolver = Resolver(objs)
    spec, ctr = pod_spec(deployment), container(deployment)
    volumes = {v["name"]: v for v in spec["volumes"]}
    script = ctr["args"][0]
    for mount in ctr["volumeMounts"]:
        volume, folder = volumes[mount["name"]], root / mount["mountPath"].strip("/")
        folder.mkdir(parents=True, exist_ok=True)
        if "configMap" in volume:
            for key, value in resolver.config[volume["configMap"]["name"]].items():
                (folder / key).write_text(value)
        for source in volume.get("projected", {}).get("sources", []):
            for item in source["secret"]["items"]:
                (folder / item["path"]).write_text(resolver.secrets[source["secret"]["name"]][item["key"]])
        script = script.replace(mount["mountPath"], str(folder))
    proc = subprocess.run(["sh", "-c", script.split("exec redis-server")[0]], capture_output=True, text=True,
                          timeout=30)
    assert proc.returncode == 0, proc.stderr
    passwords = {role: (root / "etc/handoff/redis-users" / role).read_text() for role in redis_acl.ROLES}
    written = (root / "tmp/users.acl").read_text().splitlines()
    assert written == ["user default off"] + [redis_acl.user_line(r, passwords[r]) for r in redis_acl.ROLES], written
    return passwords


def external_redis_users(objs: list[dict]) -> tuple[dict[str, str], dict[str, dict[str, str]]]:
    """The ACL users of an external Redis, as docs/deploy.md has the operator create them: each role's password
    from its Secret handoff-redis-<role> as rendered, or, where the overlay ships none (example-own), a made-up
    one in a Secret of that name; returns (role -> password, the made-up Secrets: name -> key -> value)."""
    from common import redis_acl

    rendered = Resolver(objs).secrets
    made_up: dict[str, dict[str, str]] = {}
    passwords = {}
    for role in redis_acl.ROLES:
        # A generated Secret's name carries a hash suffix (the cpu overlay's dev passwords).
        name = next((n for n in rendered if n.startswith(redis_secret(role))), redis_secret(role))
        if name not in rendered:
            made_up[name] = {"password": token_urlsafe(24)}
        passwords[role] = (rendered | made_up)[name]["password"]
    return passwords, made_up


def remap_mounted(env: dict[str, str], mounted: dict[str, Path]) -> dict[str, str]:
    """Paths on a mounted volume in environment values — the whole value, or a URL parameter's
    (rediss://...?ssl_ca_certs=PATH) — moved to where the volume is here; each must exist on it."""
    out = dict(env)
    for name in env:
        for mount_path, folder in mounted.items():
            def local(match: re.Match) -> str:
                path = folder / match.group(2)[len(mount_path) + 1:]
                assert path.exists(), f"{name}={env[name]}: the mounted volume has no {match.group(2)}"
                return match.group(1) + str(path)
            out[name] = re.sub(rf"(^|=)({re.escape(mount_path)}/[^&\s]*)", local, out[name])
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


def run_as_local_processes(objs: list[dict], tmp_path: Path, *, client_tls=None, api_key: str | None = None,
                           redis_tls: tuple[Path, Path] | None = None, claims: dict[str, Path] | None = None) -> None:
    """Start router, prefill and decode as the rendered Deployments describe them, wait for their
    probes, send one Generate through the router (over `client_tls`, with `api_key`), check the
    autoscalers' metrics, then SIGTERM them all and check that they drain in time.

    Without a Redis Deployment (components/external-redis), the services' rediss:// URL reaches the
    local Redis, which has the role users of external_redis_users, through TLS with `redis_tls`
    (certificate, key: for `localhost`, from the CA in the rendered Secret). `claims` maps
    PersistentVolumeClaims to local folders."""
    from common import grpc_common, security
    from common.engine.model_files import served_name
    from common.redis_server import EmbeddedRedis, connect
    from common.state import StateStore
    from protos import handoff_pb2, handoff_pb2_grpc
    from tests.support.tls_proxy import TLSProxy

    deployments = {c: one(objs, "Deployment", c) for c in ((*POOLS, "redis") if bundled_redis(objs) else POOLS)}

    made_up: dict[str, dict[str, str]] = {}
    if "redis" in deployments:
        # Redis: its container's script run on the rendered Secrets and rules builds the ACL file; the server
        # here is given the same users (EmbeddedRedis writes the same lines).
        passwords = redis_users_of(objs, deployments["redis"], tmp_path / "redis")
        redis_service = one(objs, "Service", "redis")
        service_hosts = {redis_service["metadata"]["name"],
                         f"{redis_service['metadata']['name']}.{redis_service['metadata']['namespace']}.svc"}
    else:  # an external Redis, with the role users the operator created on it
        assert redis_tls, "an external Redis is reached over TLS: give the test server a certificate"
        passwords, made_up = external_redis_users(objs)
        service_hosts = set()

    # Every port a service listens on moves to a free local one (three "pods" share 127.0.0.1).
    port_map: dict[int, int] = {}
    for component in POOLS:
        for p in container(deployments[component])["ports"]:
            port_map[p["containerPort"]] = free_port()  # never the same port twice in a process

    server = EmbeddedRedis(acl_users=passwords).start()
    proxy = TLSProxy(server.port, *redis_tls).start() if redis_tls else None
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
        if url.scheme == "rediss" and proxy is not None:  # the external Redis, its certificate's name
            return urlunparse(url._replace(netloc=f"localhost:{proxy.port}"))
        return value

    def channel(port: int, expect: str | None = None) -> grpc.Channel:
        """As a client of the router (its public certificate names 127.0.0.1), or as a prefill worker
        (for the KV port: expect="decode", the role its certificate must name)."""
        credentials = security.channel_credentials(client_tls) if client_tls else None
        return grpc_common.channel(f"127.0.0.1:{port}", credentials=credentials,
                                   server_name=client_tls.name_for(expect) if client_tls and expect else None)

    resolver = Resolver(objs, rewrite=rewrite, secrets=made_up)
    inherited = {k: v for k, v in os.environ.items() if not k.startswith(("HANDOFF_", "REDIS_"))}
    try:
        for component in POOLS:
            deployment, ctr = deployments[component], container(deployments[component])
            mounted = resolver.mount_volumes(deployment, ctr, tmp_path / component, claims)
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
        wait_serving(kv_port, procs["decode"], time.monotonic() + 10, "decode KV port", logs, channel(kv_port, "decode"))

        # The workers registered the addresses the downward API gave them (podIP -> 127.0.0.1).
        client, _ = connect(f"redis://127.0.0.1:{server.port}/0", username="handoff-operator",
                            password=passwords["operator"])
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
        # The same through the OpenAI-compatible HTTP port: TLS with the same certificate, the same keys.
        http_port = port_map[named_port(container(deployments["router"]), "http")]
        context = None
        if client_tls:
            context = ssl.create_default_context(cafile=client_tls.ca)
            # The public certificate (handoff-tls-public) names 127.0.0.1: hostname checked, as a client would.
        completion = urllib.request.Request(
            f"{'https' if client_tls else 'http'}://127.0.0.1:{http_port}/v1/completions",
            data=json.dumps({"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}).encode(),
            headers={"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})})
        with urllib.request.urlopen(completion, timeout=60, context=context) as resp:
            answer = json.loads(resp.read())
        assert answer["choices"][0]["text"] == "".join(c.text for c in chunks), answer
        config = of_kind(objs, "ConfigMap")[0]["data"]
        assert config["served-model-name"] == ""
        # The model's own name, of the path the pods are given (components/model-pvc: a file on the claim).
        assert answer["model"] == served_name(config["model"]), \
            "the ConfigMap's empty served-model-name serves the model's own name"
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
        if proxy is not None:
            assert proxy.num_handshakes >= len(POOLS) and proxy.num_refused == 0, "every service spoke TLS to Redis"
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if proxy is not None:
            proxy.stop()
        server.stop()


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_cpu_overlay_runs_as_a_working_cluster(tmp_path):
    run_as_local_processes(render("cpu"), tmp_path)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_cpu_overlay_with_tls_and_api_keys_runs_as_a_working_cluster(tmp_path):
    """The components' wiring, run: each role's certificate from its own mounted Secret, mutual TLS between
    the services (through the ConfigMap's tls-server-name: the certificates name roles, no IP), every
    internal call authorized by role, probes on the plaintext health ports, and a Generate over TLS (the
    public certificate) with an API key."""
    from common import pki as pki_tool
    from common.security import TLSConfig

    pki = tmp_path / "pki"
    pki_tool.issue_all(pki, days=1)
    api_key = "deploy-test-key-0123"
    folder = tmp_path / "kustomize"
    folder.mkdir()
    overlay, components = COMPOSED["cpu+tls"]
    ca = (pki / "ca.crt").read_bytes()
    secrets = {f"{TLS_SECRET}-{role}": {"tls.crt": (pki / f"{role}.crt").read_bytes(),
                                        "tls.key": (pki / f"{role}.key").read_bytes(), "ca.crt": ca}
               for role in ("router", "prefill", "decode", "public")}
    compose(folder, overlay, components, secrets={
        **secrets, API_KEYS_SECRET: {"api-keys": f"# test keys\nsome-other-key\n{api_key}\n".encode()}})
    objs = kustomize_build(folder)
    # The client: trusts the CA and checks the public certificate's 127.0.0.1; the router's public port asks
    # for no client certificate, and the prefill certificate is handed over for the KV-port check only.
    client_tls = TLSConfig(cert=str(pki / "prefill.crt"), key=str(pki / "prefill.key"), ca=str(pki / "ca.crt"))
    run_as_local_processes(objs, tmp_path, client_tls=client_tls, api_key=api_key)


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_cpu_overlay_with_own_model_and_redis_runs_as_a_working_cluster(tmp_path):
    """model-pvc and external-redis, run: every service loads the model from the claim's path (a folder
    here), and reaches Redis by the rendered rediss:// URL, through TLS, checked against the CA that the
    Secret handoff-redis-tls mounts, as its role's ACL user with the password of its role's Secret."""
    from common.engine.model_files import resolve_model_path
    from tests.support.certs import make_ca, make_cert

    pki = tmp_path / "pki"
    pki.mkdir()
    ca = make_ca(pki, "redis-ca")
    cert, key = make_cert(pki, "redis", ca, sans=("DNS:localhost",))
    folder = tmp_path / "kustomize"
    folder.mkdir()
    compose(folder, "cpu", ("model-pvc", "external-redis"), secrets={REDIS_TLS_SECRET: {"ca.crt": ca[0].read_bytes()}})
    objs = kustomize_build(folder)
    model = of_kind(objs, "ConfigMap")[0]["data"]["model"]
    claim = tmp_path / "claim"
    claim.mkdir()
    (claim / Path(model).name).symlink_to(resolve_model_path("smollm2"))  # what loader.yaml's recipe copies
    run_as_local_processes(objs, tmp_path, redis_tls=(cert, key), claims={MODELS_CLAIM: claim})


@pytest.mark.parametrize("overlay, components", [(OWN, ()), ("cpu", ("external-redis",))])
def test_an_external_redis_has_the_users_the_pools_log_in_as(overlay, components, tmp_path):
    """The users the test gives an external Redis are the ones the rendered pools log in as: the overlay's
    role Secrets (cpu's dev passwords), or made-up ones where it ships none (example-own)."""
    from common import redis_acl

    objs = kustomize_build(compose(tmp_path, overlay, components))
    passwords, made_up = external_redis_users(objs)
    assert set(passwords) == set(redis_acl.ROLES)
    assert sorted(made_up) == (sorted(redis_secret(r) for r in redis_acl.ROLES) if overlay == OWN else [])
    resolver = Resolver(objs, secrets=made_up)
    for component in POOLS:
        deployment = one(objs, "Deployment", component)
        env = resolver.env(deployment, container(deployment))
        assert (env["REDIS_USERNAME"], env["REDIS_PASSWORD"]) == (redis_acl.username(component), passwords[component])
