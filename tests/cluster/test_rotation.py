"""Credentials rotated without a restart, under load: the CA bundle (an overlap period, then the old CA removed),
every leaf certificate, and the API keys. No request fails; a peer still on a removed certificate is refused.

The cluster is the default topology with security on (1 prefill + 1 decode + router, per-role certificates,
Redis ACL users, API keys); its services read their files from one folder, which the test rewrites as a
Secret volume update would. Files are looked at every 0.1 s here (1 s in a service).
"""
from __future__ import annotations

import os
import signal
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from common import grpc_common, pki as pki_tool, security
from common.security import TLSConfig
from protos import handoff_pb2, handoff_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.cluster import Cluster
from router.config import RouterConfig

OLD_KEY, NEW_KEY = "rotation-key-old-0123", "rotation-key-new-4567"
INTERVAL_S = 0.1


def write_bundle(folder: Path, *cas: pki_tool.CA) -> None:
    pki_tool.write_private(folder / "ca.crt", b"".join(ca.cert_pem for ca in cas))


def reissue(folder: Path, ca: pki_tool.CA) -> None:
    """Every leaf from `ca`, each key before its certificate (a reader may see the pair mismatched for a
    moment: it keeps what it has and looks again)."""
    for role in ("router", "prefill", "decode", "operator"):
        issued = ca.issue(role, days=1)
        pki_tool.write_private(folder / f"{role}.key", issued.key_pem)
        pki_tool.write_private(folder / f"{role}.crt", issued.cert_pem)
    public = ca.issue_public(days=1)
    pki_tool.write_private(folder / "public.key", public.key_pem)
    pki_tool.write_private(folder / "public.crt", public.cert_pem)


