"""A decode worker's engine thread fails mid-stream, in an in-process cluster (one prefill worker, two decode
workers, the default dtype), with greedy and seeded sampled requests streaming: in a decode step (the model
raises, as a CUDA error or an out-of-memory would) or while the thread drains its inbox (outside any step).

The worker takes itself out at once: health NOT_SERVING (liveness too, so Kubernetes restarts it) and out
of the Redis registry, with its leases. Its requests end with the engine's error on their decode sessions,
charged to it (never to the prefill worker that reported nothing), and the router fails them over to the
other decode worker, where they finish with exactly the fault-free tokens (invariant 4 (same tokens), after
a failover). Nothing is left held anywhere (invariant 2 (every KV block freed)).

The bound (invariant 6 (a stated worst-case bound): a cut-off worker stops getting work): NOT_SERVING and out
of the registry within heartbeat_ttl_s (2 s) of the failure. The worker deregisters as the engine fails, so
it is out as soon as Redis answers; were Redis unreachable then, its entry would lapse within
heartbeat_ttl_s, since nothing renews it any more. Run with -s for the measured figures.

HANDOFF_TEST_DEVICE=cuda runs the workers on the GPU (`make gpu-check`).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common import grpc_common, metrics
from common.worker import WorkerConfig
from decode_svc.worker import DecodeWorker
from router.cluster import Cluster
from tests.support.cluster import wait_idle
from tests.support.faults import SPECS, join, longest_stall, report, run_many, run_one, wait_streaming_on
from tests.engine.test_engine_failures import Fault

pytestmark = [pytest.mark.timeout(900)]

DEVICE = os.environ.get("HANDOFF_TEST_DEVICE", "cpu")
HEARTBEAT_TTL_S = WorkerConfig.heartbeat_ttl_s
CLIENT_TIMEOUT_S = 120  # a request left hanging by a dead engine ends here, and fails the test
TOPOLOGY = "1P+2D in-process"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=2, kv_memory_gib=0.06, threads=1, device=DEVICE).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(cluster) -> dict[str, list[int]]:
    threads, results = run_many(cluster.address, SPECS, "ref", timeout=CLIENT_TIMEOUT_S)
    join(threads)
    for r in results:
        assert r.completed and len(r.ids) == r.spec.max_tokens, (r.rid, r.error)
    wait_idle(cluster)
    return {r.spec.name: r.ids for r in results}


def health(address: str, service: str = "") -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def retries(role: str) -> float:
    return metrics.RETRIES.labels(role)._value.get()


def replace_worker(cluster: Cluster, i: int) -> None:
    """decode-i again, a fresh process as a restarted pod would be (new engine, new epoch)."""
    old = cluster.decode[i]
    old.stop(drain_timeout_s=1)
    cfg = replace(cluster.worker_config, role="decode", worker_id=old.config.worker_id)
    new = DecodeWorker(cfg, cluster.state, model=old.model, tokenizer=old.tokenizer).start()
    assert new.registration.registered.wait(10)
    cluster.decode[i] = new


@pytest.mark.parametrize("where", ["decode step", "inbox drain"])
def test_a_failed_engine_thread_takes_its_worker_out_and_its_requests_fail_over(cluster, reference, where):
    victim = cluster.decode[0]
    wid, address = victim.config.worker_id, victim.address
    fault = Fault(RuntimeError("CUDA error: an illegal memory access was encountered (injected)"))
    engine = victim.engine
    if where == "decode step":
        engine.runner.decode = fault.wrap(engine.runner.decode)
    else:  # the drain at the top of every step, outside the step's work
        engine._drain_inbox = fault.wrap(engine._drain_inbox)
    before = {role: retries(role) for role in ("decode", "prefill")}
    try:
        progress: dict[str, int] = {}
        threads, results = run_many(cluster.address, SPECS, f"engine-{where.split()[0]}", progress=progress,
                                    timeout=CLIENT_TIMEOUT_S)
        wait_streaming_on(cluster, progress, wid, 4)
        fault.arm()
        t_not_serving = t_gone = None
        watch_until = time.monotonic() + 30  # far past the bound: a worker that stays in is measured as such
        while (t_not_serving is None or t_gone is None) and time.monotonic() < watch_until:
            # Each time is taken once its check has answered: an upper bound on when the change happened.
            if t_not_serving is None and health(address) == health_pb2.HealthCheckResponse.NOT_SERVING:
                t_not_serving = time.monotonic()
            if t_gone is None and cluster.state.get_worker(wid) is None:
                t_gone = time.monotonic()
            time.sleep(0.005)
        join(threads, timeout_s=CLIENT_TIMEOUT_S + 60)
        after = run_one(cluster.address, SPECS[0], f"after-{time.monotonic_ns()}", timeout=CLIENT_TIMEOUT_S)
        wait_idle(cluster)  # every pool all free (the failed worker's too), nothing parked, no lease left

        records = {r.rid: cluster.state.get_request(r.rid) for r in results}
        moved = [r for r in results if int(records[r.rid].get("attempt", 1)) > 1]
        fired = fault.fired_at
        not_serving_s = None if t_not_serving is None or fired is None else t_not_serving - fired
        gone_s = None if t_gone is None or fired is None else t_gone - fired
        for kind in ("greedy", "sampled"):
            mine = [r for r in results if r.spec.kind == kind]
            report(fault=f"engine thread fails ({where}) on {wid}", topology=TOPOLOGY, device=DEVICE, kind=kind,
                   streams=len(mine), completed=sum(r.completed for r in mine),
                   identical=sum(r.completed and r.ids == reference[r.spec.name] for r in mine),
                   failed_over=sum(r in moved for r in mine),
                   not_serving_after_s=None if not_serving_s is None else round(not_serving_s, 3),
                   deregistered_after_s=None if gone_s is None else round(gone_s, 3),
                   heartbeat_ttl_s=HEARTBEAT_TTL_S,
                   longest_stall_s=round(longest_stall(mine, fired or time.monotonic()), 3))

        assert fired is not None, "the injected failure never ran: no step reached it"
        assert not_serving_s is not None and not_serving_s <= HEARTBEAT_TTL_S, \
            f"{wid} said SERVING for {not_serving_s or 'more than 30'} s after its engine failed " \
            f"(bound {HEARTBEAT_TTL_S} s)"
        assert gone_s is not None and gone_s <= HEARTBEAT_TTL_S, \
            f"{wid} stayed registered {gone_s or 'more than 30'} s after its engine failed " \
            f"(bound {HEARTBEAT_TTL_S} s)"
        assert health(address, grpc_common.LIVENESS) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert victim.engine_failed.is_set() and victim.engine.failure is not None
        for r in results:
            assert r.completed, f"{r.rid}: {r.error}"
            assert r.ids == reference[r.spec.name], f"{r.rid} ({r.spec.kind}) differs from the fault-free run"
        assert moved, "no request was failed over: did the failure land on a worker with streams?"
        assert all(records[r.rid]["decode_worker"] != wid for r in moved)
        # Charged to the decode worker that failed: the one prefill worker was never excluded (a retry
        # without it could not have been served at all).
        assert retries("decode") > before["decode"] and retries("prefill") == before["prefill"]
        assert after.completed and after.ids == reference[SPECS[0].name], after.error
        assert cluster.state.get_request(after.rid)["decode_worker"] != wid
    finally:
        replace_worker(cluster, 0)
