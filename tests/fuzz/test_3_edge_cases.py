"""Named edge cases and concurrency: leases, duplicate ids, attempts, a retried and a resumed decode."""
from __future__ import annotations

import math
import threading
import time

import grpc
import pytest

from common.kv_wire import LAYOUT
from decode_svc.inbox import seq_key
from protos import handoff_pb2, internal_pb2
from tests.fuzz.protowire import (
    CALL_TIMEOUT_S,
    GREEDY_PROMPT,
    INPUTS,
    ROUTER_CODES,
    WORKER_CODES,
    Outcome,
    Verdict,
    assert_nothing_parked,
    call_stream,
    claim_kv,
    f32,
    f_fixed32,
    f_len,
    f_varint,
    generate_verdict,
    judge,
    kv_tensor,
    push,
    push_kv,
    raw_method,
    release,
    reserve,
    tag,
    unique_id,
)

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


def greedy_sampling(max_tokens: int) -> internal_pb2.SamplingParams:
    return internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=max_tokens,
                                       ignore_eos=True)


def methods(channels):
    dec = raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent)
    pre = raw_method(channels["prefill"], "/handoff.v1.PrefillWorker/Prefill", internal_pb2.PrefillEvent)
    return dec, pre


def expect(out: Outcome, code: str, hint: str = "") -> None:
    INPUTS["named"] += 1
    assert out.code == code and hint in out.details, f"expected {code} ({hint!r}), got {out}"