class Load:
    """Requests one after another from two threads, each on a new channel (a new handshake with the router)
    that trusts both CAs, until stopped; every outcome recorded."""

    def __init__(self, address: str, trust: Path, api_key: str):
        self.address, self.trust, self.api_key = address, trust, api_key
        self.done: list[float] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _run(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            tls = TLSConfig(ca=str(self.trust))
            channel = grpc_common.channel(self.address, credentials=security.channel_credentials(tls))
            # Sampled and greedy alternate; long enough that some streams span a reload.
            request = handoff_pb2.GenerateRequest(prompt=f"Count to ten, take {i}-{n}:", max_tokens=12,
                                                  ignore_eos=True, temperature=0.8 if n % 2 else 0.0, seed=n)
            try:
                msgs = list(handoff_pb2_grpc.RouterStub(channel).Generate(
                    request, timeout=60, metadata=[("authorization", f"Bearer {self.api_key}")]))
                assert sum(len(m.token_ids) for m in msgs) == 12
                self.done.append(time.monotonic())
            except grpc.RpcError as exc:
                self.failures.append(f"{exc.code().name}: {exc.details()}")
            except Exception as exc:  # noqa: BLE001 - every failure is the test's finding
                self.failures.append(f"{type(exc).__name__}: {exc}")
            finally:
                channel.close()

    def wait_for(self, num_more: int, timeout_s: float = 60) -> None:
        target = len(self.done) + num_more
        deadline = time.monotonic() + timeout_s
        while len(self.done) < target:
            assert not self.failures, self.failures
            assert time.monotonic() < deadline, f"only {len(self.done)} of {target} requests done"
            time.sleep(0.05)


def files_of(cluster) -> list[security.TLSFiles]:
    return [f for f in security._live_files if f.cfg.cert and str(Path(f.cfg.cert).parent) == cluster.tls_dir]


def wait_reloaded(cluster, generations: dict[int, int], timeout_s: float = 10) -> dict[int, int]:
    """Until every TLSFiles of the cluster has re-read its files since `generations`; the new generations."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = {id(f): f.generation for f in files_of(cluster)}
        if all(now[k] > generations.get(k, -1) for k in now):
            return now
        for f in files_of(cluster):
            f.material()  # a look, as the next handshake would take
        assert time.monotonic() < deadline, "the services did not re-read their TLS files"
        time.sleep(INTERVAL_S)


def health(address: str, tls: TLSConfig, expect: str | None) -> str:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    channel = grpc_common.channel(address, credentials=security.channel_credentials(tls),
                                  server_name=tls.name_for(expect) if expect else None)
    try:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        return exc.code().name
    finally:
        channel.close()


@pytest.fixture
def rotating(tmp_path, monkeypatch):
    monkeypatch.setattr(security, "CHECK_INTERVAL_S", INTERVAL_S)
    live, old = tmp_path / "live", tmp_path / "old"
    ca1 = pki_tool.issue_all(live, days=1)
    pki_tool.issue_all(old, ca=ca1, days=1)  # leaves of the old CA, kept aside: a peer that never rotates
    keys = tmp_path / "api-keys"
    keys.write_text(f"{OLD_KEY}\n")
    cluster = Cluster(num_prefill=1, num_decode=1, dtype="fp32", kv_memory_gib=0.1, threads=1,
                      router=RouterConfig(api_keys_file=str(keys), api_keys=(OLD_KEY,)), tls_dir=str(live))
    cluster.start()
    try:
        yield cluster, live, old, ca1, keys
    finally:
        cluster.stop()


@pytest.mark.timeout(300)
def test_ca_and_leaves_rotate_under_load_without_a_failed_request(rotating, tmp_path):
    cluster, live, old, ca1, _ = rotating
    ca2 = pki_tool.CA.create(name="handoff-ca-2", days=2)
    trust = tmp_path / "client-trust.crt"  # the public client trusts both CAs throughout
    trust.write_bytes(ca1.cert_pem + ca2.cert_pem)
    decode = cluster.decode[0]
    generations = {id(f): f.generation for f in files_of(cluster)}
    assert len(generations) >= 4, "router (internal and public), prefill, decode: each watches its files"
    assert https_health(cluster, ca1.cert_pem) == 200
    with Load(cluster.address, trust, OLD_KEY) as load:
        load.wait_for(4)
        # 1. Overlap: every service trusts both CAs.
        write_bundle(live, ca1, ca2)
        generations = wait_reloaded(cluster, generations)
        load.wait_for(4)
        # 2. Every leaf from the new CA; internal channels and sessions opened from now on present them.
        reissue(live, ca2)
        generations = wait_reloaded(cluster, generations)
        load.wait_for(4)
        # 3. The old CA removed.
        write_bundle(live, ca2)
        wait_reloaded(cluster, generations)
        load.wait_for(6)
    assert not load.failures, load.failures
    # Everything now runs on the new CA: a caller with a new leaf is served ...
    new_router = security.role_tls(live, "router")
    assert health(decode.address, new_router, "decode") == "SERVING"
    # ... a peer still on a removed certificate is refused at the handshake, on every internal port ...
    old_router = TLSConfig(cert=str(old / "router.crt"), key=str(old / "router.key"), ca=str(live / "ca.crt"))
    for address, role in ((decode.address, "decode"), (decode.kv_address, "decode"),
                          (cluster.prefill[0].address, "prefill")):
        assert health(address, old_router, role) == "UNAVAILABLE", address
    channel = grpc_common.channel(decode.address, credentials=security.channel_credentials(old_router),
                                  server_name=old_router.name_for("decode"))
    with channel, pytest.raises(grpc.RpcError) as info:
        list(internal_pb2_grpc.DecodeWorkerStub(channel).Decode(internal_pb2.DecodeRequest(request_id="x"), timeout=5))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    # ... and a client that trusts only the old CA no longer trusts the router, on either public port.
    assert health(cluster.address, TLSConfig(ca=str(old / "ca.crt")), None) == "UNAVAILABLE"
    assert https_health(cluster, ca2.cert_pem) == 200
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        https_health(cluster, ca1.cert_pem)
    cluster.check_integrity()


def https_health(cluster, ca_pem: bytes) -> int:
    """GET /health on the router's HTTPS port, trusting only `ca_pem` (the public certificate names 127.0.0.1)."""
    context = ssl.create_default_context(cadata=ca_pem.decode())
    with urllib.request.urlopen(f"https://127.0.0.1:{cluster.router.http_port}/health", timeout=10,
                                context=context) as resp:
        return resp.status


@pytest.mark.timeout(120)
def test_api_keys_and_a_bad_rotation(rotating):
    cluster, live, _, _, keys = rotating
    trust = live / "ca.crt"

    def status(key: str) -> str:
        channel = grpc_common.channel(cluster.address, credentials=security.channel_credentials(TLSConfig(ca=str(trust))))
        try:
            list(handoff_pb2_grpc.RouterStub(channel).Generate(
                handoff_pb2.GenerateRequest(prompt="Hi", max_tokens=2, ignore_eos=True), timeout=60,
                metadata=[("authorization", f"Bearer {key}")]))
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name
        finally:
            channel.close()

    def until(key: str, want: str) -> None:
        deadline = time.monotonic() + 10
        while (got := status(key)) != want:
            assert time.monotonic() < deadline, f"{key}: {got}, want {want}"
            time.sleep(INTERVAL_S)

    assert status(OLD_KEY) == "OK" and status(NEW_KEY) == "UNAUTHENTICATED"
    keys.write_text(f"{OLD_KEY}\n{NEW_KEY}\n")  # overlap
    until(NEW_KEY, "OK")
    assert status(OLD_KEY) == "OK"
    keys.write_text(f"# rotated\n{NEW_KEY}\n")
    until(OLD_KEY, "UNAUTHENTICATED")
    # A rotation gone wrong keeps what works: an emptied keys file; a certificate without its key, on the
    # prefill worker; on the decode worker, a good pair of another role (the router's, from the same CA).
    keys.write_text("# nothing\n")
    (live / "prefill.crt").write_bytes(pki_tool.CA.create().issue("prefill").cert_pem)
    pki_tool.write_role_files(live, "decode", pki_tool.CA.load(live).issue("router", days=1))
    time.sleep(5 * INTERVAL_S)
    assert status(NEW_KEY) == "OK" and status(OLD_KEY) == "UNAUTHENTICATED"
    router = security.role_tls(live, "router")
    assert health(cluster.decode[0].address, router, "decode") == "SERVING", "still the decode certificate"
    assert health(cluster.prefill[0].address, router, "prefill") == "SERVING"
    assert {f.identity.role for f in files_of(cluster) if f.identity} == {"router", "prefill", "decode"}


def test_sighup_rereads_at_once(tmp_path):
    """With a long look interval, SIGHUP (what `kill -HUP` sends a service) re-reads every file now."""
    folder = tmp_path / "pki"
    ca = pki_tool.issue_all(folder, days=1)
    keys_file = tmp_path / "keys"
    keys_file.write_text("k1\n")
    files = security.TLSFiles(security.role_tls(folder, "decode"), check_interval_s=3600)
    keys = security.APIKeyFile(str(keys_file), check_interval_s=3600)
    old = signal.getsignal(signal.SIGHUP)
    try:
        security.reload_on_sighup()
        pki_tool.write_role_files(folder, "decode", ca.issue("decode", days=1))
        keys_file.write_text("k2\n")
        assert files.generation == 0 and keys.check("k1")  # not looked at yet
        os.kill(os.getpid(), signal.SIGHUP)
        deadline = time.monotonic() + 5
        while files.generation == 0 or keys.check("k1"):
            assert time.monotonic() < deadline, "SIGHUP did not re-read the files"
            time.sleep(0.02)
        assert keys.check("k2") and files.material().cert == (folder / "decode.crt").read_bytes()
    finally:
        signal.signal(signal.SIGHUP, old)
