"""components/external-redis: the services reach a Redis of the operator's over TLS — rediss:// with the
CA from a mounted Secret, each pool as its role's ACL user with the password of its own Secret
handoff-redis-<role> — and that URL, as rendered, connects through TLS to a real Redis with those users and
refuses a server it should not trust."""
from __future__ import annotations

import inspect
import tempfile
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

import pytest
from redis.connection import SSLConnection

from common import redis_acl

from tests.deploy.manifests import (
    OWN,
    POOLS,
    REDIS_TLS_SECRET,
    compose,
    container,
    kustomize_build,
    of_kind,
    pod_spec,
    redis_secret,
    render,
    workloads,
)


def redis_tls_problems(objs: list[dict]) -> list[str]:
    """What keeps the rendered services from reaching an external Redis over TLS, as the component intends."""
    problems = []
    url = urlparse(of_kind(objs, "ConfigMap")[0]["data"]["redis-url"])
    if url.scheme != "rediss":
        problems.append(f"redis-url scheme {url.scheme!r}: rediss:// (TLS) for a Redis outside the cluster")
    if url.username or url.password:
        problems.append("redis-url holds credentials: the password belongs in the Secret")
    query = {k: v[0] for k, v in parse_qs(url.query).items()}
    ssl_options = set(inspect.signature(SSLConnection.__init__).parameters)
    problems += [f"redis-url parameter {k!r} is no redis-py TLS option" for k in query if k not in ssl_options]
    ca_path = query.get("ssl_ca_certs", "")
    readers = [w for w in workloads(objs)
               if any(e["name"] == "REDIS_URL" for e in container(w).get("env", []))]
    if {w["metadata"]["labels"]["app.kubernetes.io/component"] for w in readers} != set(POOLS):
        problems.append(f"REDIS_URL is read by {[w['metadata']['name'] for w in readers]}, not by every pool")
    for w in readers:
        name, spec, ctr = w["metadata"]["name"], pod_spec(w), container(w)
        role = w["metadata"]["labels"]["app.kubernetes.io/component"]
        env = {e["name"]: e.get("valueFrom", {}) for e in ctr["env"]}
        username = next((e.get("value") for e in ctr["env"] if e["name"] == "REDIS_USERNAME"), None)
        if username != redis_acl.username(role):
            problems.append(f"{name}: REDIS_USERNAME is {username!r}, not its role's user {redis_acl.username(role)}")
        ref = env["REDIS_PASSWORD"].get("secretKeyRef", {})
        # A generated Secret's name carries a hash suffix (the cpu overlay's dev passwords).
        if not (ref.get("name", "").startswith(redis_secret(role)) and ref.get("key") == "password"):
            problems.append(f"{name}: REDIS_PASSWORD is not key password of its role's Secret {redis_secret(role)}")
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        found = None
        for mount in ctr.get("volumeMounts", []):
            secret = volumes[mount["name"]].get("secret")
            if secret and ca_path.startswith(mount["mountPath"].rstrip("/") + "/"):
                found = (mount, secret, ca_path[len(mount["mountPath"].rstrip("/")) + 1:])
        if found is None:
            problems.append(f"{name}: ssl_ca_certs={ca_path!r} is on no Secret volume")
            continue
        mount, secret, key = found
        if not (secret["secretName"].startswith(REDIS_TLS_SECRET) and key == "ca.crt"):
            problems.append(f"{name}: the CA is key {key!r} of Secret {secret['secretName']!r}, "
                            f"not ca.crt of {REDIS_TLS_SECRET}")
        if mount.get("readOnly") is not True or secret.get("defaultMode", 0o644) & 0o007:
            problems.append(f"{name}: mount the Redis CA read-only, unreadable to other users")
    return problems


def render_composed(overlay: str, components: tuple[str, ...]) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="handoff-kustomize-") as folder:
        return kustomize_build(compose(Path(folder), overlay, components))


@pytest.mark.parametrize("overlay, components", [(OWN, ()), ("cpu", ("external-redis",)),
                                                 ("gpu", ("external-redis",))])
def test_every_pool_reaches_redis_over_tls_with_the_mounted_ca(overlay, components):
    objs = render_composed(overlay, components) if components else render(overlay)
    assert redis_tls_problems(objs) == []
    url = urlparse(of_kind(objs, "ConfigMap")[0]["data"]["redis-url"])
    assert parse_qs(url.query)["ssl_ca_certs"] == ["/etc/handoff/redis-tls/ca.crt"]


