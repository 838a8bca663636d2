"""Cache-aware routing on a real cluster with two prefill workers: workers publish the prompt prefixes
their KV cache holds, and the router sends a prompt to the worker that holds its prefix, as long as
that worker is not too much busier than the least loaded one."""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from protos import handoff_pb2, handoff_pb2_grpc
from router.cluster import Cluster

TOPICS = ["opening hours", "borrowing rules", "the reading room", "the local history archive"]


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=2, num_decode=1, kv_memory_gib=0.1, threads=1).start()
    yield c
    c.stop()


def system_prompt(topic: str) -> str:
    return (f"You answer questions about {topic} at the public library, politely and briefly. " * 30)


def ask(stub, topic: str, question: str, rid: str):
    messages = [handoff_pb2.ChatMessage(role="system", content=system_prompt(topic)),
                handoff_pb2.ChatMessage(role="user", content=question)]
    return list(stub.Generate(handoff_pb2.GenerateRequest(messages=messages, max_tokens=2, temperature=0.0,
                                                          ignore_eos=True, request_id=rid), timeout=120))


def wait_published(cluster, timeout_s: float = 10.0) -> None:
    """Until every prefill worker's published set in Redis holds every chunk prefix its cache holds."""
    deadline = time.monotonic() + timeout_s
    for w in cluster.prefill:
        held = {h.hex() for h in w.engine.cached_chunk_hashes()}
        key = f"{cluster.state.prefix}prefixes:prefill:{w.config.worker_id}"
        while not held <= cluster.state.client.smembers(key):
            assert time.monotonic() < deadline, f"{w.config.worker_id} did not publish its {len(held)} prefixes"
            time.sleep(0.02)


def test_a_prompt_goes_to_the_prefill_worker_that_holds_its_prefix(cluster):
    chunk = cluster.prefill[0].engine.hasher.chunk_tokens
    with grpc.insecure_channel(cluster.address) as ch:
        stub = handoff_pb2_grpc.RouterStub(ch)
        first = {}
        # Two at a time: the second of a pair finds the first's worker busy and takes the idle one (one
        # at a time, two idle workers tie and the pick between them is random: all four could share one).
        for pair in (TOPICS[:2], TOPICS[2:]):
            rids = {topic: f"warm-{topic}-{time.monotonic_ns()}".replace(" ", "_") for topic in pair}
            with ThreadPoolExecutor(len(pair)) as pool:
                list(pool.map(lambda topic: ask(stub, topic, "Hello?", rids[topic]), pair))
            for topic in pair:
                first[topic] = cluster.state.get_request(rids[topic])["prefill_worker"]
            assert len({first[topic] for topic in pair}) == 2, "two prompts at once should use both prefill workers"
        wait_published(cluster)  # the workers publish what they hold with their heartbeat
        for topic in TOPICS:
            rid = f"again-{topic}-{time.monotonic_ns()}".replace(" ", "_")
            msgs = ask(stub, topic, "And on Sundays?", rid)
            record = cluster.state.get_request(rid)
            assert record["prefill_worker"] == first[topic], topic
            assert int(record["cached_tokens"]) >= chunk and int(record["cached_tokens"]) % chunk == 0
            assert msgs[-1].prompt_tokens > int(record["cached_tokens"])
    for w in cluster.prefill:
        published = cluster.state.client.smembers(f"{cluster.state.prefix}prefixes:prefill:{w.config.worker_id}")
        assert published, f"{w.config.worker_id} published no prefixes"


def test_load_outweighs_the_cache_beyond_the_balance_threshold(cluster):
    """With cache_balance 0, a worker busier than the least loaded never gets a request for its cache."""
    picker = cluster.router.router.picker
    workers = picker._live("prefill", set())
    busy = workers[0].worker_id
    prompt = cluster.prefill[0].tokenizer.encode(system_prompt(TOPICS[0]))
    old = picker.cache_balance
    picker.cache_balance = 0
    picker._prefill_load[busy] += 1  # as if one request were in flight there
    try:
        chosen, _ = asyncio.run(picker.pick_prefill(time.monotonic() + 5, set(), prompt))
        picker.done_prefill(chosen.worker_id)
        assert chosen.worker_id != busy
    finally:
        picker._prefill_load[busy] -= 1
        picker.cache_balance = old
