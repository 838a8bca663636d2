"""The fault-injection suite in the configuration users run: real service processes (`python -m ...`),
default dtype (bf16 weights, packed int4 decode), the smallest prefill pool (one worker) and two decode
workers, greedy and seeded sampled requests, real kills.

After each fault: every stream completed with exactly the fault-free tokens (or, where the fault leaves
no way to serve, failed with a clear status), every request reached a terminal state, and nothing is
held: no KV block in use, nothing parked, no lease in Redis. Each test prints one JSON line of figures
per request kind (run with -s to see them); tests/faults/test_faults_two_prefill.py repeats the kills with two
prefill workers.
"""
from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import replace

import grpc
import pytest
import torch

from common.engine.runner import parse_dtype
from common.engine.weights import read_model_config, weights_id_of
from common.kv_wire import ModelFingerprint, encode_kv
from common.state import TERMINAL_STATES, RequestState
from protos import handoff_pb2, internal_pb2_grpc
from tests.support.faults import (
    SPECS,
    Spec,
    assert_terminal,
    fault_free,
    join,
    kill_mid_stream,
    longest_stall,
    report,
    run_many,
    run_one,
    settle_and_measure,
    wait_streaming,
)
from tests.support.proc_cluster import LEASE_TTL_S, ProcCluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

TOPOLOGY = "1P+2D"


@pytest.fixture(scope="module")
def procs(tmp_path_factory):
    c = ProcCluster(tmp_path_factory.mktemp("procs"), num_prefill=1, num_decode=2).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def reference(procs):
    return fault_free(procs)


# --------------------------------------------------------------------------- kills

@pytest.mark.parametrize("victim", ["decode-0", "decode-1", "prefill-0"])
def test_kill_mid_stream(procs, reference, victim):
    kill_mid_stream(procs, reference, victim, TOPOLOGY)


def test_kill_decode_worker_while_streamed_pushes_are_in_flight(procs):
    """Prompts of three prefill chunks stream their KV while they prefill; kill -9 a decode worker that
    such a push is going to: the prefill worker ends that Prefill call at once, charged to the decode
    worker, and the router retries on the other one. Every stream completes with the fault-free tokens
    and nothing is left held."""
    words = "and then it walked on through the long grass while the sun went down "
    specs = [Spec(f"{kind}-long-{a}", f"The story of a {a} who " + words * 40, kind, max_tokens=8)
             for kind in ("greedy", "sampled") for a in ("cat", "dog")]
    reference = fault_free(procs, specs)
    victim = "decode-0"
    threads, results = run_many(procs.router_address, specs, "kill-streamed")
    deadline = time.monotonic() + 60

    def prefilling_for_victim() -> list[str]:
        found = []
        for rid in procs.state.reservations(victim):
            record = procs.state.get_request(rid)
            if record and record["state"] == RequestState.PREFILLING and record.get("prefill_worker"):
                found.append(rid)
        return found

    # Kill while a Prefill headed for the victim is still running: a fixed delay after it started overshot
    # on fast hosts (the prefills were done and the kill only cut decode steps), so the target is checked
    # again just before the kill and the search goes on if its prefill ended in between.
    target = None
    while target is None:
        assert time.monotonic() < deadline, "no prefill for the victim was caught in progress"
        candidates = prefilling_for_victim()
        if candidates:
            time.sleep(0.05)  # into its prefill: the push is open and its first segments are on their way
            still = set(prefilling_for_victim())
            target = next((rid for rid in candidates if rid in still), None)
        if target is None:
            time.sleep(0.01)
    t_kill = procs.kill(victim)
    join(threads)
    procs.restart(victim)
    left = settle_and_measure(procs)
    assert_terminal(procs, results)
    moved = [r for r in results if int(procs.state.get_request(r.rid).get("attempt", 1)) > 1]
    report(fault=f"kill -9 {victim} during streamed pushes", topology=TOPOLOGY, streams=len(results),
           completed=sum(r.completed for r in results),
           identical=sum(r.completed and r.ids == reference[r.spec.name] for r in results),
           failed_over=len(moved), all_done_after_kill_s=round(max(r.times[-1] for r in results) - t_kill, 3),
           leaked_blocks=left["blocks_used"], parked_or_running=left["sequences"], leases_left=left["leases"])
    for r in results:
        assert r.completed, f"{r.rid}: {r.error}"
        assert r.ids == reference[r.spec.name], f"{r.rid} ({r.spec.kind}) differs from the fault-free run"
    assert target in {r.rid for r in moved}, "the request whose push was cut did not move to the other worker"
    assert not any(left.values()), left


