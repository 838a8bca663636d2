"""A drain lets the streams a worker holds finish where they run, however long they take: the worker
leaves the registry at once (no new work comes) but keeps its KV leases until it has drained, so the
routers' lease keepers renew them and do not fail the streams over. It used to delete its leases when
it left the registry: after the lease TTL every router declared them lost and moved the streams the
drain meant to let finish (the drain test in tests/faults passed because its requests were short)."""
from __future__ import annotations

import threading
import time

import grpc

from protos import handoff_pb2, handoff_pb2_grpc
from router.cluster import Cluster
from router.config import RouterConfig
from tests.support.cluster import stream_in_background

LEASE_TTL_S = 3.0  # the least the router allows (its heartbeat TTL): a lease is lost 3 s after its worker left


def test_a_drain_lets_a_stream_longer_than_the_lease_ttl_finish_where_it_runs():
    c = Cluster(num_prefill=1, num_decode=1, kv_memory_gib=0.25, threads=1,
                router=RouterConfig(lease_ttl_s=LEASE_TTL_S)).start()
    try:
        d = c.decode[0]
        stub = handoff_pb2_grpc.RouterStub(grpc.insecure_channel(c.address))
        request = dict(prompt="Once upon a time", temperature=0.0, ignore_eos=True)
        t0 = time.monotonic()
        list(stub.Generate(handoff_pb2.GenerateRequest(max_tokens=64, **request), timeout=120))
        rate = 64 / (time.monotonic() - t0)
        # Long enough to stream for 4 lease TTLs after the drain starts, within the pool.
        pool_tokens = d.engine.pool.num_blocks * d.engine.pool.block_size - 64
        max_tokens = int(min(pool_tokens, max(400, rate * 6 * LEASE_TTL_S)))
        rid = f"drained-{time.monotonic_ns()}"
        got, client = stream_in_background(
            stub, handoff_pb2.GenerateRequest(max_tokens=max_tokens, request_id=rid, **request))
        deadline = time.monotonic() + 60
        while len(got["ids"]) < 8:
            assert time.monotonic() < deadline and client.is_alive(), got.get("error")
            time.sleep(0.01)
        t_drain = time.monotonic()
        drainer = threading.Thread(target=d.stop, kwargs=dict(drain_timeout_s=300))
        drainer.start()
        client.join(timeout=300)
        drainer.join(timeout=60)
        assert "error" not in got, f"the drained stream failed: {got['error']}"
        assert len(got["ids"]) == max_tokens
        assert got["times"][-1] - t_drain > 2 * LEASE_TTL_S, "the stream ended too soon to outlive a lease TTL"
        record = c.state.get_request(rid)
        assert record["state"] == "finished" and int(record["attempt"]) == 1, \
            "a drained stream should finish where it ran, not fail over"
        assert c.state.get_worker(d.config.worker_id) is None, "the drained worker is still registered"
        assert c.state.reservations(d.config.worker_id) == {}, "the drained worker left leases behind"
    finally:
        c.stop()
