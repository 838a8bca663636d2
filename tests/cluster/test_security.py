"""Security: per-role identities and mutual TLS on every port, authorization of every internal method by the
caller's role, API keys on the router, a Redis ACL user, no secret in logs.

The certificates are issued here by common/pki.py, as `python -m common.pki` does: a CA, one certificate
per role (router, prefill, decode, operator; SPIFFE ID and <role>.handoff-internal, never an IP, so every
channel works only through the role's name), the router's public certificate, and a rogue CA that issued
a set of its own.
"""
from __future__ import annotations

import io
import logging
import os
import ssl
from dataclasses import dataclass, replace
import time
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY, generate_latest

from common import authz, grpc_common, pki as pki_tool, security
from common.ports import free_port
from common.redis_server import EmbeddedRedis, connect
from common.security import APIKeys, TLSConfig, TLSError
from common.worker import WorkerConfig
from protos import handoff_pb2, handoff_pb2_grpc, internal_pb2, internal_pb2_grpc
from router import client
from router.cluster import Cluster
from router.config import RouterConfig
from router.server import RouterServer
from tests.support.certs import openssl

API_KEYS = ("key-alpha-0123456789", "key-beta-9876543210")
WRONG_KEY = "wrong-key-5c1e7a"
REDIS_USER = "handoff-svc"
REDIS_SECRET = "redis-secret-8d41f0"
SERVER_NAME = pki_tool.DEFAULT_SERVER_NAME


# --------------------------------------------------------------------------- certificates


@dataclass(frozen=True)
class PKI:
    folder: Path  # ca.crt, ca.key, <role>.crt/.key, public.crt/.key
    rogue: Path  # the same, from another CA

    def tls(self, role: str) -> TLSConfig:
        return security.role_tls(self.folder, role)

    def cert(self, role: str) -> tuple[Path, Path]:
        return self.folder / f"{role}.crt", self.folder / f"{role}.key"

    @property
    def ca(self) -> Path:
        return self.folder / "ca.crt"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    folder, rogue = tmp_path_factory.mktemp("pki"), tmp_path_factory.mktemp("rogue-pki")
    pki_tool.issue_all(folder, days=2)
    pki_tool.issue_all(rogue, days=2)
    return PKI(folder, rogue)


def test_pki_issues_one_identity_per_role(pki, tmp_path):
    """Each role's certificate names its role twice (SPIFFE ID for authorization, <role>.<name> for callers),
    chains to the CA, and is good as server and client certificate; the CLI writes the same set."""
    ca = ssl.create_default_context(cafile=str(pki.ca))
    for role in pki_tool.ROLES:
        cert, key = pki.cert(role)
        assert pki_tool.identity_of_pem(cert.read_bytes()) == pki_tool.Identity("default", role)
        assert oct(key.stat().st_mode & 0o777) == "0o600", "keys are readable by their owner only"
        security.check(pki.tls(role), role)
        with pytest.raises(TLSError, match=f"is spiffe://handoff/default/role/{role}"):
            security.check(pki.tls(role), "decode" if role != "decode" else "prefill")
        # The leaf verifies against the CA for the role's name (what a caller of that role's servers checks).
        text = openssl_text(tmp_path, cert)
        assert f"DNS:{role}.{SERVER_NAME}" in text and f"URI:spiffe://handoff/default/role/{role}" in text
        assert "TLS Web Server Authentication, TLS Web Client Authentication" in text
        assert ca.get_ca_certs(), "the CA bundle loads"
    out = tmp_path / "cli"
    pki_tool.main(["--out", str(out), "--namespace", "prod", "--server-name", "svc.internal", "--days", "1"])
    assert pki_tool.identity_of_pem((out / "decode.crt").read_bytes()) == pki_tool.Identity("prod", "decode")
    assert f"DNS:decode.svc.internal" in openssl_text(tmp_path, out / "decode.crt")
    # Reissued from the same CA (rotation of the leaves): the new leaf chains to the old CA.
    again = tmp_path / "again"
    pki_tool.main(["--out", str(again), "--ca-dir", str(out)])
    assert (again / "ca.crt").read_bytes() == (out / "ca.crt").read_bytes() and not (again / "ca.key").exists()
    openssl(tmp_path, "verify", "-CAfile", str(out / "ca.crt"), str(again / "router.crt"))


