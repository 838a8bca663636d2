"""Redis ACL users per role (common/redis_acl.py) against a real server: each role does its own job, and is
refused what the others do, whether it calls the store's methods or sends the commands itself."""
from __future__ import annotations

import pytest
import redis

from common import redis_acl
from common.redis_server import EmbeddedRedis, connect
from common.state import StatePermissionDenied, StateStore, WorkerInfo

PREFIX = "handoff:"
ROLES = redis_acl.ROLES


def worker(role: str, worker_id: str, epoch: str = "e1") -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role=role, address=f"{worker_id}:1",
                      kv_address=f"{worker_id}:2" if role == "decode" else "", epoch=epoch, model_id="m",
                      total_blocks=20, free_blocks=20, num_running=0, num_waiting=0, started_at=0.0,
                      identity=f"spiffe://handoff/default/role/{role}")


@pytest.fixture(scope="module")
def server():
    with EmbeddedRedis(acl_users={role: f"pw-{role}-5f1c" for role in ROLES}) as srv:
        yield srv


@pytest.fixture
def stores(server):
    """One store per role, each connected as its role's ACL user; the keyspace emptied by the admin first."""
    admin, _ = connect(f"redis://127.0.0.1:{server.port}/0", password=server.password)
    admin.flushall()
    admin.close()
    out = {}
    for role in ROLES:
        user, password = server.credentials(role)
        client, _ = connect(f"redis://127.0.0.1:{server.port}/0", username=user, password=password)
        out[role] = StateStore(client, prefix=PREFIX)
    yield out
    for store in out.values():
        store.client.close()


def denied(call, *args, **kwargs) -> str:
    with pytest.raises(StatePermissionDenied) as info:
        call(*args, **kwargs)
    return str(info.value)


def test_each_role_does_its_own_job(stores):
    """The whole life of a request, each step by the role whose code takes it."""
    router, prefill, decode, operator = (stores[r] for r in ROLES)
    assert {s.client.acl_whoami() for s in stores.values()} == {f"handoff-{r}" for r in ROLES}
    decode.register(worker("decode", "d0"), ttl_s=10)
    prefill.register(worker("prefill", "p0"), ttl_s=10)
    decode.publish_prefixes("d0", [b"\x01" * 16], ttl_s=10, role="decode")
    prefill.publish_prefixes("p0", [b"\x02" * 16], ttl_s=10, role="prefill")
    assert {(w.role, w.worker_id, w.identity) for w in router.list_workers()} == {
        ("decode", "d0", "spiffe://handoff/default/role/decode"), ("prefill", "p0", "spiffe://handoff/default/role/prefill")}
    assert router.cached_prefix_chunks(["p0"], [b"\x02" * 16]) == {"p0": 1}
    # The router: its heartbeat, a record, a reservation, the transitions, and the reaper.
    router.router_heartbeat("router-a", ttl_s=10)
    assert router.create_request("r1", prompt_tokens=3, max_tokens=4, router_id="router-a")
    assert router.reserve("d0", "e1", "r1", 2, ttl_s=10).ok and router.renew("d0", "r1", ttl_s=10)
    assert decode.lease_blocks("d0", "e1", "r1") == 2  # the decode worker checks the lease before taking work
    assert router.transition("r1", "prefilling", prefill_worker="p0")
    assert router.transition("r1", "finished", completion_tokens=4) and router.release("d0", "r1")
    assert router.reap_routers() == {}
    assert router.get_request("r1")["state"] == "finished"
    assert router.deregister_router("router-a") == 0  # a clean stop: nothing left in flight
    # A draining decode worker leaves the registry keeping its leases, and drops what is left once drained.
    assert router.reserve("d0", "e1", "r2", 1, ttl_s=10).ok
    assert decode.deregister("d0", "e1", "decode", keep_leases=True)
    assert decode.lease_blocks("d0", "e1", "r2") == 1 and decode.drop_leases("d0", "e1") == 1
    decode.register(worker("decode", "d0"), ttl_s=10)
    # The operator: reads everything, and alone asks for a drain.
    assert {w.worker_id for w in operator.list_workers()} == {"d0", "p0"}
    assert operator.reservations("d0") == {} and operator.available_blocks("d0") == 20 and operator.redis_time() > 0
    assert operator.recent_request_ids(10) == (["r1"], 1) and operator.get_request("r1")["state"] == "finished"
    operator.request_drain("d0", "e1", ttl_s=30)
    assert decode.drain_requested("d0", "e1") and set(operator.drain_requests()) == {"d0"}
    decode.mark_drained("decode", "d0", "e1", ttl_s=30)  # the worker's answer
    assert operator.drained("decode", "d0", "e1")
    assert decode.deregister("d0", "e1", "decode") and prefill.deregister("p0", "e1", "prefill")
    assert operator.end_drain("d0", "e1", "decode") and operator.drain_requests() == {}
    assert router.list_workers() == []