def test_named_edge_cases(cluster, channels, baseline):
    """The inputs the brief names, each once, so they run whatever hypothesis draws."""
    gen = raw_method(channels["router"], "/handoff.v1.Router/Generate", handoff_pb2.GenerateResponse)
    cases = [
        f_len(1, "lone surrogate \ud800 here".encode("utf-8", "surrogatepass")),   # invalid UTF-8 prompt
        f_len(1, b"\xff\xfe\xfd"),
        f_len(1, b"hi") + f_len(14, b"abc\n"),                                      # whitespace in request_id
        f_len(1, b"hi") + f_len(14, b"\xed\xb0\x80"),
        f_len(1, b"a" * (5 << 20)),                                                  # past 4 MiB
        f_len(1, b"hi") + f_fixed32(4, f32(math.nan)),
        f_len(1, b"hi") + f_fixed32(5, f32(math.inf)),
        f_len(1, b"hi") + f_varint(3, -1),
        f_len(1, b"hi") + f_varint(11, 2**64 - 1),
        f_len(1, b"hi") + b"".join(f_len(12, b"x") for _ in range(10_000)),          # a huge stop list
        f_len(2, f_len(1, b"user") + f_len(2, b"\xc0\x80")),                         # overlong NUL in a message
        f_len(2, f_len(2, b"no role")),
        f_len(1, b"hi") + f_varint(123456, 7) + f_len(99999, b"\x00" * 100),        # unknown fields
        b"\x0a",                                                                      # truncated
        tag(0, 0) + b"\x00",                                                          # field number 0
    ]
    for raw in cases:
        INPUTS["named"] += 1
        judge(call_stream(gen, raw, CALL_TIMEOUT_S), generate_verdict(raw, cluster, set()), ROUTER_CODES, raw)

    d = cluster.decode[0]
    dec, pre = methods(channels)
    sp = internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=2)

    def decode(timeout: float = 10.0, **fields) -> Outcome:
        fields = {"request_id": unique_id("w"), "epoch": d.epoch, "prompt_ids": [1, 2], "output_ids": [3],
                  "attempt": 1, "sampling": sp, "kv_wait_s": 5, **fields}
        return call_stream(dec, internal_pb2.DecodeRequest(**fields).SerializeToString(), timeout)

    # Refused before any lease is looked at: none of these holds one.
    for wait in (math.nan, -1.0, math.inf):
        expect(decode(3.0, kv_wait_s=wait), "INVALID_ARGUMENT", "kv_wait_s")
    expect(decode(request_id=""), "INVALID_ARGUMENT", "request_id")
    expect(decode(output_ids=[]), "INVALID_ARGUMENT", "output_ids")
    expect(decode(output_ids=[d.model.config.vocab_size]), "INVALID_ARGUMENT", "output_ids")
    context = d.model.config.max_position
    expect(decode(output_ids=[3] * (context - 1)), "INVALID_ARGUMENT", "output_ids")  # prompt + output > context
    # A Decode larger than the whole KV pool must fail at once, not wait in the engine forever: by its
    # prompt, by its completion so far, or by a max_tokens that would outgrow the pool halfway (INTERNAL once).
    pool = d.engine.pool
    too_many = pool.num_blocks * pool.block_size
    expect(decode(prompt_ids=[1] * too_many), "RESOURCE_EXHAUSTED", "pool")
    expect(decode(output_ids=[3] * too_many), "RESOURCE_EXHAUSTED", "pool")
    expect(decode(sampling=internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1,
                                                       max_tokens=too_many)), "RESOURCE_EXHAUSTED", "pool")
    assert not d.engine.waiting, "a sequence larger than the pool is queued in the engine"

    # A valid Decode needs a live lease of enough blocks for prompt and completion, on this worker.
    rid = unique_id("lease")
    expect(decode(request_id=rid), "FAILED_PRECONDITION", "no live reservation")
    reserve(cluster, rid, num_blocks=1)
    expect(decode(request_id=rid, prompt_ids=[1] * 16), "FAILED_PRECONDITION", "reserved 1 KV blocks")
    release(cluster, rid)
    expect(decode(request_id=rid), "FAILED_PRECONDITION", "no live reservation")  # released: gone

    # KV of another length than prompt_ids: the caller's mismatch (it used to surface as INTERNAL).
    rid = unique_id("len")
    fp = d.fingerprint()
    reserve(cluster, rid, 8)
    assert push_kv(channels, cluster, rid, kv_tensor(fp, 3, "normal", 0), attempt=1).code == "OK"
    expect(decode(request_id=rid, prompt_ids=[1, 2, 3, 4]), "INVALID_ARGUMENT", "tokens")
    release(cluster, rid)
    assert_nothing_parked(cluster)

    # A push bigger than the pool could ever hold is refused at its header, before its buffer is allocated.
    header = internal_pb2.KVHeader(request_id=unique_id("huge"), target_worker_id=d.config.worker_id,
                                   target_epoch=d.epoch, fingerprint=fp.to_pb(), num_tokens=too_many,
                                   total_bytes=fp.kv_bytes(too_many), num_chunks=1, layout=LAYOUT)
    expect(push(channels, [internal_pb2.KVChunk(header=header).SerializeToString()]), "INVALID_ARGUMENT",
           "exceeds the limit")
    # So is one without a lease (or with too small a one): the answer comes while the sender still holds
    # its data back, so no buffer for the ~50 MB it announces was allocated.
    num_tokens = too_many - 1
    header = internal_pb2.KVHeader(request_id=unique_id("nolease"), target_worker_id=d.config.worker_id,
                                   target_epoch=d.epoch, fingerprint=fp.to_pb(), num_tokens=num_tokens,
                                   total_bytes=fp.kv_bytes(num_tokens), num_chunks=64, layout=LAYOUT, attempt=1)
    expect(push_header_only(channels, header), "FAILED_PRECONDITION", "no live reservation")
    reserve(cluster, header.request_id, num_blocks=1)
    expect(push_header_only(channels, header), "FAILED_PRECONDITION", "reserved 1 KV blocks")
    release(cluster, header.request_id)

    # A push for an attempt whose Decode call already ended is refused: nobody would claim it.
    rid = unique_id("late")
    reserve(cluster, rid, 8)
    expect(decode(request_id=rid, kv_wait_s=0.05), "UNAVAILABLE", "did not arrive")
    expect(push_kv(channels, cluster, rid, kv_tensor(fp, 2, "normal", 0), attempt=1), "CANCELLED", "Decode call ended")
    release(cluster, rid)
    assert_nothing_parked(cluster)
    assert pool.num_free_blocks == pool.num_blocks

    p = cluster.prefill[0]

    def prefill(**fields) -> tuple[Outcome, internal_pb2.PrefillRequest]:
        target = internal_pb2.KVTarget(worker_id=d.config.worker_id, kv_address=d.kv_address, epoch=d.epoch,
                                       attempt=1)
        target.MergeFrom(fields.pop("target", internal_pb2.KVTarget()))
        req = internal_pb2.PrefillRequest(**{"request_id": unique_id("pf"), "prompt_ids": [1, 2, 3],
                                             "sampling": greedy_sampling(4), "target": target, **fields})
        return call_stream(pre, req.SerializeToString(), CALL_TIMEOUT_S), req

    out, _ = prefill(request_id="")  # its push could never be accepted (it used to surface as INTERNAL)
    expect(out, "INVALID_ARGUMENT", "request_id")
    out, _ = prefill(output_ids=[5, 6], sampling=sp)  # max_tokens 2: the completion is over, nothing to resume
    expect(out, "INVALID_ARGUMENT", "output_ids")
    assert out.blame is None
    # Without a lease the push is refused, and the Prefill ends with that status, charged to the target.
    out, req = prefill()
    expect(out, "FAILED_PRECONDITION", "no live reservation")
    assert out.blame == ("decode", d.config.worker_id, d.epoch), out
    assert [e.first_token.finished for e in out.responses] == [False], out.responses
    # Trailers carry any worker id the target names (metadata must be printable ASCII: percent-encoded).
    for worker_id in ("dé\n", " a b ", "%41\x00"):
        out, _ = prefill(target=internal_pb2.KVTarget(worker_id=worker_id))
        expect(out, "FAILED_PRECONDITION", "addressed to worker")
        assert out.blame == ("decode", worker_id, d.epoch), out
    # Pushes to many addresses (junk, or decode pods long gone) must not leave a channel open per address.
    for port in range(1, p.kv_channels.max_idle + 9):
        out, req = prefill(target=internal_pb2.KVTarget(kv_address=f"127.0.0.1:{port}"))
        INPUTS["named"] += 1
        judge(out, Verdict({"UNAVAILABLE"}, why="nothing listens there"), WORKER_CODES, req.SerializeToString())
        assert out.blame == ("decode", d.config.worker_id, d.epoch), out
    assert len(p.kv_channels._channels) <= p.kv_channels.max_idle, f"{len(p.kv_channels._channels)} channels kept open"
    assert_nothing_parked(cluster)