def openssl_text(cwd: Path, cert: Path) -> str:
    import subprocess
    return subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-text"], cwd=cwd, capture_output=True,
                          text=True, check=True).stdout


# --------------------------------------------------------------------------- TLS configuration

def test_tls_files_are_checked_and_errors_name_the_file(pki, tmp_path):
    tls = pki.tls("decode")
    security.check(tls, "decode")  # the good set passes
    cert, key = pki.cert("decode")
    rogue_key = pki.rogue / "decode.key"
    cases = [
        (replace(tls, cert=str(tmp_path / "nope.crt")), ["nope.crt", "no such file"]),
        (replace(tls, ca=str(tmp_path)), [str(tmp_path), "directory"]),
        (replace(tls, key=str(rogue_key)), [str(rogue_key), "does not belong", str(cert)]),
        (replace(tls, cert=str(key)), [str(key), "not a PEM file"]),
    ]
    encrypted = tmp_path / "encrypted.key"
    openssl(tmp_path, "pkey", "-in", str(key), "-aes256", "-passout", "pass:xyz", "-out", encrypted.name)
    cases.append((replace(tls, key=str(encrypted)), [str(encrypted), "passphrase"]))
    garbage = tmp_path / "garbage.crt"
    garbage.write_text("-----BEGIN CERTIFICATE-----\nnot base64 at all!\n-----END CERTIFICATE-----\n")
    cases.append((replace(tls, ca=str(garbage)), [str(garbage), "unreadable PEM"]))
    cases.append((replace(tls, cert=str(garbage)), [str(garbage), "unreadable PEM"]))
    for cfg, words in cases:
        with pytest.raises(TLSError) as info:
            security.check(cfg)
        for word in words:
            assert word in str(info.value), (str(info.value), word)
        with pytest.raises(TLSError):
            security.server_credentials(cfg, require_client_cert=True)


def test_tls_config_must_be_complete_for_a_service(pki):
    cert, key = pki.cert("decode")
    with pytest.raises(ValueError, match="go together"):
        TLSConfig(cert=str(cert))
    with pytest.raises(ValueError, match="needs --tls-cert"):
        TLSConfig(ca=str(pki.ca), require_client_cert=True)
    with pytest.raises(ValueError, match="mutual TLS"):  # a worker without a CA could not check its callers
        WorkerConfig(role="decode", tls=TLSConfig(cert=str(cert), key=str(key)))
    with pytest.raises(ValueError, match="mutual TLS"):
        RouterConfig(tls=TLSConfig(ca=str(pki.ca)))
    assert not TLSConfig().enabled and security.server_credentials(TLSConfig(), require_client_cert=True) is None
    assert security.channel_credentials(TLSConfig()) is None


def test_service_flags_read_tls_and_api_keys_from_the_environment(pki, tmp_path, monkeypatch):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# rotated 2025-01\n  {API_KEYS[0]}  \n\n{API_KEYS[1]} # second\n")

    def use(role: str) -> None:
        cert, key = pki.cert(role)
        monkeypatch.setenv("HANDOFF_TLS_CERT", str(cert))
        monkeypatch.setenv("HANDOFF_TLS_KEY", str(key))

    use("router")
    monkeypatch.setenv("HANDOFF_TLS_CA", str(pki.ca))
    monkeypatch.setenv("HANDOFF_TLS_SERVER_NAME", SERVER_NAME)
    monkeypatch.setenv("HANDOFF_PUBLIC_TLS_CERT", str(pki.folder / "public.crt"))
    monkeypatch.setenv("HANDOFF_PUBLIC_TLS_KEY", str(pki.folder / "public.key"))
    monkeypatch.setenv("HANDOFF_HEALTH_PORT", "50052")
    monkeypatch.setenv("HANDOFF_API_KEYS", f"{API_KEYS[0]}, extra-key-1")
    config = RouterConfig.from_args(["--api-keys-file", str(keys_file), "--tls-require-client-cert=1"])
    assert config.tls == replace(pki.tls("router"), server_name=SERVER_NAME, require_client_cert=True)
    assert config.tls.public.cert == str(pki.folder / "public.crt") and config.tls.public.ca == str(pki.ca)
    assert config.health_port == 50052
    assert config.api_keys == (*API_KEYS, "extra-key-1") and config.api_keys_file == str(keys_file)
    assert not any(k in repr(config) for k in config.api_keys), "a config's repr never shows a key"
    with pytest.raises(SystemExit):  # the router's identity cannot start a decode worker
        WorkerConfig.from_args("decode", [])
    use("decode")
    worker = WorkerConfig.from_args("decode", [])
    assert worker.tls == replace(pki.tls("decode"), server_name=SERVER_NAME) and worker.health_port == 50052
    with pytest.raises(SystemExit):  # ... nor the decode identity a router
        RouterConfig.from_args([])
    monkeypatch.setenv("HANDOFF_TLS_KEY", str(pki.rogue / "decode.key"))
    with pytest.raises(SystemExit):  # a key that does not match: refused at start, before the model loads
        WorkerConfig.from_args("decode", [])


