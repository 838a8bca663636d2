"""Fuzzing KVTransfer.PushKV: well-formed pushes, 30-odd kinds of tampering, and the lease each needs."""
from __future__ import annotations

import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_svc.worker import seq_key
from protos import internal_pb2
from tests.fuzz.protowire import (
    CALL_TIMEOUT_S,
    FUZZ,
    INPUTS,
    KV_CONTENTS,
    LEASES,
    MAX_INTERNAL_MESSAGE_BYTES,
    WORKER_CODES,
    Verdict,
    assert_nothing_parked,
    call_stream,
    claim_kv,
    f_len,
    f_varint,
    judge,
    kv_messages,
    kv_tensor,
    push,
    raw_method,
    release,
    reserve,
    unique_id,
)

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


FINGERPRINT_FIELDS = ("weights_id", "num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")


HARMFUL = st.one_of(
    st.sampled_from(["truncate", "drop", "duplicate", "swap", "data_first", "no_header", "two_headers",
                     "header_last", "empty_stream", "bad_crc", "flip_byte", "grow_chunk", "empty_chunk",
                     "bad_offset", "bad_index", "empty_message", "garbage", "bad_utf8_id", "no_request_id",
                     "other_worker", "other_epoch", "no_fingerprint", "layout", "num_tokens", "total_bytes",
                     "num_chunks", "zero_chunks", "ten_gb", "ten_gb_exact", "oversized_chunk", "past_pool"]),
    st.tuples(st.just("fingerprint"), st.sampled_from(FINGERPRINT_FIELDS)))


BENIGN = st.sampled_from(["unknown_fields", "reservation_id"])


@st.composite
def push_specs(draw):
    harmful = draw(st.lists(HARMFUL, max_size=3, unique_by=str))
    benign = draw(st.lists(BENIGN, max_size=2, unique=True))
    if not harmful and not benign and draw(st.booleans()):
        harmful = [draw(HARMFUL)]
    # Past one block (16 tokens) now and then, so that a lease can be one block too small.
    num_tokens = draw(st.one_of(st.integers(1, 8), st.integers(1, 8), st.integers(1, 8), st.integers(17, 40)))
    return dict(num_tokens=num_tokens, chunk_bytes=draw(st.sampled_from([1 << 20, 65536, 10_007, 4096])),
                content=draw(KV_CONTENTS), seed=draw(st.integers(0, 2**31)), harmful=harmful, benign=benign,
                pick=draw(st.randoms(use_true_random=False)), junk=draw(st.binary(min_size=1, max_size=32)),
                attempt=draw(st.one_of(st.integers(0, 5), st.integers(0, 2**32 - 1))), lease=draw(LEASES),
                # The push comes after its attempt's Decode call ended (it waited in vain): refused, CANCELLED.
                decode_ended=draw(st.integers(0, 7)) == 0)