def push_header_only(channels, header: internal_pb2.KVHeader) -> Outcome:
    """Send the header, then hold the stream open (up to 10 s) without data: the answer must come first."""
    answered = threading.Event()

    def messages():
        yield internal_pb2.KVChunk(header=header).SerializeToString()
        answered.wait(10)

    method = raw_method(channels["kv"], "/handoff.v1.KVTransfer/PushKV", internal_pb2.PushKVReply, "stream_unary")
    t0 = time.monotonic()
    try:
        out = Outcome("OK", "", [method(messages(), timeout=CALL_TIMEOUT_S)], time.monotonic() - t0)
    except grpc.RpcError as exc:
        out = Outcome(exc.code().name, exc.details() or "", [], time.monotonic() - t0)
    finally:
        answered.set()
    assert out.elapsed_s < 5, f"the push was answered only after its data was due: {out}"
    return out


def wait_for(condition, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_unclaimed_kv_is_swept(cluster, channels, baseline):
    """KV that no Decode call claims within the worker's KV wait is dropped by the heartbeat's sweep,
    and its blocks go back to the pool."""
    d = cluster.decode[0]
    pool = d.engine.pool
    rid = unique_id("orphan")
    reserve(cluster, rid, 20)
    ttl_s = d.inbox.ttl_s
    d.inbox.ttl_s = 0.2  # the worker's KV wait, shortened so the test does not wait 30 s
    try:
        expect(push_kv(channels, cluster, rid, kv_tensor(d.fingerprint(), 20, "normal", 0), attempt=1), "OK")
        assert d.engine.num_parked == 1 and pool.num_free_blocks == pool.num_blocks - pool.blocks_for(20)
        deadline = time.monotonic() + 5  # the heartbeat (every 0.5 s) sweeps
        while d.engine.num_parked and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        d.inbox.ttl_s = ttl_s
        release(cluster, rid)
    assert_nothing_parked(cluster, timeout_s=0)
    assert pool.num_free_blocks == pool.num_blocks


def test_concurrent_duplicate_ids(cluster, channels, baseline):
    """A second call for the attempt of one still running (a buggy or replaying caller) is refused at
    once and leaves the first alone; another attempt of the same request may run beside it."""
    d = cluster.decode[0]
    fp = d.fingerprint()
    dec, pre = methods(channels)

    def start(method, raw, streaming: threading.Event | None = None) -> tuple[threading.Thread, list[Outcome]]:
        out: list[Outcome] = []
        on_message = None if streaming is None else (lambda _msg: streaming.set())
        t = threading.Thread(target=lambda: out.append(call_stream(method, raw, CALL_TIMEOUT_S, on_message)))
        t.start()
        return t, out

    def tokens(out: Outcome) -> list[int]:
        return [t for e in out.responses for t in e.token_ids]

    # Decode: the second arrives once the first has streamed its first tokens, with a couple of hundred
    # steps still ahead of it (a clock-based wait was outrun once decode got faster: the first had
    # finished, and the second waited for KV that was never pushed again).
    rid, ids, max_tokens = unique_id("dup"), [5, 6, 7, 8], 256

    def decode_raw(attempt: int) -> bytes:
        return internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=ids, output_ids=[9],
                                          attempt=attempt, sampling=greedy_sampling(max_tokens),
                                          kv_wait_s=1).SerializeToString()

    reserve(cluster, rid, len(ids) + max_tokens)
    try:
        kv = kv_tensor(fp, len(ids), "normal", 0)
        streaming = threading.Event()
        t1, out1 = start(dec, decode_raw(1), streaming)
        time.sleep(0.1)
        assert push_kv(channels, cluster, rid, kv, attempt=1).code == "OK"
        assert streaming.wait(CALL_TIMEOUT_S), "the first Decode streamed nothing"
        t2, out2 = start(dec, decode_raw(1))
        t1.join()
        t2.join()
        INPUTS["concurrent"] += 2
        judge(out2[0], Verdict({"ABORTED"}, ("already running",), hint_code="ABORTED"), WORKER_CODES | {"ABORTED"},
              decode_raw(1))
        assert out1[0].code == "OK", out1
        assert len(tokens(out1[0])) == max_tokens - 1

        # Two attempts of one request at once (the router gave up on attempt 2 and started 3): each its own KV.
        t2, out2 = start(dec, decode_raw(2))
        t3, out3 = start(dec, decode_raw(3))
        time.sleep(0.1)
        assert push_kv(channels, cluster, rid, kv, attempt=2).code == "OK"
        assert push_kv(channels, cluster, rid, kv, attempt=3).code == "OK"
        t2.join()
        t3.join()
        INPUTS["concurrent"] += 2
        assert out2[0].code == "OK" and out3[0].code == "OK", (out2, out3)
        # Same KV, same prompt, greedy: the same tokens, whichever rows of the batch they took.
        assert tokens(out2[0]) == tokens(out3[0]) == tokens(out1[0])
    finally:
        release(cluster, rid)

    # Prefill: the second arrives while the first is still in the engine (a prompt of 400 tokens), and
    # a third, for another attempt, runs beside them (both KVs fit the pool at once). Their pushes are in
    # flight together, and a request's pushes may hold no more than its lease covers (decode_svc/pushes.py):
    # the lease covers both.
    rid, prompt_ids = unique_id("dup-p"), list(range(10, 410))

    def prefill_raw(attempt: int) -> bytes:
        target = internal_pb2.KVTarget(worker_id=d.config.worker_id, kv_address=d.kv_address, epoch=d.epoch,
                                       attempt=attempt)
        return internal_pb2.PrefillRequest(request_id=rid, prompt_ids=prompt_ids, sampling=greedy_sampling(30),
                                           target=target).SerializeToString()

    reserve(cluster, rid, 2 * len(prompt_ids) + 2)
    try:
        t1, out1 = start(pre, prefill_raw(1))
        time.sleep(0.1)
        t2, out2 = start(pre, prefill_raw(1))
        t3, out3 = start(pre, prefill_raw(2))
        for t in (t1, t2, t3):
            t.join()
        INPUTS["concurrent"] += 3
        judge(out2[0], Verdict({"ABORTED"}, ("already running",), hint_code="ABORTED"), WORKER_CODES | {"ABORTED"},
              prefill_raw(1))
        assert out1[0].code == "OK" and out3[0].code == "OK", (out1, out3)
        for attempt, out in ((1, out1[0]), (2, out3[0])):
            claim_kv(channels, cluster, rid, prompt_ids, [out.responses[0].first_token.token_id], attempt)
    finally:
        release(cluster, rid)
    assert_nothing_parked(cluster)


