"""Redis unreachable for longer than a router's registration TTL (a partition, Redis moved or restarting
with its data): nobody can heartbeat while it lasts, so when it ends every router looks expired, and the
first process back reaps the others. The reaper used to end a live router's in-flight records then
(`failed`, terminal, so they stayed wrong while the client got its whole answer) and delete their
leases, so their blocks could be promised twice until the lease keeper reserved them again. A
registration now runs down only while Redis answers someone: an outage is not counted against it.

An in-process cluster (real workers and router over gRPC) and a real Redis, reached through TCP relays
that are cut (tests/support/tcp_proxy.py): the workers' path comes back first, the router's later, as
reconnects do. (A Redis paused by SIGSTOP does not show it: the heartbeats sent meanwhile, timed out on
the client, still run when it resumes, before anyone's reaping.)"""
from __future__ import annotations

import time
from dataclasses import replace

import grpc

from common.redis_server import EmbeddedRedis, connect
from common.state import StateStore
from protos import handoff_pb2, handoff_pb2_grpc
from router.cluster import Cluster
from router.server import RouterServer
from tests.support.cluster import stream_in_background, wait_idle
from tests.support.tcp_proxy import CutProxy

OUTAGE_S = 5.0  # longer than the router's heartbeat TTL
ROUTER_LATE_S = 1.5  # the router's path comes back this much after the workers' (three of their beats)


def test_an_outage_longer_than_the_router_ttl_reaps_no_live_router():
    redis = EmbeddedRedis().start()
    workers_path, router_path = CutProxy(redis.port).start(), CutProxy(redis.port).start()
    direct, _ = connect(redis.url)
    state = StateStore(direct)
    c = Cluster(num_prefill=1, num_decode=1, kv_memory_gib=0.25, threads=1, redis_url=workers_path.url).start()
    try:
        c.router.stop(grace_s=1)  # the router reaches Redis on a path of its own
        client, _ = connect(router_path.url)
        c.router = RouterServer(replace(c.router_config, redis_url=router_path.url), StateStore(client)).start()
        d = c.decode[0]
        stub = handoff_pb2_grpc.RouterStub(grpc.insecure_channel(c.address))
        request = dict(prompt="Once upon a time", temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        list(stub.Generate(handoff_pb2.GenerateRequest(max_tokens=64, **request), timeout=120))
        rate = 64 / (time.monotonic() - t0)
        pool_tokens = d.engine.pool.num_blocks * d.engine.pool.block_size - 64
        # Streams through the outage and well past it.
        max_tokens = int(min(pool_tokens, max(400, rate * 3 * (OUTAGE_S + ROUTER_LATE_S))))
        rid = f"outage-{time.monotonic_ns()}"
        got, reader = stream_in_background(
            stub, handoff_pb2.GenerateRequest(max_tokens=max_tokens, request_id=rid, **request))
        deadline = time.monotonic() + 60
        while len(got["ids"]) < 8 or state.get_request(rid)["state"] != "decoding":
            assert time.monotonic() < deadline and reader.is_alive(), got.get("error")
            time.sleep(0.01)
        workers_path.cut()
        router_path.cut()
        time.sleep(OUTAGE_S)
        workers_path.mend()
        deadline = time.monotonic() + 10
        while not all(w.registration.current for w in c.decode + c.prefill):  # back, and reaping again
            assert time.monotonic() < deadline, "the workers did not re-register once Redis was back"
            time.sleep(0.02)
        time.sleep(ROUTER_LATE_S)
        t_back = time.monotonic()
        record = state.get_request(rid)
        assert record["state"] == "decoding", f"a live router's request was reaped: {record.get('error')}"
        router_path.mend()
        reader.join(timeout=300)
        assert "error" not in got, f"the stream failed: {got['error']}"
        assert len(got["ids"]) == max_tokens
        assert got["times"][-1] > t_back, "the stream ended before the router was back: nothing was tested"
        record = state.get_request(rid)
        assert record["state"] == "finished" and int(record["attempt"]) == 1, record
        wait_idle(c)
    finally:
        c.stop()
        workers_path.stop()
        router_path.stop()
        redis.stop()
