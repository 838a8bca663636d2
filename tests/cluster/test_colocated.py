"""Colocated and conditional prefill (the router's prefill_mode): the decode worker prefills the prompt
itself, in the configuration users run (dtype auto, packed int4 decode, one prefill worker).

Three routers share one cluster's workers (1 prefill + 1 decode), as several router pods would:
disaggregated (the cluster's own), colocated and conditional. The same greedy or seeded request gives
the same tokens through each, with the prompt's K/V cold or already cached, the choice is recorded
in the request's record and in a metric, and nothing is left held afterwards.
"""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import grpc
import pytest

from common import metrics
from common.state import RequestState
from protos import handoff_pb2, handoff_pb2_grpc
from router.cluster import Cluster
from router.config import RouterConfig
from router.server import RouterServer
from tests.support.cluster import wait_idle

LONG = "The library opens at nine and closes at six; children's books are on the ground floor. " * 30
SHORT = "Write one sentence about the sea."
THRESHOLD = 128  # conditional: SHORT is prefilled on the decode worker, LONG on the prefill worker
REQUESTS = {"greedy": dict(temperature=0.0), "seeded": dict(temperature=1.0, top_p=0.9, seed=77)}


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, kv_memory_gib=0.25).start()
    routers = {"disaggregated": c.router}
    for mode in ("colocated", "conditional"):
        cfg = replace(c.router_config, prefill_mode=mode, remote_prefill_min_tokens=THRESHOLD, port=0, http_port=-1)
        routers[mode] = RouterServer(cfg, c.state).start()
    c.routers = routers
    yield c
    for mode in ("colocated", "conditional"):
        routers[mode].stop(grace_s=1)
    c.stop()


