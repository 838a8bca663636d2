"""Named edge cases and concurrency: duplicate ids, retried decodes."""
from __future__ import annotations

import math
import threading
import time

import pytest

from common.kv_wire import LAYOUT
from protos import handoff_pb2, internal_pb2
from tests.fuzz.protowire import (
    CALL_TIMEOUT_S,
    INPUTS,
    ROUTER_CODES,
    WORKER_CODES,
    Outcome,
    Verdict,
    call_stream,
    claim_kv,
    f32,
    f_fixed32,
    f_len,
    f_varint,
    generate_verdict,
    judge,
    kv_messages,
    kv_tensor,
    push,
    raw_method,
    tag,
    unique_id,
)

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


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
    dec = raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent)
    sp = internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=2)
    for wait, code in ((math.nan, "INVALID_ARGUMENT"), (-1.0, "INVALID_ARGUMENT"), (math.inf, "INVALID_ARGUMENT")):
        raw = internal_pb2.DecodeRequest(request_id=unique_id("w"), epoch=d.epoch, prompt_ids=[1, 2], first_token_id=3,
                                         sampling=sp, kv_wait_s=wait).SerializeToString()
        INPUTS["named"] += 1
        out = call_stream(dec, raw, 3.0)
        assert out.code == code, f"kv_wait_s={wait}: {out}"
    # A Decode larger than the whole KV pool must fail at once, not wait in the engine forever.
    pool = d.engine.pool
    too_many = pool.num_blocks * pool.block_size
    rid = unique_id("big")
    raw = internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=[1] * too_many, first_token_id=3,
                                     sampling=sp, kv_wait_s=5).SerializeToString()
    INPUTS["named"] += 1
    out = call_stream(dec, raw, 10.0)
    assert out.code == "RESOURCE_EXHAUSTED", out
    assert not d.engine.waiting, "a sequence larger than the pool is queued in the engine"
    # ...and so must one whose max_tokens would outgrow the pool (it used to fail halfway, INTERNAL).
    rid = unique_id("long")
    raw = internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=[1, 2, 3], first_token_id=3,
                                     sampling=replace_sampling(sp, max_tokens=too_many), kv_wait_s=5)
    INPUTS["named"] += 1
    out = call_stream(dec, raw.SerializeToString(), 10.0)
    assert out.code == "RESOURCE_EXHAUSTED", out

    # A push bigger than the pool could ever hold is refused at its header, before its buffer is allocated.
    fp = d.fingerprint()
    header = internal_pb2.KVHeader(request_id=unique_id("huge"), target_worker_id=d.config.worker_id,
                                   target_epoch=d.epoch, fingerprint=fp.to_pb(), num_tokens=too_many,
                                   total_bytes=fp.kv_bytes(too_many), num_chunks=1, layout=LAYOUT)
    INPUTS["named"] += 1
    out = push(channels, [internal_pb2.KVChunk(header=header).SerializeToString()])
    assert out.code == "INVALID_ARGUMENT" and "exceeds the limit" in out.details, out

    # Pushes to many addresses (junk, or decode pods long gone) must not leave a channel open per address.
    p = cluster.prefill[0]
    pre = raw_method(channels["prefill"], "/handoff.v1.PrefillWorker/Prefill", internal_pb2.PrefillEvent)
    for port in range(1, p.kv_channels.max_idle + 9):
        target = internal_pb2.KVTarget(worker_id=d.config.worker_id, kv_address=f"127.0.0.1:{port}", epoch=d.epoch)
        raw = internal_pb2.PrefillRequest(request_id=unique_id("addr"), prompt_ids=[1, 2, 3], sampling=sp,
                                          target=target).SerializeToString()
        INPUTS["named"] += 1
        out = call_stream(pre, raw, CALL_TIMEOUT_S)
        judge(out, Verdict({"UNAVAILABLE"}, why="nothing listens there"), WORKER_CODES, raw)
    assert len(p.kv_channels._channels) <= p.kv_channels.max_idle, f"{len(p.kv_channels._channels)} channels kept open"


def replace_sampling(sp: internal_pb2.SamplingParams, **fields) -> internal_pb2.SamplingParams:
    copy = internal_pb2.SamplingParams()
    copy.CopyFrom(sp)
    for name, value in fields.items():
        setattr(copy, name, value)
    return copy