def test_a_router_cannot_register_deregister_or_drain_a_worker(stores):
    router, decode = stores["router"], stores["decode"]
    decode.register(worker("decode", "d0"), ttl_s=10)
    for role in ("decode", "prefill"):
        assert "refused heartbeat to ACL user handoff-router" in denied(router.register, worker(role, "x"), 10)
    denied(router.deregister, "d0", "e1", "decode")
    denied(router.publish_prefixes, "d0", [b"\x01" * 16], 10, "decode")
    denied(router.request_drain, "d0", "e1", 30)
    denied(router.end_drain, "d0", "e1")
    assert [w.worker_id for w in router.list_workers()] == ["d0"], "the worker is still registered"


def test_a_worker_registers_only_as_its_own_role_and_writes_no_request(stores):
    router, prefill, decode = stores["router"], stores["prefill"], stores["decode"]
    router.router_heartbeat("router-a", ttl_s=10)
    assert router.create_request("r1", prompt_tokens=3, max_tokens=4, router_id="router-a")
    prefill.register(worker("prefill", "p0"), ttl_s=10)
    denied(decode.register, worker("prefill", "p1"), 10)  # a decode user is no prefill worker
    denied(prefill.register, worker("decode", "d1"), 10)  # nor the other way round
    denied(decode.deregister, "p0", "e1", "prefill")
    denied(prefill.publish_prefixes, "d1", [b"\x01" * 16], 10, "decode")
    for store in (prefill, decode):
        denied(store.transition, "r1", "failed", error="forged")  # another router's records
        denied(store.create_request, "r2", prompt_tokens=1, max_tokens=1, router_id="router-a")
        denied(store.router_heartbeat, "router-b", 10)
        denied(store.reap_routers)
        denied(store.request_drain, "p0", "e1", 30)
    denied(prefill.reserve, "d0", "e1", "r1", 1, 10)  # leases are the router's and the decode worker's
    assert router.get_request("r1")["state"] == "queued"
    assert [w.worker_id for w in router.list_workers()] == ["p0"]


def test_a_forged_entry_under_a_role_is_no_registration(stores, server):
    """Even with the admin's keys: an entry whose role field is not its keys' role, or an id in the index
    without an entry, is listed by nobody."""
    admin, _ = connect(f"redis://127.0.0.1:{server.port}/0", password=server.password)
    admin.hset(f"{PREFIX}worker:decode:fake", mapping={"worker_id": "fake", "role": "prefill", "epoch": "e",
                                                        "address": "evil:1"})
    admin.zadd(f"{PREFIX}workers:decode", {"fake": 2**50, "ghost": 2**50})
    admin.close()
    assert stores["router"].list_workers() == [] and stores["router"].get_worker("fake") is None


def test_no_role_runs_admin_commands_or_escapes_through_a_script(stores):
    """What a leaked password cannot do, whichever role it is: flush, reconfigure, list users or keys, shut
    the server down, or run Lua that touches a key the role may not (scripts run with the caller's ACL)."""
    admin_commands = [("FLUSHALL",), ("CONFIG", "GET", "*"), ("ACL", "LIST"), ("KEYS", "*"),
                      ("SHUTDOWN", "NOSAVE"), ("SCRIPT", "FLUSH"), ("MONITOR",), ("CLIENT", "KILL", "TYPE", "normal"),
                      ("MODULE", "LIST"), ("REPLICAOF", "NO", "ONE")]
    for role, store in stores.items():
        for command in admin_commands:
            with pytest.raises(redis.exceptions.NoPermissionError):
                store.client.execute_command(*command)
    escape = "return redis.call('SET', KEYS[1], 'x')"
    for role, key in (("router", "worker:decode:d0"), ("decode", "request:r1"), ("prefill", "drain:d0"),
                      ("router", "drain:d0"), ("operator", "request:r1")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            stores[role].client.eval(escape, 1, f"{PREFIX}{key}")
    inner = "return redis.call('DEL', ARGV[1])"  # the key hidden from EVAL's declaration: checked all the same
    with pytest.raises(redis.exceptions.ResponseError, match="ACL failure in script"):
        stores["router"].client.eval(inner, 0, f"{PREFIX}worker:decode:d0")


def test_rules_are_what_python_m_common_redis_acl_prints(capsys):
    redis_acl.main([])
    lines = capsys.readouterr().out.splitlines()
    assert lines == [f"user handoff-{r} on <password> {redis_acl.rules(r)}" for r in ROLES]
    line = redis_acl.user_line("decode", "secret")
    assert "secret" not in line and " #" in line, "passwords go in as their SHA-256"
