"""The token path: the router's one DecodeSession stream per decode worker, in the default configuration.

Many requests share it, each engine step sends at most one message carrying all their new tokens, a
request that fails gets its own status without ending the stream, ending the stream frees what its
requests held, and the decode worker does no text work (the router matches stop strings and cancels).
"""
from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading
import time

import grpc
import pytest

from common import metrics
from common.engine.output import OutputProcessor
from common.engine.sampling import SamplingParams
from common.pb_convert import sampling_to_pb
from protos import handoff_pb2, handoff_pb2_grpc, internal_pb2, internal_pb2_grpc
from router.cluster import Cluster
from router.decode_sessions import get_before
from tests.support.cluster import wait_idle


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(num_prefill=1, num_decode=1, kv_memory_gib=0.25).start()
    yield c
    c.stop()


def generate(cluster, **fields) -> list[handoff_pb2.GenerateResponse]:
    with grpc.insecure_channel(cluster.address) as ch:
        return list(handoff_pb2_grpc.RouterStub(ch).Generate(handoff_pb2.GenerateRequest(**fields), timeout=120))


def ids_of(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


def test_concurrent_streams_share_one_message_per_step(cluster):
    d = cluster.decode[0]
    # 64 tokens each: the 8 decodes overlap for most of their steps whatever the speed of the machine (with
    # 24, a fast decode worker finished the first requests while the prefill worker still had the last).
    specs = [dict(prompt=f"Tell me about the number {i}.", max_tokens=64, ignore_eos=True,
                  **(dict(temperature=0.0) if i % 2 else dict(temperature=0.9, seed=i))) for i in range(8)]
    alone = [ids_of(generate(cluster, **s)) for s in specs]
    messages = metrics.DECODE_SESSION_MESSAGES.labels(d.config.worker_id)
    msgs_before, steps_before = messages._value.get(), d.engine.num_steps
    together: list = [None] * len(specs)

    def one(i):
        together[i] = ids_of(generate(cluster, **specs[i]))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    num_messages, num_steps = messages._value.get() - msgs_before, d.engine.num_steps - steps_before
    num_tokens = sum(len(t) - 1 for t in together)  # the first token of each came from the prefill worker
    assert together == alone, "a shared session changed some request's tokens"
    assert num_messages <= num_steps, f"{num_messages} session messages for {num_steps} engine steps"
    assert num_messages < num_tokens / 3, f"{num_messages} messages for {num_tokens} tokens: not multiplexed"
    wait_idle(cluster)


def test_the_router_matches_stop_strings_and_the_decode_worker_stops(cluster):
    full = generate(cluster, prompt="Count: one, two, three, four, five, six,", max_tokens=30, temperature=0.0,
                    ignore_eos=True)
    text = "".join(m.text for m in full)
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    cut = generate(cluster, prompt="Count: one, two, three, four, five, six,", max_tokens=30, temperature=0.0,
                   ignore_eos=True, stop=[stop])
    assert cut[-1].finish_reason == handoff_pb2.FINISH_REASON_STOP
    assert "".join(m.text for m in cut) == text[:text.index(stop)]
    assert ids_of(cut) == ids_of(full)[:len(ids_of(cut))]
    wait_idle(cluster)  # the decode worker's sequence was cancelled, its blocks freed


def test_a_decode_worker_does_no_text_work_without_stop_strings(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok.encode("Hello there, how are you today?")
    quiet = OutputProcessor(tok, SamplingParams(max_tokens=len(ids)), 3, 8192, detokenize=False)
    assert [quiet.push(t) for t in ids] == [""] * len(ids) and quiet.finish_reason.value == "length"
    stops = OutputProcessor(tok, SamplingParams(max_tokens=50, stop=("how",)), 3, 8192, detokenize=False)
    text = "".join(stops.push(t) for t in ids if stops.finish_reason is None)
    assert stops.finish_reason.value == "stop" and text == "Hello there, "


def _session(cluster):
    d = cluster.decode[0]
    ch = grpc.insecure_channel(d.address)
    requests: queue.SimpleQueue = queue.SimpleQueue()
    stream = internal_pb2_grpc.DecodeWorkerStub(ch).DecodeSession(iter(requests.get, None), timeout=120)
    return d, ch, requests, stream


def _start(d, rid: str, prompt_ids: list[int], max_tokens: int = 200, **fields) -> internal_pb2.SessionRequest:
    sampling = sampling_to_pb(SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), 0)
    return internal_pb2.SessionRequest(start=internal_pb2.DecodeRequest(
        request_id=rid, epoch=d.epoch, prompt_ids=prompt_ids, sampling=sampling, attempt=1, **fields))


def test_a_failed_request_gets_its_status_and_the_session_goes_on(cluster):
    d, ch, requests, stream = _session(cluster)
    try:
        ids = d.tokenizer.encode("Once upon a time")
        requests.put(_start(d, "no-lease", ids, prefill_here=True))
        requests.put(_start(d, "no-prompt", [], prefill_here=True))
        rid = f"leased-{time.monotonic_ns()}"
        assert cluster.state.reserve(d.config.worker_id, d.epoch, rid, 16, 30).ok
        requests.put(_start(d, rid, ids, max_tokens=5, prefill_here=True))
        seen: dict[str, list] = {}
        for msg in stream:
            for ev in msg.events:
                seen.setdefault(ev.request_id, []).append(ev)
            if rid in seen and seen[rid][-1].event.HasField("finish_reason"):
                break
        assert seen["no-lease"][-1].status_code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert "reservation" in seen["no-lease"][-1].status_message
        assert seen["no-prompt"][-1].status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert sum(len(ev.event.token_ids) for ev in seen[rid]) == 5 and not seen[rid][-1].status_code
        cluster.state.release(d.config.worker_id, rid)
    finally:
        requests.put(None)
        ch.close()
    wait_idle(cluster)


def test_ending_the_session_frees_what_its_requests_held(cluster):
    d, ch, requests, stream = _session(cluster)
    rid = f"abandoned-{time.monotonic_ns()}"
    waiting = f"waiting-{time.monotonic_ns()}"
    try:
        for r in (rid, waiting):
            assert cluster.state.reserve(d.config.worker_id, d.epoch, r, 32, 30).ok
        ids = d.tokenizer.encode("The history of the printing press")
        requests.put(_start(d, rid, ids, prefill_here=True))
        requests.put(_start(d, waiting, ids, output_ids=[ids[0]]))  # waits for a KV push that never comes
        for msg in stream:
            assert not any(ev.status_code for ev in msg.events), msg
            if any(ev.request_id == rid and len(ev.event.token_ids) for ev in msg.events):
                break
        assert d.num_inflight == 2
    finally:
        stream.cancel()
        ch.close()
    deadline = time.monotonic() + 10
    while d.num_inflight or d.engine.num_active:
        assert time.monotonic() < deadline, (d.num_inflight, d.engine.num_active)
        time.sleep(0.05)
    for r in (rid, waiting):
        cluster.state.release(d.config.worker_id, r)
    wait_idle(cluster)


def test_a_start_that_lands_after_the_session_closed_is_not_decoded_for_nobody(cluster):
    """A start checks its lease in Redis before it joins the session's requests. A session that closes
    meanwhile (the router went away) used to miss it: the start then joined after the close, was decoded
    for nobody, and its in-flight guard was never let go, so every later drain waited its whole timeout.
    Redis is paused (SIGSTOP) to hold the start in its lease check while the session closes."""
    d = cluster.decode[0]
    ids = d.tokenizer.encode("The history of the printing press")
    for attempt in range(5):  # the pause must stay under the Redis socket timeout (2 s): retried if not
        rid = f"late-start-{attempt}-{time.monotonic_ns()}"
        assert cluster.state.reserve(d.config.worker_id, d.epoch, rid, 32, 30).ok
        listeners = len(d.engine.step_listeners)
        _, ch, requests, stream = _session(cluster)
        os.kill(cluster.redis.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            requests.put(_start(d, rid, ids, prefill_here=True))
            while d.num_inflight == 0 and time.monotonic() - t_stop < 1.5:
                time.sleep(0.001)  # the start took its guard and waits for Redis
            stream.cancel()
            while len(d.engine.step_listeners) > listeners and time.monotonic() - t_stop < 1.5:
                time.sleep(0.001)  # the session has closed
        finally:
            os.kill(cluster.redis.pid, signal.SIGCONT)
            paused_s = time.monotonic() - t_stop
            requests.put(None)
            ch.close()
        deadline = time.monotonic() + 10
        while (d.num_inflight or d.engine.num_active) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (d.num_inflight, d.engine.num_active) == (0, 0), \
            f"a start that landed after its session closed holds its guard and decodes for nobody ({paused_s:.2f} s)"
        cluster.state.release(d.config.worker_id, rid)
        if paused_s < 1.5:
            break
    else:
        pytest.skip("Redis could not be paused briefly enough to hold a start across the close")
    wait_idle(cluster)


def _events_until(stream, done) -> dict[str, list]:
    """Read the session's events, by request id, until done(seen) holds."""
    seen: dict[str, list] = {}
    for msg in stream:
        for ev in msg.events:
            seen.setdefault(ev.request_id, []).append(ev)
        if done(seen):
            return seen
    raise AssertionError(f"the session ended first: {seen}")


def test_a_cancel_is_not_held_up_behind_a_start_waiting_for_redis(cluster):
    """A start checks its lease in Redis; while Redis stalls, that check waits (up to the socket timeout).
    It used to wait on the session's one reader thread, and every cancel on the session waited behind it,
    so a request the router had cancelled went on decoding and holding its KV. Redis is paused (SIGSTOP)
    for less than the socket timeout: the cancel lands while it is still paused."""
    d = cluster.decode[0]
    ids = d.tokenizer.encode("The history of the printing press")
    running, waiting = f"running-{time.monotonic_ns()}", f"waiting-{time.monotonic_ns()}"
    for rid in (running, waiting):
        assert cluster.state.reserve(d.config.worker_id, d.epoch, rid, 32, 30).ok
    _, ch, requests, stream = _session(cluster)
    try:
        requests.put(_start(d, running, ids, max_tokens=400, prefill_here=True))
        _events_until(stream, lambda seen: running in seen)
        assert d.engine.num_active == 1
        os.kill(cluster.redis.pid, signal.SIGSTOP)
        t_stop = time.monotonic()
        try:
            requests.put(_start(d, waiting, ids, max_tokens=5, prefill_here=True))
            while d.num_inflight < 2 and time.monotonic() - t_stop < 0.5:
                time.sleep(0.001)  # the second start took its guard and waits for Redis
            requests.put(internal_pb2.SessionRequest(cancel=internal_pb2.SessionCancel(request_id=running, attempt=1)))
            while d.engine.num_active and time.monotonic() - t_stop < 1.5:
                time.sleep(0.005)
            cancelled_s = time.monotonic() - t_stop
            still_active = d.engine.num_active
        finally:
            os.kill(cluster.redis.pid, signal.SIGCONT)
        assert not still_active, f"the cancel waited behind a start's Redis call ({cancelled_s:.2f} s and counting)"
        seen = _events_until(stream, lambda seen: waiting in seen and (
            seen[waiting][-1].status_code or seen[waiting][-1].event.HasField("finish_reason")))
        assert not seen[waiting][-1].status_code, seen[waiting][-1]  # the start goes on once Redis answers
    finally:
        requests.put(None)
        ch.close()
        for rid in (running, waiting):
            cluster.state.release(d.config.worker_id, rid)
    wait_idle(cluster)


def test_a_message_that_does_not_parse_fails_no_other_request(cluster):
    """One undecodable message (a start whose request_id is not UTF-8) used to end the whole session, failing
    every request on it. It is skipped: the session and its requests go on."""
    d = cluster.decode[0]
    ids = d.tokenizer.encode("Once upon a time")
    before, after = f"before-{time.monotonic_ns()}", f"after-{time.monotonic_ns()}"
    for rid in (before, after):
        assert cluster.state.reserve(d.config.worker_id, d.epoch, rid, 16, 30).ok
    ch = grpc.insecure_channel(d.address)
    raw: queue.SimpleQueue = queue.SimpleQueue()
    session = ch.stream_stream("/handoff.v1.DecodeWorker/DecodeSession", request_serializer=lambda b: b,
                               response_deserializer=internal_pb2.SessionEvents.FromString)
    stream = session(iter(raw.get, None), timeout=120)
    try:
        raw.put(_start(d, before, ids, max_tokens=40, prefill_here=True).SerializeToString())
        _events_until(stream, lambda seen: before in seen)
        raw.put(b"\x0a\x03\x0a\x01\xff")  # SessionRequest{start: DecodeRequest{request_id: b"\xff"}}
        raw.put(_start(d, after, ids, max_tokens=5, prefill_here=True).SerializeToString())
        done = lambda ev: ev.status_code or ev.event.HasField("finish_reason")  # noqa: E731
        seen = _events_until(stream, lambda seen: all(r in seen and done(seen[r][-1]) for r in (before, after)))
        for rid in (before, after):
            assert not seen[rid][-1].status_code, seen[rid][-1]
    finally:
        raw.put(None)
        ch.close()
        for rid in (before, after):
            cluster.state.release(d.config.worker_id, rid)
    wait_idle(cluster)


# --------------------------------------------------------------------------- a request's read of its events


def test_a_read_cancelled_as_its_event_arrives_is_cancelled_and_keeps_the_event():
    """The race that let a client that left mid-stream have its request decoded to the end: the event
    lands and the request is cancelled in the same turn of the loop (asyncio.wait_for on Python 3.11
    returned the event and dropped the cancellation)."""
    async def scenario():
        events = asyncio.Queue()
        reader = asyncio.create_task(get_before(events, time.monotonic() + 60))
        await asyncio.sleep(0)  # the reader waits for its next event
        events.put_nowait("token")
        reader.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        return events.get_nowait()

    assert asyncio.run(scenario()) == "token"


def test_a_read_past_its_deadline_times_out_and_one_in_time_gets_its_event():
    async def scenario():
        events = asyncio.Queue()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await get_before(events, t0 + 0.05)
        waited = time.monotonic() - t0
        with pytest.raises(TimeoutError):
            await get_before(events, t0 - 1)  # already past: at once
        asyncio.get_running_loop().call_later(0.01, events.put_nowait, "token")
        return waited, await get_before(events, time.monotonic() + 60)

    waited, got = asyncio.run(scenario())
    assert 0.04 <= waited < 5 and got == "token"