def test_kill_router_mid_stream_ends_every_record_within_the_lease_ttl(procs):
    """A router that dies leaves no record in flight: whoever beats next (a worker, another router)
    reaps its requests once its registration lapses, and releases their leases."""
    progress: dict[str, int] = {}
    threads, results = run_many(procs.router_address, SPECS[:8], "kill-router", progress=progress)
    wait_streaming(progress, 8, 3)
    t_kill = procs.kill("router")
    join(threads)
    pending = {r.rid for r in results}
    while pending and time.monotonic() < t_kill + 3 * LEASE_TTL_S:
        pending = {rid for rid in pending if procs.state.get_request(rid)["state"] not in TERMINAL_STATES}
        time.sleep(0.05)
    ended_s = time.monotonic() - t_kill
    procs.restart("router")
    left = settle_and_measure(procs)
    records = [procs.state.get_request(r.rid) for r in results]
    report(fault="kill -9 router", topology=TOPOLOGY, streams=len(results),
           clients_unavailable=sum(r.error is not None and r.error[0] == grpc.StatusCode.UNAVAILABLE
                                   for r in results),
           records_terminal=sum(rec["state"] in TERMINAL_STATES for rec in records), all_terminal_after_s=round(ended_s, 3),
           lease_ttl_s=LEASE_TTL_S, leaked_blocks=left["blocks_used"], parked_or_running=left["sequences"],
           leases_left=left["leases"])
    assert not pending, f"records still in flight {3 * LEASE_TTL_S:.0f} s after the router died: {pending}"
    assert ended_s <= LEASE_TTL_S, f"the dead router's records took {ended_s:.2f} s to end (lease TTL {LEASE_TTL_S} s)"
    failed = [rec for rec in records if rec["state"] == RequestState.FAILED]
    assert failed and all("router" in rec["error"] for rec in failed), records
    assert not any(left.values()), left


# --------------------------------------------------------------------------- Redis

def _big_spec(procs) -> Spec:
    """A request whose reservation takes a whole decode worker's pool."""
    info = procs.state.get_worker("decode-0")
    return Spec("greedy-cat", "The story of a cat who", "greedy", max_tokens=info.total_blocks * info.block_size - 16)


def _num_queued(procs, tag: str) -> int:
    """Requests of run_many's `tag` whose record says queued (waiting for a decode reservation)."""
    ids, _ = procs.state.recent_request_ids(200)
    records = [procs.state.get_request(i) for i in ids if i.startswith(f"{tag}-")]
    return sum(r is not None and r["state"] == RequestState.QUEUED for r in records)