def test_retried_decode_after_a_cancelled_one(cluster, channels, baseline):
    """The router's next attempt after a failure: attempt 1's Decode was cancelled before any KV came
    (its late push is refused), and attempt 2, on the same decode worker, gets its KV and the greedy
    answer. A failover resume (attempt 3) replays the completion so far and continues it exactly."""
    d = cluster.decode[0]
    dec, pre = methods(channels)
    expected = baseline[0]  # the router's greedy answer: 12 tokens, ignore_eos
    prompt_ids = d.tokenizer.encode(GREEDY_PROMPT)
    rid = unique_id("retry")

    def prefill(attempt: int, output_ids=()) -> Outcome:
        target = internal_pb2.KVTarget(worker_id=d.config.worker_id, kv_address=d.kv_address, epoch=d.epoch,
                                       reservation_id=rid, attempt=attempt)
        raw = internal_pb2.PrefillRequest(request_id=rid, prompt_ids=prompt_ids, output_ids=output_ids,
                                          sampling=greedy_sampling(len(expected)), target=target)
        INPUTS["concurrent"] += 1
        return call_stream(pre, raw.SerializeToString(), CALL_TIMEOUT_S)

    def decode_request(attempt: int, output_ids) -> bytes:
        return internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=prompt_ids,
                                          output_ids=output_ids, attempt=attempt,
                                          sampling=greedy_sampling(len(expected)), kv_wait_s=5).SerializeToString()

    def decode(attempt: int, output_ids) -> list[int]:
        INPUTS["concurrent"] += 1
        out = call_stream(dec, decode_request(attempt, output_ids), CALL_TIMEOUT_S)
        assert out.code == "OK", out
        assert out.responses[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH
        return [t for e in out.responses for t in e.token_ids]

    reserve(cluster, rid, len(prompt_ids) + len(expected))
    try:
        INPUTS["concurrent"] += 1
        first = dec(decode_request(1, expected[:1]), timeout=CALL_TIMEOUT_S)
        key = seq_key(rid, 1)
        wait_for(lambda: ("Decode", key) in d._inflight_ids, "attempt 1's Decode call did not reach the worker")
        first.cancel()
        wait_for(lambda: ("Decode", key) not in d._inflight_ids and not d.inbox.accepting(key),
                 "the worker did not notice the cancellation")
        late = prefill(1)  # attempt 1's KV, after its Decode ended: refused, charged to the decode worker
        assert late.code == "CANCELLED" and late.blame == ("decode", d.config.worker_id, d.epoch), late
        assert_nothing_parked(cluster)

        outs: list[list[int]] = []
        retry = threading.Thread(target=lambda: outs.append(decode(2, expected[:1])))
        retry.start()
        time.sleep(0.1)
        pushed = prefill(2)
        retry.join()
        assert pushed.code == "OK", pushed
        assert [e.WhichOneof("event") for e in pushed.responses] == ["first_token", "transfer_done"]
        assert pushed.responses[0].first_token.token_id == expected[0]
        assert outs == [expected[1:]], "attempt 2 did not continue the greedy answer"

        # Failover after 5 tokens: prefill pushes the prompt's KV alone, decode replays the 4 tokens before
        # the last and continues from there, bit for bit.
        resumed = prefill(3, expected[:5])
        assert resumed.code == "OK" and [e.WhichOneof("event") for e in resumed.responses] == ["transfer_done"], resumed
        assert decode(3, expected[:5]) == expected[5:], "the resumed decode did not continue the greedy answer"
    finally:
        release(cluster, rid)
    assert_nothing_parked(cluster)
