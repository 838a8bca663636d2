"""The router's relay holds no thread per stream: Generate streams in flight — queued for KV, waiting for
their tokens — are coroutines on the router's event loop, so the process's thread count does not grow
with them, on the gRPC port as on the HTTP one, and a queued request its client cancels ends at once.

The client side here is asyncio too (grpc.aio, openai.AsyncOpenAI), on one thread of its own, so every thread counted
is the cluster's.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from dataclasses import replace

import grpc
import openai
import pytest

from common import metrics
from common.state import RequestState
from protos import handoff_pb2, handoff_pb2_grpc
from router.cluster import Cluster
from router.config import RouterConfig
from router.server import RouterServer
from tests.support.cluster import wait_idle

NUM_STREAMS = 64
BLOCKING_THREADS = 4
CLIENT_EXECUTOR = "test-client-executor"
PROMPT = "Name three colours."
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster():
    router = replace(RouterConfig(), queue_timeout_s=120, blocking_threads=BLOCKING_THREADS)
    c = Cluster(num_prefill=1, num_decode=1, kv_memory_gib=0.25, router=router).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def client_loop():
    """An event loop on one thread for the test's clients (its executor, which resolves host names, is
    not counted)."""
    loop = asyncio.new_event_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor(thread_name_prefix=CLIENT_EXECUTOR))
    thread = threading.Thread(target=loop.run_forever, name="test-clients", daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)


def request(rid: str) -> handoff_pb2.GenerateRequest:
    return handoff_pb2.GenerateRequest(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                       request_id=rid)


def reference(cluster) -> str:
    with grpc.insecure_channel(cluster.address) as ch:
        msgs = list(handoff_pb2_grpc.RouterStub(ch).Generate(request(f"ref-{time.monotonic_ns()}"), timeout=60))
    assert msgs[-1].completion_tokens == MAX_TOKENS
    return "".join(m.text for m in msgs)


async def grpc_stream(address: str, rid: str, calls: dict) -> str:
    async with grpc.aio.insecure_channel(address) as ch:
        call = calls[rid] = handoff_pb2_grpc.RouterStub(ch).Generate(request(rid), timeout=180)
        return "".join([m.text async for m in call])


async def http_stream(url: str, rid: str) -> str:
    async with openai.AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=180) as client:
        stream = await client.completions.create(
            model="smollm2", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": rid})
        return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])


def hog_the_kv(cluster) -> str:
    """Lease every free block of the decode worker to nobody: requests queue for room."""
    wait_idle(cluster)  # a request that just ended may still hold its lease for a moment
    d = cluster.decode[0]
    hog = f"hog-{time.monotonic_ns()}"
    assert cluster.state.reserve(d.config.worker_id, d.epoch, hog, cluster.state.available_blocks(d.config.worker_id),
                                 120).ok
    return hog


def free_the_kv(cluster, hog: str) -> None:
    cluster.state.release(cluster.decode[0].config.worker_id, hog)


def wait_waiting(n: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while metrics.ROUTER_WAITING._value.get() != n:
        assert time.monotonic() < deadline, f"{metrics.ROUTER_WAITING._value.get()} requests waiting, not {n}"
        time.sleep(0.05)


def num_threads() -> tuple[int, int]:
    """(the cluster's Python threads, of them the router's blocking pool)."""
    names = [t.name for t in threading.enumerate() if not t.name.startswith(CLIENT_EXECUTOR)]
    return len(names), sum(n.startswith("router-blocking") for n in names)


class _Looks:
    """Counts the picker's looks at Redis for room (each queued request's polls)."""

    def __init__(self, picker, monkeypatch):
        self.count = 0
        look = picker._try_reserve

        def counted(*args, **kwargs):
            self.count += 1
            return look(*args, **kwargs)

        monkeypatch.setattr(picker, "_try_reserve", counted)


def test_queued_streams_hold_no_thread_and_all_complete(cluster, client_loop, monkeypatch):
    ref = reference(cluster)
    looks = _Looks(cluster.router.router.picker, monkeypatch)
    hog = hog_the_kv(cluster)
    try:
        before, blocking_before = num_threads()
        calls: dict = {}
        tag = time.monotonic_ns()
        futures = [asyncio.run_coroutine_threadsafe(grpc_stream(cluster.address, f"q{tag}-{i}", calls), client_loop)
                   for i in range(NUM_STREAMS // 2)]
        futures += [asyncio.run_coroutine_threadsafe(http_stream(cluster.http_url, f"h{tag}-{i}"), client_loop)
                    for i in range(NUM_STREAMS // 2)]
        wait_waiting(NUM_STREAMS)
        # Queued a while: every stream has looked at Redis again, sleeping on the loop between looks.
        start = looks.count
        deadline = time.monotonic() + 30
        while looks.count < start + 3 * NUM_STREAMS:
            assert time.monotonic() < deadline, f"{looks.count - start} looks at Redis by {NUM_STREAMS} queued streams"
            time.sleep(0.02)
        during, blocking_during = num_threads()
        # The blocking pool may have started the rest of its few threads; nothing else may grow.
        assert blocking_during <= BLOCKING_THREADS
        assert during - before <= blocking_during - blocking_before, \
            f"{NUM_STREAMS} queued streams took {during - before} threads ({threading.enumerate()})"
    finally:
        free_the_kv(cluster, hog)
    outputs = [f.result(timeout=240) for f in futures]
    assert all(out == ref for out in outputs), [out for out in outputs if out != ref][:3]
    wait_idle(cluster)


def test_a_queued_request_its_client_cancels_ends_at_once(cluster, client_loop):
    ref = reference(cluster)
    hog = hog_the_kv(cluster)
    calls: dict = {}
    tag = time.monotonic_ns()
    rids = [f"c{tag}-{i}" for i in range(8)]
    try:
        futures = {rid: asyncio.run_coroutine_threadsafe(grpc_stream(cluster.address, rid, calls), client_loop)
                   for rid in rids}
        wait_waiting(len(rids))
        before, _ = num_threads()
        cancelled = rids[:4]
        for rid in cancelled:
            client_loop.call_soon_threadsafe(calls[rid].cancel)
        wait_waiting(len(rids) - len(cancelled), timeout_s=5)  # no poll of theirs runs on
        for rid in cancelled:
            with pytest.raises(concurrent.futures.CancelledError):
                futures[rid].result(timeout=10)
            deadline = time.monotonic() + 5
            while cluster.state.get_request(rid)["state"] != RequestState.CANCELLED.value:
                assert time.monotonic() < deadline, cluster.state.get_request(rid)
                time.sleep(0.05)
        assert num_threads()[0] <= before
    finally:
        free_the_kv(cluster, hog)
    assert all(futures[rid].result(timeout=120) == ref for rid in rids[4:])
    wait_idle(cluster)


def test_stop_lets_streams_finish_within_the_grace_then_cancels_them(cluster):
    """RouterServer.stop(grace_s) drains the loop: a stream in flight finishes within the grace; one past
    it is cancelled, and its record still ends, its KV and lease are still freed."""
    for grace_s, max_tokens in ((60, 24), (0.3, 400)):
        router = RouterServer(replace(cluster.router.config, port=0, http_port=-1), cluster.state).start()
        rid = f"drain-{grace_s}-{time.monotonic_ns()}"
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            stub = handoff_pb2_grpc.RouterStub(ch)
            stream = stub.Generate(handoff_pb2.GenerateRequest(
                prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, request_id=rid), timeout=120)
            msgs = [next(stream)]
            stopper = threading.Thread(target=router.stop, kwargs={"grace_s": grace_s})
            stopper.start()
            if grace_s > 1:
                msgs += list(stream)
                assert msgs[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH
                assert msgs[-1].completion_tokens == max_tokens
            else:
                with pytest.raises(grpc.RpcError):
                    msgs += list(stream)
            stopper.join(timeout=30)
            assert not stopper.is_alive(), "stop() did not return"
        record = cluster.state.get_request(rid)
        expected = RequestState.FINISHED if grace_s > 1 else RequestState.CANCELLED
        assert record["state"] == expected, record
    wait_idle(cluster)


def test_a_write_to_a_closed_stream_ends_the_request_cancelled(cluster):
    """grpc.aio's write raises, instead of the handler being cancelled, when the server stopped (its grace
    over) or the call finished just before it: `_ServerStoppedError`, `UsageError`. The request then ends
    cancelled, not failed, with its KV and lease freed, and the handler returns quietly. (The test above
    met this race once, in a CI run: the stopped server's write raised, and the record said failed.)"""
    from router.generate import GenerateCall
    rs = cluster.router
    rid = f"closed-{time.monotonic_ns()}"
    written: list = []

    async def write(msg) -> None:
        if written:  # the client's stream closed after the first message, as a stopping server's does
            raise grpc.aio.UsageError("Cannot write after the RPC finished")
        written.append(msg)

    async def serve() -> None:
        req = await rs.router.validate(handoff_pb2.GenerateRequest(prompt=PROMPT, max_tokens=200, temperature=0.0,
                                                                   ignore_eos=True, request_id=rid))
        await GenerateCall(rs.router, req, None).run(write)

    asyncio.run_coroutine_threadsafe(serve(), rs.loop).result(timeout=60)  # no exception: ended quietly
    assert len(written) == 1
    record = cluster.state.get_request(rid)
    assert record["state"] == RequestState.CANCELLED, record
    assert "error" not in record, record
    wait_idle(cluster)


def test_a_grpc_deadline_ends_a_stream_queued_or_decoding(cluster):
    """Past its deadline a call is DEADLINE_EXCEEDED, mid-stream or still queued for KV, and its record ends
    cancelled (the client stopped waiting), with its KV and lease freed."""
    def late(rid: str, timeout_s: float) -> list:
        msgs = []
        with grpc.insecure_channel(cluster.address) as ch:
            # 1,500 tokens outlast the 2 s deadline however fast decode is (400 came close).
            stream = handoff_pb2_grpc.RouterStub(ch).Generate(handoff_pb2.GenerateRequest(
                prompt=PROMPT, max_tokens=1500, temperature=0.0, ignore_eos=True, request_id=rid), timeout=timeout_s)
            with pytest.raises(grpc.RpcError) as err:
                for msg in stream:
                    msgs.append(msg)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 5
        while cluster.state.get_request(rid)["state"] != RequestState.CANCELLED.value:
            assert time.monotonic() < deadline, cluster.state.get_request(rid)
            time.sleep(0.05)
        return msgs

    assert late(f"late-decoding-{time.monotonic_ns()}", 2.0), "the deadline passed before the first token"
    hog = hog_the_kv(cluster)
    try:
        assert not late(f"late-queued-{time.monotonic_ns()}", 1.0)
        wait_waiting(0, timeout_s=5)
    finally:
        free_the_kv(cluster, hog)
    wait_idle(cluster)