def test_concurrent_duplicate_ids(cluster, channels, baseline):
    """A second call with the id of one still running (a buggy or replaying caller) is refused at once,
    and leaves the first alone: it used to fail in the engine (INTERNAL) and, ending, cancel the first."""
    d = cluster.decode[0]
    fp = d.fingerprint()
    dec = raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent)
    pre = raw_method(channels["prefill"], "/handoff.v1.PrefillWorker/Prefill", internal_pb2.PrefillEvent)

    def start(method, raw) -> tuple[threading.Thread, list[Outcome]]:
        out: list[Outcome] = []
        t = threading.Thread(target=lambda: out.append(call_stream(method, raw, CALL_TIMEOUT_S)))
        t.start()
        return t, out

    # Decode: the second arrives while the first is decoding (about a second for 30 tokens).
    rid, ids, max_tokens = unique_id("dup"), [5, 6, 7, 8], 30
    sp = internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=max_tokens,
                                     ignore_eos=True)
    raw = internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=ids, first_token_id=9,
                                     sampling=sp, kv_wait_s=1).SerializeToString()
    t1, out1 = start(dec, raw)
    time.sleep(0.1)
    msgs = kv_messages(fp, kv_tensor(fp, len(ids), "normal", 0), rid=rid, worker_id=d.config.worker_id,
                       epoch=d.epoch, chunk_bytes=1 << 20)
    assert push(channels, [m.SerializeToString() for m in msgs]).code == "OK"
    time.sleep(0.2)
    t2, out2 = start(dec, raw)
    t1.join()
    t2.join()
    INPUTS["concurrent"] += 2
    judge(out2[0], Verdict({"ABORTED"}, ("already running",)), WORKER_CODES | {"ABORTED"}, raw)
    assert out1[0].code == "OK", out1
    assert len([t for e in out1[0].responses for t in e.token_ids]) == max_tokens - 1

    # Prefill: the second arrives while the first is still in the engine (a prompt of 600 tokens).
    rid, prompt_ids = unique_id("dup-p"), list(range(10, 610))
    target = internal_pb2.KVTarget(worker_id=d.config.worker_id, kv_address=d.kv_address, epoch=d.epoch)
    raw = internal_pb2.PrefillRequest(request_id=rid, prompt_ids=prompt_ids, sampling=sp,
                                      target=target).SerializeToString()
    t1, out1 = start(pre, raw)
    time.sleep(0.1)
    t2, out2 = start(pre, raw)
    t1.join()
    t2.join()
    INPUTS["concurrent"] += 2
    judge(out2[0], Verdict({"ABORTED"}, ("already running",)), WORKER_CODES | {"ABORTED"}, raw)
    assert out1[0].code == "OK", out1
    claim_kv(channels, cluster, rid, prompt_ids, out1[0].responses[0].first_token.token_id)


def test_retried_decode_after_a_cancelled_one(cluster, channels, baseline):
    """The router's next attempt after a prefill failure: the first Decode was cancelled before any KV
    came, and the retry (same request id, same decode worker) must get its KV, not a refusal."""
    d = cluster.decode[0]
    fp = d.fingerprint()
    dec = raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent)
    sp = internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=3, ignore_eos=True)
    rid, ids = unique_id("retry"), [5, 6, 7, 8]
    raw = internal_pb2.DecodeRequest(request_id=rid, epoch=d.epoch, prompt_ids=ids, first_token_id=9,
                                     sampling=sp, kv_wait_s=5).SerializeToString()
    first = dec(raw, timeout=CALL_TIMEOUT_S)
    time.sleep(0.2)
    first.cancel()
    time.sleep(0.3)  # the worker notices the cancellation
    outs: list[Outcome] = []
    retry = threading.Thread(target=lambda: outs.append(call_stream(dec, raw, CALL_TIMEOUT_S)))
    retry.start()
    time.sleep(0.1)
    msgs = kv_messages(fp, kv_tensor(fp, len(ids), "normal", 0), rid=rid, worker_id=d.config.worker_id,
                       epoch=d.epoch, chunk_bytes=1 << 20)
    pushed = push(channels, [m.SerializeToString() for m in msgs])
    retry.join()
    INPUTS["concurrent"] += 3
    assert pushed.code == "OK", pushed
    assert outs[0].code == "OK", outs
