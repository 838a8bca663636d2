"""After all the fuzzing (runs last, by its name): the cluster serves exactly as before, nothing leaked."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.state import TERMINAL_STATES
from tests.support.cluster import wait_idle
from tests.fuzz.protowire import ACCEPTED_RIDS, INPUTS, OUTCOMES, greedy

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


def test_cluster_survives_fuzzing(cluster, channels, baseline):
    wait_idle(cluster)
    for w in cluster.decode + cluster.prefill:
        assert w.engine._thread.is_alive(), f"{w.config.worker_id}: engine thread died"
        assert w.registration._thread.is_alive(), f"{w.config.worker_id}: heartbeat thread died"
        ch = grpc.insecure_channel(f"127.0.0.1:{w.config.port}")
        try:
            status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status
        finally:
            ch.close()
        assert status == health_pb2.HealthCheckResponse.SERVING, w.config.worker_id
    # Greedy output is exactly what it was before the fuzzing (no poisoned KV blocks, no state left over).
    assert greedy(channels) == baseline
    wait_idle(cluster)
    # Every accepted request reached exactly one terminal state.
    for rid in ACCEPTED_RIDS:
        record = cluster.state.get_request(rid)
        assert record is not None and record["state"] in TERMINAL_STATES, (rid, record)
    # The prefill worker was told to push to many addresses: it must not keep a channel open to each.
    p = cluster.prefill[0]
    assert len(p.kv_channels._channels) <= p.kv_channels.max_idle, sorted(p.kv_channels._channels)
    total = sum(INPUTS.values())
    print(f"\nfuzzed inputs: {total} ({dict(INPUTS)}); statuses: {dict(OUTCOMES)}")
    assert total >= 1000, f"only {total} inputs were fuzzed (run the whole module): {dict(INPUTS)}"