def test_redis_down_while_requests_wait_for_capacity(procs):
    """Requests waiting for decode capacity when Redis goes away get UNAVAILABLE that says so (never
    INTERNAL), streams already decoding go on, and service resumes by itself once Redis is back."""
    hogs, hog_results = run_many(procs.router_address, [_big_spec(procs)] * 2, "hog", timeout=60, cancel_after_s=20)
    deadline = time.monotonic() + 30
    while sum(len(procs.state.reservations(n)) for n in ("decode-0", "decode-1")) < 2:
        assert time.monotonic() < deadline, "the two large requests did not reserve"
        time.sleep(0.05)
    waiting, results = run_many(procs.router_address, SPECS[:4], "wait", timeout=60)
    # Recorded, and queued for room no decode worker has: they are in the reservation loop.
    deadline = time.monotonic() + 30
    while _num_queued(procs, "wait") < len(waiting):
        assert time.monotonic() < deadline, "the four requests did not reach the reservation loop"
        time.sleep(0.05)
    t_down = time.monotonic()
    procs.redis.stop()
    join(waiting)
    failed_s = max(r.times[-1] if r.times else time.monotonic() for r in results) - t_down
    procs.redis.start()
    recovered_s = _recover(procs, t_down)
    for t in hogs:
        t.join(timeout=60)
    left = settle_and_measure(procs)
    report(fault="Redis down during reservation", topology=TOPOLOGY, waiting=len(results),
           unavailable=sum(r.error is not None and r.error[0] == grpc.StatusCode.UNAVAILABLE for r in results),
           failed_within_s=round(failed_s, 3), hogs_streamed=[len(r.ids) for r in hog_results],
           recovered_after_s=round(recovered_s, 3), leaked_blocks=left["blocks_used"],
           parked_or_running=left["sequences"], leases_left=left["leases"])
    for r in results:
        assert r.error is not None and r.error[0] == grpc.StatusCode.UNAVAILABLE, (r.rid, r.error)
        assert "Redis" in r.error[1], r.error
    assert all(len(r.ids) > 0 for r in hog_results), "streams already decoding stopped with Redis"
    assert not any(left.values()), left


def test_redis_down_during_failover(procs):
    """Decode worker killed while Redis is down: the streams it held cannot be placed again and fail with
    UNAVAILABLE (never INTERNAL); the others finish with the fault-free tokens; all resumes afterwards."""
    # Long enough that decode-0's streams are still running when Redis has stopped and it is killed: 32
    # tokens a stream could all be out by then on a host that decodes fast.
    specs = [replace(s, max_tokens=160) for s in SPECS]
    reference = fault_free(procs, specs)
    progress: dict[str, int] = {}
    threads, results = run_many(procs.router_address, specs, "redis-failover", progress=progress)
    wait_streaming(progress, len(specs), 4)
    t_down = time.monotonic()
    procs.redis.stop()
    procs.kill("decode-0")
    join(threads)
    procs.redis.start()
    procs.restart("decode-0")
    recovered_s = _recover(procs, t_down)
    left = settle_and_measure(procs)
    unavailable = [r for r in results if r.error is not None and r.error[0] == grpc.StatusCode.UNAVAILABLE]
    report(fault="Redis down + kill -9 decode-0", topology=TOPOLOGY, streams=len(results),
           completed=sum(r.completed for r in results),
           identical=sum(r.completed and r.ids == reference[r.spec.name] for r in results),
           unavailable=len(unavailable), recovered_after_s=round(recovered_s, 3),
           leaked_blocks=left["blocks_used"], parked_or_running=left["sequences"], leases_left=left["leases"])
    for r in results:
        if r.completed:
            assert r.ids == reference[r.spec.name], r.rid
        else:
            assert r in unavailable, (r.rid, r.error)
    assert unavailable, "no stream was on the killed worker"
    assert not any(left.values()), left


def test_redis_restart_mid_stream(procs, reference):
    """Redis restarts empty: the leases are reserved again, the workers re-register, every stream
    finishes with the fault-free tokens and nothing is left held."""
    progress: dict[str, int] = {}
    threads, results = run_many(procs.router_address, SPECS, "redis-restart", progress=progress)
    wait_streaming(progress, len(SPECS), 3)
    t_restart = time.monotonic()
    procs.redis.restart()
    join(threads)
    recovered_s = _recover(procs, t_restart)
    left = settle_and_measure(procs)
    report(fault="Redis restart (data lost)", topology=TOPOLOGY, streams=len(results),
           completed=sum(r.completed for r in results),
           identical=sum(r.completed and r.ids == reference[r.spec.name] for r in results),
           longest_stall_s=round(longest_stall(results, t_restart), 3), recovered_after_s=round(recovered_s, 3),
           leaked_blocks=left["blocks_used"], parked_or_running=left["sequences"], leases_left=left["leases"])
    for r in results:
        assert r.completed, (r.rid, r.error)
        assert r.ids == reference[r.spec.name], r.rid
    assert not any(left.values()), left