def tamper(s: dict, msgs: list[internal_pb2.KVChunk], fp, pool_tokens: int) -> tuple[list[bytes], list[str]]:
    """Apply the spec's mutations; the stream as bytes and the mutations that really changed something."""
    rnd = s["pick"]
    header = msgs[0].header
    data = [m.data for m in msgs[1:]]
    applied = []
    for m in s["harmful"]:
        kind, arg = (m if isinstance(m, tuple) else (m, None))
        n = len(data)
        i = rnd.randrange(n) if n else None
        if kind in ("data_first", "header_last", "no_header", "two_headers", "empty_stream", "empty_message",
                    "garbage", "bad_utf8_id"):
            pass  # applied to the encoded stream below
        elif n == 0 and kind in ("truncate", "drop", "duplicate", "bad_crc", "flip_byte", "grow_chunk",
                                 "empty_chunk", "bad_offset", "bad_index", "oversized_chunk"):
            continue
        elif kind == "truncate":
            del data[i:]
        elif kind == "drop":
            del data[i]
        elif kind == "duplicate":
            data.insert(i + 1, internal_pb2.KVData.FromString(data[i].SerializeToString()))
        elif kind == "swap":
            if n < 2:
                continue
            i, j = rnd.sample(range(n), 2)
            data[i], data[j] = data[j], data[i]
        elif kind == "bad_crc":
            data[i].crc32 ^= rnd.randrange(1, 2**32)
        elif kind == "flip_byte":
            p = bytearray(data[i].payload)
            p[rnd.randrange(len(p))] ^= 1 << rnd.randrange(8)
            data[i].payload = bytes(p)
        elif kind == "grow_chunk":
            data[i].payload += s["junk"]
            data[i].crc32 = zlib.crc32(data[i].payload)
        elif kind == "empty_chunk":
            data[i].payload, data[i].crc32 = b"", 0
        elif kind == "bad_offset":
            data[i].offset += rnd.choice([1, 7, 2**40])
        elif kind == "bad_index":
            data[i].index += rnd.randrange(1, 5)
        elif kind == "oversized_chunk":  # past the 8 MiB message limit
            data[i].payload = bytes(MAX_INTERNAL_MESSAGE_BYTES + (1 << 20))
            data[i].crc32 = zlib.crc32(data[i].payload)
        elif kind == "no_request_id":
            header.request_id = ""
        elif kind == "other_worker":
            header.target_worker_id += "x"
        elif kind == "other_epoch":
            header.target_epoch = "0" * 16 if header.target_epoch != "0" * 16 else "1" * 16
        elif kind == "no_fingerprint":
            header.ClearField("fingerprint")
        elif kind == "fingerprint":
            if not header.HasField("fingerprint"):
                continue
            f = header.fingerprint
            if arg == "dtype":
                f.dtype = "bfloat16" if f.dtype != "bfloat16" else "float16"
            elif arg == "weights_id":
                f.weights_id = rnd.choice(["", "other-model", f.weights_id + " "])
            else:
                setattr(f, arg, rnd.choice([0, getattr(f, arg) + 1, getattr(f, arg) + 2**31]))
        elif kind == "layout":
            header.layout = rnd.choice(["", "LT2HD", "l2thd", "L2THD "])
        elif kind == "num_tokens":
            header.num_tokens = rnd.choice([0, header.num_tokens + 1, 2**32 - 1])
        elif kind == "total_bytes":
            header.total_bytes = rnd.choice([0, header.total_bytes + 1, header.total_bytes - 1, 2**64 - 1])
        elif kind == "num_chunks":
            header.num_chunks = rnd.choice([header.num_chunks + 1, 2**32 - 1, header.num_chunks + 7])
        elif kind == "zero_chunks":
            header.num_chunks = 0
        elif kind == "ten_gb":
            header.total_bytes = 10 * 10**9
        elif kind == "ten_gb_exact":  # a header that is self-consistent and asks for 10 GB
            header.num_tokens = 10 * 10**9 // fp.kv_bytes(1)
            header.total_bytes = fp.kv_bytes(header.num_tokens)
            header.num_chunks = -(-header.total_bytes // (1 << 20))
        elif kind == "past_pool":  # consistent, within the context, but more tokens than the KV pool holds
            header.num_tokens = pool_tokens + 1
            header.total_bytes = fp.kv_bytes(header.num_tokens)
            header.num_chunks = -(-header.total_bytes // (1 << 20))
        else:
            raise AssertionError(kind)
        applied.append(kind)
    if "reservation_id" in s["benign"]:
        header.reservation_id = "some-other-reservation"
    kinds = set(applied)
    head = internal_pb2.KVChunk(header=header).SerializeToString()
    if "bad_utf8_id" in kinds:
        # The request id as invalid UTF-8 (a lone surrogate), which protobuf Python refuses to write.
        head = f_len(1, header.SerializeToString() + f_len(1, b"\xed\xa0\x80bad"))
    raw = [head] + [internal_pb2.KVChunk(data=d).SerializeToString() for d in data]
    if "unknown_fields" in s["benign"]:
        raw = [r + f_varint(rnd.randrange(16, 2**29), rnd.randrange(2**64)) for r in raw]
        head = raw[0]
    if "data_first" in kinds and len(raw) > 1:
        raw[0], raw[1] = raw[1], raw[0]
    if "header_last" in kinds:
        raw.remove(head)
        raw.append(head)
    if "two_headers" in kinds:
        raw.insert(rnd.randrange(1, len(raw) + 1), head)
    if "no_header" in kinds:
        raw.remove(head)
    if "empty_message" in kinds:
        raw.insert(rnd.randrange(len(raw) + 1), b"")
    if "garbage" in kinds:
        raw.insert(rnd.randrange(len(raw) + 1), s["junk"])
    if "empty_stream" in kinds:
        raw = []
    return raw, applied


def end_decode(channels, cluster, rid: str, num_tokens: int, attempt: int) -> None:
    """A Decode call for (rid, attempt) that waits 50 ms for KV that does not come, and ends."""
    d = cluster.decode[0]
    req = internal_pb2.DecodeRequest(
        request_id=rid, epoch=d.epoch, prompt_ids=[1] * num_tokens, output_ids=[2], attempt=attempt, kv_wait_s=0.05,
        sampling=internal_pb2.SamplingParams(temperature=0, top_p=1, repetition_penalty=1, max_tokens=2))
    out = call_stream(raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent),
                      req.SerializeToString(), CALL_TIMEOUT_S)
    assert out.code == "UNAVAILABLE" and "did not arrive" in out.details, out


def push_verdict(s: dict, applied: list[str], num_blocks: int, need: int) -> Verdict:
    why = f"mutations {applied} + {s['benign']}, a lease of {num_blocks} blocks for {need}"
    if applied:
        return Verdict(WORKER_CODES - {"OK"}, why=why)
    if num_blocks == 0:
        return Verdict({"FAILED_PRECONDITION"}, ("no live reservation",), why, hint_code="FAILED_PRECONDITION")
    if num_blocks < need:
        return Verdict({"FAILED_PRECONDITION"}, (f"reserved {num_blocks} KV blocks",), why,
                       hint_code="FAILED_PRECONDITION")
    if s["decode_ended"]:
        return Verdict({"CANCELLED"}, ("Decode call ended",), why, hint_code="CANCELLED")
    return Verdict({"OK"}, why=why)


@settings(FUZZ, max_examples=260)
@given(s=push_specs())
def test_fuzz_push_kv(cluster, channels, baseline, s):
    d = cluster.decode[0]
    fp = d.fingerprint()
    pool = d.engine.pool
    rid = unique_id("kv")
    n, attempt = s["num_tokens"], s["attempt"]
    kv = kv_tensor(fp, n, s["content"], s["seed"])
    msgs = kv_messages(fp, kv, rid=rid, worker_id=d.config.worker_id, epoch=d.epoch, chunk_bytes=s["chunk_bytes"],
                       attempt=attempt)
    raw, applied = tamper(s, msgs, fp, pool.num_blocks * pool.block_size)
    need = pool.blocks_for(n)
    # A Decode that ended first held a lease for its prompt and the token after it.
    num_blocks = (pool.blocks_for(n + 1) if s["decode_ended"] else
                  {"full": need, "none": 0, "small": need - 1}[s["lease"]])
    try:
        if num_blocks:
            reserve(cluster, rid, num_blocks=num_blocks)
        if s["decode_ended"]:
            end_decode(channels, cluster, rid, n, attempt)
        INPUTS["push_kv"] += 1
        out = push(channels, raw)
        release(cluster, rid)
        judge(out, push_verdict(s, applied, num_blocks, need), WORKER_CODES,
              b"".join(raw[:3])[:200] + f" ... {applied}".encode(), rpc="push_kv")
        if out.code == "OK":
            reply = out.responses[0]
            assert (reply.request_id, reply.num_tokens, reply.kv_bytes) == (rid, n, fp.kv_bytes(n))
            claim_kv(channels, cluster, rid, [1] * n, [2], attempt)
    except BaseException:
        # A failed example must leave nothing behind, or every later one fails too (and shrinking with it).
        release(cluster, rid)
        d.inbox.cancel(seq_key(rid, attempt))
        raise
    # A rejected push leaves nothing behind: no KV parked, every block of the pool free again.
    assert_nothing_parked(cluster)
    assert pool.num_free_blocks == pool.num_blocks, f"{pool.num_used_blocks} KV blocks still used ({applied})"