def generate(cluster, mode: str, prompt: str, rid: str, **fields) -> list[handoff_pb2.GenerateResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{cluster.routers[mode].port}") as ch:
        stub = handoff_pb2_grpc.RouterStub(ch)
        return list(stub.Generate(handoff_pb2.GenerateRequest(prompt=prompt, request_id=rid, **fields), timeout=120))


def ids_of(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def placements() -> dict[str, float]:
    return {p: metrics.PLACEMENT.labels(p)._value.get() for p in ("local", "remote")}


@pytest.mark.parametrize("kind", list(REQUESTS))
@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_every_mode_gives_the_same_tokens(cluster, kind, prompt):
    d = cluster.decode[0]
    outs = {}
    for run, mode in enumerate(["colocated", "colocated", "disaggregated", "conditional"]):
        cached_before = d.engine.num_cached_tokens
        before = placements()
        rid = f"modes-{kind}-{len(prompt)}-{run}-{time.monotonic_ns()}"
        msgs = generate(cluster, mode, prompt, rid, max_tokens=20, ignore_eos=True, **REQUESTS[kind])
        assert msgs[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH
        outs[(run, mode)] = ids_of(msgs)
        record = cluster.state.get_request(rid)
        local = mode == "colocated" or (mode == "conditional" and msgs[-1].prompt_tokens < THRESHOLD)
        assert record["prefill_placement"] == ("local" if local else "remote"), (mode, record)
        assert record["state"] == RequestState.FINISHED
        if local:
            assert record["prefill_worker"] == record["decode_worker"] == d.config.worker_id
        after = placements()
        assert after["local" if local else "remote"] == before["local" if local else "remote"] + 1
        if run == 1 and prompt is LONG:
            # The second colocated run found the first one's whole chunks in the decode worker's pool.
            assert d.engine.num_cached_tokens > cached_before, "no prefix-cache hit on the decode worker"
    reference = outs[(2, "disaggregated")]
    assert len(reference) == 20
    for key, ids in outs.items():
        assert ids == reference, f"{kind}: {key} differs from the disaggregated path"
    wait_idle(cluster)


def test_colocated_first_token_only_and_cancel_free_everything(cluster):
    """A request ended by its first token, and one cancelled mid-stream, leave no block or lease."""
    msgs = generate(cluster, "colocated", SHORT, f"one-{time.monotonic_ns()}", max_tokens=1, temperature=0.0,
                    ignore_eos=True)
    assert len(ids_of(msgs)) == 1 and msgs[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH
    rid = f"cancel-{time.monotonic_ns()}"
    with grpc.insecure_channel(f"127.0.0.1:{cluster.routers['colocated'].port}") as ch:
        call = handoff_pb2_grpc.RouterStub(ch).Generate(handoff_pb2.GenerateRequest(
            prompt=LONG, request_id=rid, max_tokens=400, ignore_eos=True, temperature=0.0), timeout=120)
        got = []
        for msg in call:
            got += msg.token_ids
            if len(got) >= 3:
                call.cancel()
                break
    deadline = time.monotonic() + 10
    while cluster.state.get_request(rid)["state"] != RequestState.CANCELLED:
        assert time.monotonic() < deadline, cluster.state.get_request(rid)
        time.sleep(0.05)
    wait_idle(cluster)


def test_colocated_concurrent_streams_match_one_at_a_time(cluster):
    """Prefills interleaved with other sequences' decode steps change no sequence's tokens."""
    prompts = [f"Story {i}: once upon a time" + " there was a hill" * (i * 9) for i in range(6)]
    alone = [ids_of(generate(cluster, "colocated", p, f"alone-{i}-{time.monotonic_ns()}", max_tokens=12,
                             ignore_eos=True, temperature=0.8, seed=i)) for i, p in enumerate(prompts)]
    together: list[list[int] | None] = [None] * len(prompts)

    def one(i: int) -> None:
        together[i] = ids_of(generate(cluster, "colocated", prompts[i], f"together-{i}-{time.monotonic_ns()}",
                                      max_tokens=12, ignore_eos=True, temperature=0.8, seed=i))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert together == alone
    wait_idle(cluster)


def test_a_cluster_without_prefill_workers_needs_a_mode_that_prefills_on_decode():
    with pytest.raises(ValueError, match="colocated or conditional"):
        Cluster(num_prefill=0, num_decode=1)
    with pytest.raises(ValueError, match="prefill_mode"):
        RouterConfig(prefill_mode="split")
    with pytest.raises(ValueError, match="remote_prefill_min_tokens"):
        RouterConfig(prefill_mode="conditional", remote_prefill_min_tokens=0)
    with pytest.raises(ValueError, match="remote_prefill_max_queue_ratio"):
        RouterConfig(prefill_mode="conditional", remote_prefill_max_queue_ratio=float("nan"))


def test_conditional_prefills_locally_a_prompt_that_would_queue_behind_prompts_no_longer_than_it(cluster):
    """Conditional placement looks at the prefill queue too. A prefill worker runs the prompt with the
    fewest tokens left first, so a long document prefilling there does not hold a shorter prompt back: that
    prompt still goes remote. What it would wait for is the queued prompts no longer than itself: with more
    than remote_prefill_max_queue_ratio times its length of those queued (this router's count of its
    prefill queue, held here by tickets of the router's own picker), it is prefilled on the decode worker,
    and remotely again once they are gone. Its tokens are the same either way."""
    document = LONG * 3  # ~1,800 tokens: seconds of prefill on one core
    medium = LONG[:900]  # past THRESHOLD (~190 tokens)
    router = cluster.routers["conditional"]
    ratio = router.config.remote_prefill_max_queue_ratio
    assert ratio == RouterConfig.remote_prefill_max_queue_ratio > 0
    long_rid = "cond-queue-doc"
    t = threading.Thread(target=generate, args=(cluster, "conditional", document, long_rid),
                         kwargs=dict(max_tokens=2, temperature=0.0))
    t.start()
    deadline = time.monotonic() + 30
    while (cluster.state.get_request(long_rid) or {}).get("state") != RequestState.PREFILLING.value:
        assert time.monotonic() < deadline, "the document never started prefilling"
        time.sleep(0.005)
    time.sleep(0.05)
    beside_doc = generate(cluster, "conditional", medium, "cond-queue-beside-doc", max_tokens=8, temperature=0.0)
    doc_record = cluster.state.get_request(long_rid)
    t.join(timeout=120)
    assert doc_record["prefill_placement"] == "remote"
    assert cluster.state.get_request("cond-queue-beside-doc")["prefill_placement"] == "remote"
    n = beside_doc[-1].prompt_tokens
    assert n >= THRESHOLD  # length alone sends it remote

    picker = router.router.picker
    (prefill,) = cluster.state.list_workers("prefill")
    tickets = [picker.queued_prefill(prefill.worker_id, n) for _ in range(int(ratio) + 1)]  # > ratio x its length
    tickets.append(picker.queued_prefill(prefill.worker_id, 10 * n))  # a longer one, which it would not wait for
    try:
        behind = generate(cluster, "conditional", medium, "cond-queue-behind", max_tokens=8, temperature=0.0)
    finally:
        for ticket in tickets:
            ticket.release()
            ticket.release()  # idempotent
    assert cluster.state.get_request("cond-queue-behind")["prefill_placement"] == "local"
    alone = generate(cluster, "conditional", medium, "cond-queue-alone", max_tokens=8, temperature=0.0)
    assert cluster.state.get_request("cond-queue-alone")["prefill_placement"] == "remote"
    assert ids_of(behind) == ids_of(alone) == ids_of(beside_doc)
    wait_idle(cluster)