def _recover(procs, since: float, timeout_s: float = 30) -> float:
    """Seconds from `since` until a new request succeeds, no process restarted for it."""
    deadline = time.monotonic() + timeout_s
    while True:
        r = run_one(procs.router_address, replace(SPECS[0], max_tokens=2), f"recover-{time.monotonic_ns()}")
        if r.completed:
            return time.monotonic() - since
        assert r.error[0] == grpc.StatusCode.UNAVAILABLE, r.error
        assert time.monotonic() < deadline, f"service did not resume: {r.error}"
        time.sleep(0.2)


# --------------------------------------------------------------------------- KV nobody claims, leases

def test_requests_that_end_at_their_first_token_push_no_kv(procs, reference):
    """200 requests that end with their first token (max_tokens 1, or a stop token): the prefill
    worker pushes nothing, so nothing is parked anywhere for a Decode call that will never come."""
    specs = []
    for i in range(200):
        base = SPECS[i % len(SPECS)]
        first = reference[base.name][0]
        specs.append(replace(base, max_tokens=1) if i % 2 else replace(base, stop_token_ids=(first,)))
    results = []
    for start in range(0, len(specs), 40):
        threads, batch = run_many(procs.router_address, specs[start:start + 40], "first-only")
        join(threads)
        results += batch
    left = settle_and_measure(procs)
    pushed = sum(any(s == RequestState.TRANSFERRING for s, _ in procs.state.get_request(r.rid)["history"])
                 for r in results)
    report(fault="200 requests ending at the first token", topology=TOPOLOGY, requests=len(results),
           completed=sum(r.completed for r in results), kv_pushed=pushed, parked_or_running=left["sequences"],
           leaked_blocks=left["blocks_used"], leases_left=left["leases"])
    for r in results:
        assert r.completed, (r.rid, r.error)
        if r.spec.max_tokens == 1:
            assert r.ids == reference[r.spec.name][:1] and r.finish == handoff_pb2.FINISH_REASON_LENGTH
        else:
            assert r.ids == [] and r.finish == handoff_pb2.FINISH_REASON_STOP  # the stop token is not streamed
    assert pushed == 0
    assert not any(left.values()), left


def test_leases_are_held_from_reservation_to_the_end(tmp_path):
    """Requests queued behind long prompts on the one prefill worker wait longer than the lease TTL
    before they decode; their leases must stay in Redis the whole time (else Redis could promise the
    same blocks twice) and go when they end."""
    # Its own cluster with 0.1 GiB of KV a decode worker (the module's has 0.05): room to queue enough long
    # prompts that the last waits past the TTL however fast this host prefills.
    procs = ProcCluster(tmp_path, num_prefill=1, num_decode=2, kv_memory_gib=0.1).start()
    try:
        _check_leases_held(procs)
    finally:
        procs.stop()