# --------------------------------------------------------------------------- API keys

def test_api_keys_file_format(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# production keys\n\n   k1   \nk2  # the CI key\n#k3\n\t\nk1\n")
    assert security.read_api_keys(str(path)) == ("k1", "k2")
    assert security.read_api_keys(str(path), " k4 ,, k2 ,") == ("k1", "k2", "k4")
    assert security.read_api_keys(None, None) == ()
    path.write_text("# only comments\n\n")
    with pytest.raises(ValueError, match="holds no key"):
        security.read_api_keys(str(path))
    with pytest.raises(ValueError, match="no such file"):
        security.read_api_keys(str(tmp_path / "missing"))
    path.write_text("secret-part other-part\n")
    with pytest.raises(ValueError) as info:
        security.read_api_keys(str(path))
    assert "secret-part" not in str(info.value), "an error never quotes a key"


def test_api_key_check():
    assert APIKeys([]).check(None) and APIKeys([]).check("anything"), "no keys: authentication is off"
    keys = APIKeys(API_KEYS)
    assert keys.enabled and len(keys) == 2
    assert keys.check(API_KEYS[0]) and keys.check(API_KEYS[1])
    for bad in (None, "", API_KEYS[0][:-1], API_KEYS[0][:4], API_KEYS[0] + "x", " " + API_KEYS[0], WRONG_KEY):
        assert not keys.check(bad), bad
    assert API_KEYS[0] not in repr(keys)
    with pytest.raises(ValueError):  # an empty key would match an empty header
        APIKeys(["k1", ""])


def test_api_key_check_is_constant_time_by_construction(monkeypatch):
    """Every configured key is compared with hmac.compare_digest, whether the first one matches or none does."""
    calls = []
    real = security.hmac.compare_digest

    def counting(a, b):
        calls.append((len(a), len(b)))
        return real(a, b)

    monkeypatch.setattr(security.hmac, "compare_digest", counting)
    keys = APIKeys(["a", "bb", "ccc"])
    for presented in ("a", "ccc", "zz", "a-much-longer-key-than-any-configured"):
        calls.clear()
        keys.check(presented)
        assert len(calls) == 3, f"{presented!r}: {len(calls)} comparisons, want one per key (no early exit)"
        assert len({n for pair in calls for n in pair}) == 1, "digests of one length: a key's length does not show"


def test_bearer_token():
    assert security.bearer_token([("authorization", "Bearer abc")]) == "abc"
    assert security.bearer_token([("x-other", "1"), ("authorization", "bearer  abc ")]) == "abc"
    assert security.bearer_token([("authorization", "Basic abc")]) == ""
    assert security.bearer_token([("x-other", "1")]) is None and security.bearer_token(None) is None


# --------------------------------------------------------------------------- Redis ACL user

def test_redis_acl_user_reaches_the_server():
    with EmbeddedRedis(password=REDIS_SECRET, username=REDIS_USER) as server:
        bare_url = f"redis://127.0.0.1:{server.port}/0"
        acl_user, _ = connect(bare_url, password=REDIS_SECRET, username=REDIS_USER)
        assert acl_user.ping()
        assert acl_user.acl_whoami() == REDIS_USER
        acl_user.close()
        # The default user is off: the password alone is not enough, so the username did the work.
        default_user, _ = connect(bare_url, password=REDIS_SECRET)
        with pytest.raises(redis.AuthenticationError):
            default_user.ping()
        default_user.close()
        assert REDIS_SECRET not in repr(server)


# --------------------------------------------------------------------------- a cluster with TLS and API keys

class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(logging.Formatter("%(name)s %(message)s").format(record))


@pytest.fixture(scope="module")
def secure(pki):
    """The default topology as users run it with security on: 1 prefill + 1 decode + router, each with its
    role's certificate, mutual TLS, authorization by role, a Redis ACL user per role, API keys on.

    Everything the cluster logs, from its start, is recorded at DEBUG for the secrets test."""
    records = _Records()
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(records)
    root.setLevel(logging.DEBUG)
    cluster = None
    try:
        # TLS on means Redis ACLs on: the embedded Redis gets a user per role, each service connects as its own.
        router = RouterConfig(api_keys=API_KEYS, health_port=free_port())
        cluster = Cluster(num_prefill=1, num_decode=1, dtype="fp32", kv_memory_gib=0.1, threads=1, router=router,
                          tls_dir=str(pki.folder))
        cluster.start()
        cluster.records = records
        yield cluster
    finally:
        if cluster is not None:
            cluster.stop()
        root.removeHandler(records)
        root.setLevel(old_level)


def tls_channel(address: str, pki: PKI, *, role: str | None = None, expect: str | None = None,
                folder: Path | None = None, ca: Path | None = None) -> grpc.Channel:
    """A TLS channel presenting `role`'s certificate of `folder` (none without a role), expecting a server of
    role `expect` (None: the router's public port, whose certificate names 127.0.0.1)."""
    folder = folder or pki.folder
    cert, key = (folder / f"{role}.crt", folder / f"{role}.key") if role else (None, None)
    tls = TLSConfig(cert=str(cert) if cert else None, key=str(key) if key else None, ca=str(ca or pki.ca))
    return grpc_common.channel(address, credentials=security.channel_credentials(tls),
                               server_name=tls.name_for(expect) if expect else None)


def health_status(channel: grpc.Channel) -> str:
    """SERVING / NOT_SERVING, or the status code of the failed call."""
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return exc.code().name
    finally:
        channel.close()


def generate(address: str, pki: PKI, api_key: str | None, **fields) -> list[handoff_pb2.GenerateResponse]:
    with tls_channel(address, pki) as channel:  # no client certificate: the public port does not ask for one
        metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
        request = handoff_pb2.GenerateRequest(**{"prompt": "The capital of France is", "max_tokens": 4,
                                                 "temperature": 0.0, "ignore_eos": True, **fields})
        return list(handoff_pb2_grpc.RouterStub(channel).Generate(request, timeout=60, metadata=metadata))


def test_generate_over_tls_with_a_valid_key(secure, pki):
    """Tokens back means the router reached prefill and decode, and prefill pushed the KV to decode,
    all three over mutual TLS, each server known by its role's name, each call authorized by role."""
    for key in API_KEYS:
        msgs = generate(secure.address, pki, key)
        assert len([t for m in msgs for t in m.token_ids]) == 4
        assert msgs[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH
    # python -m router.client's path: --tls-ca, --tls-server-name, HANDOFF_API_KEY.
    out = io.StringIO()
    figures = client.stream(secure.address, handoff_pb2.GenerateRequest(prompt="Hi", max_tokens=3, ignore_eos=True),
                            60, out, tls=TLSConfig(ca=str(pki.ca)), api_key=API_KEYS[0])
    assert figures["completion_tokens"] == 3 and out.getvalue()
    kv_in = REGISTRY.get_sample_value("handoff_kv_transfer_bytes_total",
                                      {"worker": secure.decode[0].config.worker_id, "direction": "in"})
    assert kv_in and kv_in > 0, "the KV went prefill -> decode over the KV port"


def test_each_service_is_its_own_redis_user_and_greedy_and_sampled_requests_run(secure, pki):
    """With TLS and ACLs on, as users run it: each service is its role's Redis user, registrations carry the
    workers' identities, and greedy and sampled requests give the same tokens for the same seed."""
    users = {"router": secure.router.state, "prefill": secure.prefill[0].state, "decode": secure.decode[0].state}
    assert {role: store.client.acl_whoami() for role, store in users.items()} == \
        {role: f"handoff-{role}" for role in users}
    assert {(w.role, w.identity) for w in secure.states["operator"].list_workers()} == \
        {(role, f"spiffe://handoff/default/role/{role}") for role in ("prefill", "decode")}
    runs = {}
    for name, fields in (("greedy", dict(temperature=0.0)), ("sampled", dict(temperature=0.9, top_p=0.95, seed=7))):
        outputs = [[t for m in generate(secure.address, pki, API_KEYS[0], max_tokens=6, **fields) for t in m.token_ids]
                   for _ in range(2)]
        assert len(outputs[0]) == 6 and outputs[0] == outputs[1], (name, outputs)
        runs[name] = outputs[0]
    secure.check_integrity()


@pytest.mark.parametrize("api_key, message", [
    (None, "requires an API key"),
    (WRONG_KEY, "not valid"),
    (API_KEYS[0][:-1], "not valid"),  # a prefix of a valid key
])
def test_missing_or_wrong_key_is_unauthenticated(secure, pki, api_key, message):
    with pytest.raises(grpc.RpcError) as info:
        generate(secure.address, pki, api_key)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    assert message in info.value.details()
    assert not any(k in info.value.details() for k in (*API_KEYS, WRONG_KEY)), "the status never echoes a key"


def test_malformed_authorization_is_unauthenticated(secure, pki):
    with tls_channel(secure.address, pki) as channel:
        call = handoff_pb2_grpc.RouterStub(channel).Generate(
            handoff_pb2.GenerateRequest(prompt="Hi", max_tokens=1), timeout=30,
            metadata=[("authorization", f"Basic {API_KEYS[0]}")])
        with pytest.raises(grpc.RpcError) as info:
            list(call)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in info.value.details()


def test_health_needs_no_key_and_the_health_port_is_plaintext(secure, pki):
    assert health_status(tls_channel(secure.address, pki)) == "SERVING", "probes carry no API key"
    health_address = f"127.0.0.1:{secure.router_config.health_port}"
    assert health_status(grpc.insecure_channel(health_address)) == "SERVING"
    with grpc.insecure_channel(health_address) as channel:  # the health port serves health, nothing else
        with pytest.raises(grpc.RpcError) as info:
            list(handoff_pb2_grpc.RouterStub(channel).Generate(handoff_pb2.GenerateRequest(prompt="Hi"), timeout=10))
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_plaintext_client_to_a_tls_port_fails(secure):
    decode = secure.decode[0]
    for address in (secure.address, secure.prefill[0].address, decode.address, decode.kv_address):
        assert health_status(grpc.insecure_channel(address)) == "UNAVAILABLE", address


def internal_ports(cluster) -> dict[str, tuple[str, str]]:
    """name -> (address, the role its server holds)."""
    decode = cluster.decode[0]
    return {"prefill": (cluster.prefill[0].address, "prefill"), "decode": (decode.address, "decode"),
            "kv": (decode.kv_address, "decode")}


def test_internal_ports_accept_only_client_certificates_from_the_ca(secure, pki):
    for name, (address, role) in internal_ports(secure).items():
        for caller in pki_tool.ROLES:  # health is open to every identity of the deployment
            assert health_status(tls_channel(address, pki, role=caller, expect=role)) == "SERVING", (name, caller)
        assert health_status(tls_channel(address, pki, expect=role)) == "UNAVAILABLE", f"{name}: no client certificate"
        assert health_status(tls_channel(address, pki, role="router", expect=role, folder=pki.rogue)) == \
            "UNAVAILABLE", f"{name}: a client certificate from an unknown CA"
    # Not only health: the KV port's PushKV refuses a caller without a certificate before any byte of KV.
    with tls_channel(secure.decode[0].kv_address, pki, expect="decode") as channel:
        with pytest.raises(grpc.RpcError) as info:
            internal_pb2_grpc.KVTransferStub(channel).PushKV(iter(()), timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_server_certificate_from_another_ca_is_refused(secure, pki):
    """The client side of mutual TLS: a worker impostor (wrong CA) is not trusted by a caller."""
    channel = tls_channel(secure.prefill[0].address, pki, role="router", expect="prefill", ca=pki.rogue / "ca.crt")
    assert health_status(channel) == "UNAVAILABLE"


def test_a_caller_trusts_only_a_server_of_the_role_it_dials(secure, pki):
    """A registration that names another service's address as a decode worker gets no request: the prefill
    worker's certificate is not a decode worker's (nor the other way round), so the handshake fails."""
    prefill, decode = secure.prefill[0].address, secure.decode[0].address
    assert health_status(tls_channel(prefill, pki, role="router", expect="decode")) == "UNAVAILABLE"
    assert health_status(tls_channel(decode, pki, role="router", expect="prefill")) == "UNAVAILABLE"
    assert health_status(tls_channel(decode, pki, role="router", expect="decode")) == "SERVING"


# Each internal method with a request its allowed role would send, however meaningless: the gate comes first.
CALLS = {
    "/handoff.v1.PrefillWorker/Prefill": ("prefill", lambda ch: list(internal_pb2_grpc.PrefillWorkerStub(ch).Prefill(
        internal_pb2.PrefillRequest(request_id="authz-probe", prompt_ids=[1, 2, 3]), timeout=10))),
    "/handoff.v1.DecodeWorker/Decode": ("decode", lambda ch: list(internal_pb2_grpc.DecodeWorkerStub(ch).Decode(
        internal_pb2.DecodeRequest(request_id="authz-probe", prompt_ids=[1, 2, 3]), timeout=10))),
    "/handoff.v1.DecodeWorker/DecodeSession": ("decode", lambda ch: list(
        internal_pb2_grpc.DecodeWorkerStub(ch).DecodeSession(iter([internal_pb2.SessionRequest(
            start=internal_pb2.DecodeRequest(request_id="authz-probe", prompt_ids=[1, 2, 3]))]), timeout=10))),
    "/handoff.v1.KVTransfer/PushKV": ("kv", lambda ch: internal_pb2_grpc.KVTransferStub(ch).PushKV(
        iter([internal_pb2.KVChunk()]), timeout=10)),
    "/handoff.v1.KVTransfer/CachedPrefix": ("kv", lambda ch: internal_pb2_grpc.KVTransferStub(ch).CachedPrefix(
        internal_pb2.CachedPrefixRequest(block_hashes=[b"x" * 16]), timeout=10)),
}


def test_the_authorization_table_names_every_internal_method():
    """A new RPC is refused to everyone until ALLOWED_ROLES says who may call it; this test makes it say."""
    methods = {f"/{svc.full_name}/{m.name}" for svc in internal_pb2.DESCRIPTOR.services_by_name.values()
               for m in svc.methods}
    assert methods == set(authz.ALLOWED_ROLES) == set(CALLS)
    assert authz.refusal("/handoff.v1.Unknown/Call", pki_tool.Identity("default", "router"), "", None) == \
        "/handoff.v1.Unknown/Call is callable by no role"


def denied_count(method: str, role: str) -> float:
    return REGISTRY.get_sample_value("handoff_authz_denied_total", {"method": method, "caller_role": role}) or 0.0


def test_every_internal_method_refuses_every_other_role_before_doing_anything(secure, pki, caplog):
    """PERMISSION_DENIED naming the role required, logged and counted, for each role but the allowed one; and
    nothing was allocated: no KV block taken, no sequence in either engine, no prefill run, no KV received."""
    ports = internal_ports(secure)
    decode, prefill = secure.decode[0], secure.prefill[0]
    kv_in = REGISTRY.get_sample_value("handoff_kv_transfer_bytes_total",
                                      {"worker": decode.config.worker_id, "direction": "in"}) or 0.0
    prefills = REGISTRY.get_sample_value("handoff_prefill_seconds_count", {"worker": prefill.config.worker_id}) or 0.0
    for method, (port, call) in CALLS.items():
        address, server_role = ports[port]
        (allowed,) = authz.ALLOWED_ROLES[method]
        for role in pki_tool.ROLES:
            before = denied_count(method, role)
            with caplog.at_level(logging.WARNING, logger="common.authz"), \
                    tls_channel(address, pki, role=role, expect=server_role) as channel:
                caplog.clear()
                try:
                    call(channel)
                    code, details = grpc.StatusCode.OK, ""
                except grpc.RpcError as exc:
                    code, details = exc.code(), exc.details()
            if role == allowed:  # past the gate: refused later for what the request lacks, never by role
                assert code != grpc.StatusCode.PERMISSION_DENIED, (method, role, details)
                assert denied_count(method, role) == before
                continue
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, role, code, details)
            assert f"requires role {allowed}" in details and f"role/{role}" in details, details
            assert denied_count(method, role) == before + 1, (method, role)
            assert any("PERMISSION_DENIED" in r.getMessage() and method in r.getMessage() for r in caplog.records)
    assert decode.engine.pool.num_free_blocks == decode.engine.pool.num_blocks
    assert decode.engine.num_active == 0 and prefill.engine.num_active == 0
    assert (REGISTRY.get_sample_value("handoff_kv_transfer_bytes_total",
                                      {"worker": decode.config.worker_id, "direction": "in"}) or 0.0) == kv_in
    assert (REGISTRY.get_sample_value("handoff_prefill_seconds_count",
                                      {"worker": prefill.config.worker_id}) or 0.0) == prefills
    secure.check_integrity()


def test_a_caller_of_another_namespace_or_without_an_identity_is_refused(secure, pki, tmp_path):
    """A certificate from the same CA is not enough: it must name a role of this deployment's namespace."""
    ca = pki_tool.CA.load(pki.folder)
    other = tmp_path / "other"
    other.mkdir()
    pki_tool.write_role_files(other, "router", ca.issue("router", namespace="staging", days=1))
    pki_tool.write_role_files(other, "anonymous", ca.issue_public(("some-client",), days=1))
    address = secure.decode[0].address
    for role, words in (("router", ["namespace default", "spiffe://handoff/staging/role/router"]),
                        ("anonymous", ["requires role router", "not a handoff identity"])):
        with tls_channel(address, pki, role=role, expect="decode", folder=other) as channel:
            with pytest.raises(grpc.RpcError) as info:
                CALLS["/handoff.v1.DecodeWorker/Decode"][1](channel)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
        for word in words:
            assert word in info.value.details(), (word, info.value.details())
    assert denied_count("/handoff.v1.DecodeWorker/Decode", "none") >= 1


def test_router_can_require_client_certificates(secure, pki):
    config = replace(secure.router_config, port=0, health_port=0, redis_url=None,
                     tls=replace(secure.router_config.tls, require_client_cert=True))
    server = RouterServer(config, secure.state).start()
    try:
        address = f"127.0.0.1:{server.port}"
        assert health_status(tls_channel(address, pki)) == "UNAVAILABLE", "no client certificate"
        # With one, the handshake passes and the router answers SERVING once it sees the cluster's workers.
        deadline = time.monotonic() + 10
        while (status := health_status(tls_channel(address, pki, role="operator"))) != "SERVING":
            assert status == "NOT_SERVING" and time.monotonic() < deadline, f"with a client certificate: {status}"
            time.sleep(0.1)
    finally:
        server.stop(grace_s=1)


def test_no_secret_in_logs_statuses_or_metrics(secure, pki, caplog):
    secrets = (*API_KEYS, WRONG_KEY, *(password for _, password in secure.redis_credentials.values()))
    with caplog.at_level(logging.DEBUG):
        statuses = []
        for key in (WRONG_KEY, None):
            with pytest.raises(grpc.RpcError) as info:
                generate(secure.address, pki, key)
            statuses.append(info.value.details())
        with pytest.raises(grpc.RpcError) as info:
            generate(secure.address, pki, API_KEYS[0], max_tokens=-1)  # a validation error, logged
        statuses.append(info.value.details())
        generate(secure.address, pki, API_KEYS[1])
    assert any("UNAUTHENTICATED" in r.getMessage() for r in caplog.records), "the refusals are logged"
    texts = {"caplog": caplog.text, "cluster log since start": "\n".join(secure.records.lines),
             "statuses": "\n".join(statuses), "metrics": generate_latest(REGISTRY).decode(),
             "reprs": repr(secure.router_config) + repr(secure.state) + repr(secure.worker_config)}
    assert "router listening" in texts["cluster log since start"], "the recorder saw the cluster start"
    for where, text in texts.items():
        for secret in secrets:
            assert secret not in text, f"a secret appears in the {where}"
    assert "REDIS_PASSWORD" not in os.environ, "the cluster's Redis credentials never went through the environment"
