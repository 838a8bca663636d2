"""Fuzzing DecodeWorker.Decode with raw requests and the KV pushes they wait for."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import internal_pb2
from tests.fuzz.protowire import (
    ANY_VARINT,
    CALL_TIMEOUT_S,
    FUZZ,
    GARBAGE,
    INPUTS,
    KV_CONTENTS,
    SANE_IDS,
    WILD_IDS,
    WORKER_CODES,
    Part,
    Spec,
    Verdict,
    call_stream,
    ctx_for,
    extra_fields,
    f_double,
    f_len,
    f_packed,
    f_varint,
    id_part,
    id_violations,
    internal_sampling,
    judge,
    kv_messages,
    kv_tensor,
    parse,
    pick,
    push,
    raw_method,
    sampling_violations,
    unique_id,
    wire_text,
)

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


@st.composite
def decode_requests(draw) -> Spec:
    sane = draw(st.integers(0, 2)) == 0
    with_kv = draw(st.booleans())  # push the KV first, so that a valid request really decodes
    # Without KV, also lengths the context takes but the KV pool (1,152 tokens) cannot.
    ids = draw(SANE_IDS) if with_kv else pick(draw, sane, SANE_IDS, st.one_of(WILD_IDS, st.tuples(
        st.integers(0, 49151), st.integers(1100, 8191)).map(lambda t: [t[0]] * t[1])))
    parts: list[Part] = [id_part(1, None)]
    epoch = pick(draw, sane, st.just("real"), wire_text(max_size=8))
    parts.append((lambda c: f_len(2, c.decode_epoch.encode())) if epoch == "real" else f_len(2, epoch))
    parts += [f_packed(3, ids)] if draw(st.booleans()) else [f_varint(3, t) for t in ids]
    parts.append(f_varint(4, pick(draw, sane, st.integers(0, 49151), ANY_VARINT)))
    if sane or draw(st.integers(0, 5)):
        # With KV, max_tokens stays small (or 0 once truncated to uint32): a valid request then decodes
        # a few tokens, never thousands.
        mt, wild_mt = ((st.integers(1, 5), st.sampled_from([None, 0, 2**32, 2**64 - 2**32])) if with_kv else
                       (st.integers(1, 10**6), st.one_of(ANY_VARINT, st.none())))
        parts.append(f_len(5, draw(internal_sampling(sane or draw(st.booleans()), max_tokens=mt,
                                                     wild_max_tokens=wild_mt))))
    parts.append(f_varint(6, pick(draw, sane, st.integers(0, max(0, len(ids) - 1)), ANY_VARINT)))
    wait = pick(draw, sane, st.floats(0.01, 0.2), st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, -1.0, 1e-300, 5e-324, 1e300, math.inf, -math.inf, math.nan, 3.0])))
    parts.append(f_double(7, wait))
    if not sane:
        parts += draw(extra_fields(max_size=2))
    garbage = None if sane or draw(st.integers(0, 9)) else draw(GARBAGE)
    kv_tokens = len(ids) if draw(st.integers(0, 5)) else draw(st.integers(1, 30))
    return Spec(parts, garbage, {"with_kv": with_kv and bool(ids), "kv_tokens": kv_tokens,
                                 "content": draw(KV_CONTENTS), "seed": draw(st.integers(0, 2**31))})


def decode_verdict(raw: bytes, spec: Spec, cluster) -> tuple[Verdict, float]:
    """The verdict and the client timeout to use."""
    r = parse(internal_pb2.DecodeRequest, raw)
    if r is None:
        return Verdict({"INVALID_ARGUMENT"}, why="not a parseable DecodeRequest"), CALL_TIMEOUT_S
    d = cluster.decode[0]
    cfg = d.model.config
    bad = sampling_violations(r.sampling, cfg.vocab_size)
    if r.sampling.max_tokens < 1:
        bad.append("max_tokens")
    bad += id_violations(r.prompt_ids, cfg.vocab_size, cfg.max_position - 1, "prompt_ids")
    bad += id_violations([r.first_token_id], cfg.vocab_size, 1, "first_token_id")
    if r.prompt_ids and r.num_generated >= len(r.prompt_ids):
        bad.append("num_generated")
    if not (math.isfinite(r.kv_wait_s) and r.kv_wait_s >= 0):
        bad.append("kv_wait_s")  # "> 0"; 0 (unset) is taken as the worker's default
    if r.epoch != d.epoch:
        return Verdict({"FAILED_PRECONDITION"} | ({"INVALID_ARGUMENT"} if bad else set()),
                       why="another epoch", request=r), CALL_TIMEOUT_S
    if bad:
        return Verdict({"INVALID_ARGUMENT"}, tuple(bad), "violates " + ", ".join(bad), r), CALL_TIMEOUT_S
    pool = d.engine.pool
    # The most tokens the sequence can come to hold (what the router would reserve for it).
    num_tokens = max(len(r.prompt_ids) + 1, min(len(r.prompt_ids) - r.num_generated + r.sampling.max_tokens,
                                                cfg.max_position))
    if pool.blocks_for(num_tokens) > pool.num_blocks:
        return Verdict({"RESOURCE_EXHAUSTED"}, why="can outgrow the whole KV pool", request=r), CALL_TIMEOUT_S
    if spec.extra["with_kv"]:
        if spec.extra["kv_tokens"] != len(r.prompt_ids):
            return Verdict({"INVALID_ARGUMENT"}, ("tokens",), "KV of another length", r), CALL_TIMEOUT_S
        return Verdict({"OK"}, why="valid, with its KV", request=r), CALL_TIMEOUT_S
    wait_s = r.kv_wait_s or d.config.kv_wait_s
    if wait_s > 1.0:  # the worker waits for the KV up to the deadline: give it a short one
        return Verdict({"DEADLINE_EXCEEDED", "UNAVAILABLE"}, why="waits for KV that never comes",
                       request=r), 0.5
    return Verdict({"UNAVAILABLE"}, why="valid, but no KV arrives", request=r), CALL_TIMEOUT_S


@settings(FUZZ, max_examples=230)
@given(spec=decode_requests())
def test_fuzz_decode(cluster, channels, baseline, spec):
    d = cluster.decode[0]
    rid = unique_id("dc")
    if spec.extra["with_kv"]:
        fp = d.fingerprint()
        kv = kv_tensor(fp, spec.extra["kv_tokens"], spec.extra["content"], spec.extra["seed"])
        msgs = kv_messages(fp, kv, rid=rid, worker_id=d.config.worker_id, epoch=d.epoch, chunk_bytes=1 << 20)
        pushed = push(channels, [m.SerializeToString() for m in msgs])
        assert pushed.code == "OK", pushed
    raw = spec.encode(ctx_for(cluster, rid))
    verdict, timeout = decode_verdict(raw, spec, cluster)
    INPUTS["decode"] += 1
    out = call_stream(raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode", internal_pb2.DecodeEvent),
                      raw, timeout)
    judge(out, verdict, WORKER_CODES | {"DEADLINE_EXCEEDED"} if timeout < CALL_TIMEOUT_S else WORKER_CODES,
          raw, timeout, rpc="decode")
    if out.code != "OK":
        return
    r = verdict.request
    events = out.responses
    assert events and events[-1].HasField("finish_reason")
    assert all(not e.HasField("finish_reason") for e in events[:-1])
    ids = [t for e in events for t in e.token_ids]
    assert all(0 <= t < d.model.config.vocab_size for t in ids)
    # Completion tokens so far: num_generated earlier ones plus first_token_id.
    prompt_len = len(r.prompt_ids) - r.num_generated
    max_output = min(r.sampling.max_tokens, d.model.config.max_position - prompt_len)
    assert len(ids) <= max(0, max_output - r.num_generated - 1), (len(ids), r)