def _check_leases_held(procs: ProcCluster) -> None:
    words = "and then it walked on through the long grass while the sun went down "

    def story(i: int) -> str:  # distinct from its first block on, so that no prompt hits another's cached KV
        return f"The story of animal number {i} who " + words * 40

    # How long one such prompt holds the one prefill worker on this host, from its request record: queue
    # enough of them that the last waits twice the TTL (a fixed six waited 3.95 s of a 4 s TTL on a fast
    # EPYC, 14.8 s where a prefill took 2.2 s), at least three, as many as the decode workers can reserve.
    probe = run_one(procs.router_address, Spec("greedy-probe", story(0), "greedy", max_tokens=4),
                    f"lease-probe-{time.monotonic_ns()}")
    assert probe.completed, probe.error
    record = procs.state.get_request(probe.rid)
    prefill_s, prompt_tokens = float(record["prefill_s"]), int(record["prompt_tokens"])
    workers = [procs.state.get_worker(n) for n in ("decode-0", "decode-1")]
    blocks_each = -(-(prompt_tokens + 4) // workers[0].block_size)
    fit = sum(w.total_blocks // blocks_each for w in workers)
    count = min(fit, max(3, math.ceil(2 * LEASE_TTL_S / prefill_s) + 1))
    specs = [Spec(f"greedy-lease{i}", story(i), "greedy", max_tokens=4) for i in range(1, count + 1)]
    threads, results = run_many(procs.router_address, specs, "lease")
    first_seen: dict[str, float] = {}
    gaps: dict[str, list[float]] = {}  # rid -> times its lease was missing while it was in flight
    decoding_at: dict[str, float] = {}
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        held = {rid for n in ("decode-0", "decode-1") for rid in procs.state.reservations(n)}
        for rid in held:
            first_seen.setdefault(rid, now)
        for rid, t0 in first_seen.items():
            record = procs.state.get_request(rid)
            if record["state"] in TERMINAL_STATES:
                continue
            if record["state"] == RequestState.DECODING:
                decoding_at.setdefault(rid, now)
            if rid not in held:
                gaps.setdefault(rid, []).append(now - t0)
        time.sleep(0.1)
    join(threads)
    left = settle_and_measure(procs)
    longest_wait = max(decoding_at.get(rid, time.monotonic()) - t0 for rid, t0 in first_seen.items())
    report(fault="waits longer than the lease TTL", topology=TOPOLOGY, requests=len(results),
           completed=sum(r.completed for r in results), lease_ttl_s=LEASE_TTL_S, prompt_tokens=prompt_tokens,
           prefill_s=round(prefill_s, 3), longest_wait_before_decode_s=round(longest_wait, 3),
           requests_that_lost_their_lease=len(gaps), leases_left=left["leases"], leaked_blocks=left["blocks_used"])
    assert len(first_seen) == len(specs)
    # The check means something only if some request waited longer than its lease lives.
    assert longest_wait > LEASE_TTL_S, (
        f"no request waited longer than the lease TTL ({longest_wait:.1f} s of {LEASE_TTL_S} s) with {count} "
        f"prompts of {prompt_tokens} tokens queued ({prefill_s:.2f} s of prefill each; {fit} fit the decode "
        "pools): on a host this fast, give the test's cluster more KV (kv_memory_gib)")
    assert not gaps, f"leases missing while their requests were in flight: {gaps}"
    for r in results:
        assert r.completed, (r.rid, r.error)
    assert not any(left.values()), left


# --------------------------------------------------------------------------- pushes, cancels, drain

def test_kv_push_cut_halfway(procs, reference):
    name = "decode-1"
    info = procs.state.get_worker(name)
    cfg = read_model_config("smollm2")
    dtype = parse_dtype("auto")  # what the workers resolved, on this same machine
    fp = ModelFingerprint.for_model(cfg, weights_id=weights_id_of("smollm2"), block_size=info.block_size, dtype=dtype)
    kv = torch.randn(cfg.num_layers, 2, 600, cfg.num_kv_heads, cfg.head_dim).to(dtype)
    rid = f"cut-push-{time.monotonic_ns()}"
    assert procs.state.reserve(name, info.epoch, rid, -(-600 // info.block_size), ttl_s=30).ok
    chunks = list(encode_kv(kv, request_id=rid, target_worker_id=name, target_epoch=info.epoch, fingerprint=fp))
    sent = threading.Event()

    def half():
        yield from chunks[:len(chunks) // 2]
        sent.set()
        time.sleep(30)  # the sender "dies" here: the test cancels the call
        yield chunks[-1]

    with grpc.insecure_channel(info.kv_address) as ch:
        future = internal_pb2_grpc.KVTransferStub(ch).PushKV.future(half(), timeout=60)
        assert sent.wait(30)
        t_cut = time.monotonic()
        future.cancel()
    procs.state.release(name, rid)
    left = settle_and_measure(procs)
    r = run_one(procs.router_address, SPECS[0], f"cut-after-{time.monotonic_ns()}")
    assert r.completed and r.ids == reference[SPECS[0].name]
    report(fault="KV push cut halfway", topology=TOPOLOGY, chunks_sent=len(chunks) // 2, chunks_total=len(chunks),
           freed_within_s=round(time.monotonic() - t_cut, 3), leaked_blocks=left["blocks_used"],
           parked_or_running=left["sequences"])
    assert not any(left.values()), left


def test_two_hundred_requests_with_random_cancels(procs, reference):
    rng = random.Random(7)
    specs, cancel_at = [], []
    for i in range(200):
        specs.append(replace(SPECS[i % len(SPECS)], max_tokens=12))
        cancel_at.append(rng.uniform(0.0, 1.5) if rng.random() < 0.2 else None)
    results = []
    for start in range(0, 200, 32):  # 32 client streams at a time
        batch = [None] * len(specs[start:start + 32])

        def work(i, spec, when):
            batch[i] = run_one(procs.router_address, spec, f"c200-{start + i}-{time.monotonic_ns()}",
                               cancel_after_s=when)

        threads = [threading.Thread(target=work, args=(i, s, cancel_at[start + i]))
                   for i, s in enumerate(specs[start:start + 32])]
        for t in threads:
            t.start()
        join(threads)
        results += batch
    num_cancelled = 0
    for r, when in zip(results, cancel_at):
        if r.error is not None and r.error[0] == grpc.StatusCode.CANCELLED:
            num_cancelled += 1
            assert when is not None, f"{r.rid} was cancelled without the client asking"
        else:
            assert r.completed, (r.rid, r.error)
            assert r.ids == reference[r.spec.name][:12]
    records = [procs.state.get_request(r.rid) for r in results]
    for r, rec in zip(results, records):
        assert rec is None and r.error is not None or rec["state"] in TERMINAL_STATES, (r.rid, rec)
    states = [rec["state"] if rec else "never started" for rec in records]
    left = settle_and_measure(procs)
    report(fault="200 requests, 20% cancelled", topology=TOPOLOGY, requests=200,
           cancel_requested=sum(w is not None for w in cancel_at), cancelled=num_cancelled,
           finished=states.count(RequestState.FINISHED), recorded_cancelled=states.count(RequestState.CANCELLED),
           cancelled_before_start=states.count("never started"), leaked_blocks=left["blocks_used"],
           parked_or_running=left["sequences"], leases_left=left["leases"])
    assert not any(left.values()), left


def test_sigterm_decode_worker_finishes_in_flight(procs, reference):
    """Graceful shutdown (a Kubernetes rolling update): SIGTERM lets the streams a worker holds finish
    on it, takes no new work, deregisters, and exits 0 within the grace period."""
    import signal

    progress: dict[str, int] = {}
    threads, results = run_many(procs.router_address, SPECS[:8], "term", progress=progress)
    wait_streaming(progress, 8, 3)
    t_term = procs.kill("decode-0", signal.SIGTERM)
    # While it drains, new requests go elsewhere and succeed.
    extra = run_one(procs.router_address, SPECS[1], f"term-new-{time.monotonic_ns()}")
    join(threads)
    exit_code = procs.procs["decode-0"].popen.wait(timeout=40)
    exit_s = time.monotonic() - t_term
    assert exit_code == 0, procs.procs["decode-0"].log()
    assert extra.completed and extra.ids == reference[SPECS[1].name]
    assert procs.state.get_request(extra.rid)["decode_worker"] == "decode-1"
    on_drained = 0
    for r in results:
        assert r.completed, (r.rid, r.error)
        assert r.ids == reference[r.spec.name]
        record = procs.state.get_request(r.rid)
        if record["decode_worker"] == "decode-0":
            on_drained += 1
            assert int(record["attempt"]) == 1, "a drained stream should finish where it ran, not fail over"
    assert on_drained, "no stream was on the drained worker"
    assert procs.state.get_worker("decode-0") is None, "the drained worker is still registered"
    procs.restart("decode-0")
    left = settle_and_measure(procs)
    report(fault="SIGTERM decode worker", topology=TOPOLOGY, in_flight=len(results),
           finished_on_draining_worker=on_drained, exit_code=exit_code, exit_s=round(exit_s, 3),
           leaked_blocks=left["blocks_used"], leases_left=left["leases"])
    assert not any(left.values()), left
    assert_terminal(procs, results)