@pytest.mark.parametrize("mutate, problem", [
    (lambda cm, ds: cm.update({"redis-url": cm["redis-url"].replace("rediss://", "redis://")}), "scheme"),
    (lambda cm, ds: cm.update({"redis-url": cm["redis-url"].replace("rediss://", "rediss://:pw@")}), "credentials"),
    (lambda cm, ds: cm.update({"redis-url": cm["redis-url"].replace("ssl_ca_certs", "ssl_ca_cert")}), "no redis-py"),
    (lambda cm, ds: cm.update({"redis-url": cm["redis-url"].replace("/redis-tls/", "/tls/")}), "no Secret volume"),
    (lambda cm, ds: container(ds["decode"]).update(volumeMounts=[
        m for m in container(ds["decode"])["volumeMounts"] if m["name"] != "redis-tls"]), "no Secret volume"),
    (lambda cm, ds: [v["secret"].update(defaultMode=0o444) for v in pod_spec(ds["router"])["volumes"]
                     if v["name"] == "redis-tls"], "read-only"),
    (lambda cm, ds: [e.update(valueFrom={"secretKeyRef": {"name": redis_secret("router"), "key": "password"}})
                     for e in container(ds["decode"])["env"] if e["name"] == "REDIS_PASSWORD"], "its role's Secret"),
    (lambda cm, ds: [e.update(value=redis_acl.username("operator")) for e in container(ds["prefill"])["env"]
                     if e["name"] == "REDIS_USERNAME"], "not its role's user"),
])
def test_the_check_catches_a_broken_tls_setup(mutate, problem):
    objs = render(OWN)
    deployments = {w["metadata"]["labels"]["app.kubernetes.io/component"]: w for w in workloads(objs)}
    mutate(of_kind(objs, "ConfigMap")[0]["data"], deployments)
    assert any(problem in p for p in redis_tls_problems(objs)), redis_tls_problems(objs)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A real Redis (embedded valkey) with handoff's ACL users, as docs/deploy.md has the operator create
    them, behind TLS with a certificate for `localhost` from a CA of its own; yields (proxy, CA file,
    role -> password)."""
    from common.redis_server import EmbeddedRedis
    from tests.support.certs import make_ca, make_cert
    from tests.support.tls_proxy import TLSProxy

    pki = tmp_path_factory.mktemp("redis-pki")
    ca = make_ca(pki, "redis-ca")
    cert, key = make_cert(pki, "redis", ca, sans=("DNS:localhost",))
    passwords = {role: f"external-redis-test-{role}-password" for role in redis_acl.ROLES}
    with EmbeddedRedis(acl_users=passwords) as server, TLSProxy(server.port, cert, key) as proxy:
        yield proxy, ca[0], passwords


def local_url(rendered: str, host: str, port: int, ca_file: Path) -> str:
    """The rendered redis-url moved onto this machine: host and port, and the CA's mount path
    replaced by the local file; every other part as rendered."""
    url = urlparse(rendered)
    query = {k: v[0] for k, v in parse_qs(url.query).items()} | {"ssl_ca_certs": str(ca_file)}
    return urlunparse(url._replace(netloc=f"{host}:{port}", query=urlencode(query)))


def test_the_rendered_url_reaches_redis_over_tls(tls_redis):
    from common.redis_server import connect
    from common.state import StateStore

    proxy, ca_file, passwords = tls_redis
    objs = render(OWN)
    rendered = of_kind(objs, "ConfigMap")[0]["data"]["redis-url"]
    for w in workloads(objs):  # each pool as the user its Deployment names
        role = w["metadata"]["labels"]["app.kubernetes.io/component"]
        username = next(e["value"] for e in container(w)["env"] if e["name"] == "REDIS_USERNAME")
        handshakes = proxy.num_handshakes
        client, embedded = connect(local_url(rendered, "localhost", proxy.port, ca_file),
                                   username=username, password=passwords[role])
        assert embedded is None
        store = StateStore(client)
        assert store.ping()
        assert client.acl_whoami() == redis_acl.username(role), "logged in as its role's ACL user"
        assert store.url == f"rediss://localhost:{proxy.port}/0", "the address in messages says TLS, no password"
        assert proxy.num_handshakes > handshakes, "the client spoke TLS to the proxy"
        client.close()


@pytest.mark.parametrize("case", ["another CA", "a name the certificate lacks", "plaintext"])
def test_a_redis_it_should_not_trust_is_refused(tls_redis, tmp_path, case):
    from common.redis_server import connect
    from common.state import StateStore, StateUnavailable
    from tests.support.certs import make_ca

    proxy, ca_file, passwords = tls_redis
    password = passwords["router"]
    rendered = of_kind(render(OWN), "ConfigMap")[0]["data"]["redis-url"]
    host = "127.0.0.1" if case == "a name the certificate lacks" else "localhost"
    if case == "another CA":
        ca_file = make_ca(tmp_path, "other-ca")[0]
    url = local_url(rendered, host, proxy.port, ca_file)
    if case == "plaintext":
        url = f"redis://localhost:{proxy.port}/0"
    client, _ = connect(url, username=redis_acl.username("router"), password=password)
    with pytest.raises(StateUnavailable) as info:
        StateStore(client).ping()
    assert "is unreachable" in str(info.value) and password not in str(info.value)
    if case != "plaintext":
        assert "certificate verify failed" in str(info.value), info.value
    client.close()
