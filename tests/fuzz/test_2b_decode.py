"""Fuzzing DecodeWorker.Decode with raw requests, the leases they hold and the KV pushes they wait for."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_svc.worker import seq_key
from protos import handoff_pb2, internal_pb2
from tests.fuzz.protowire import (
    ANY_VARINT,
    CALL_TIMEOUT_S,
    FUZZ,
    GARBAGE,
    INPUTS,
    KV_CONTENTS,
    LEASES,
    SANE_ATTEMPT,
    SANE_IDS,
    WILD_ATTEMPT,
    WILD_IDS,
    WORKER_CODES,
    Part,
    Spec,
    Verdict,
    assert_nothing_parked,
    attempt_part,
    call_stream,
    claim_kv,
    completion_ends,
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
    kv_tensor,
    parse,
    pick,
    push_kv,
    raw_method,
    release,
    reserve,
    sampling_violations,
    unique_id,
    wire_text,
)

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


SANE_OUTPUT = st.lists(st.integers(0, 49151), min_size=1, max_size=6)


WILD_OUTPUT = st.one_of(
    st.lists(st.one_of(st.integers(0, 49151), ANY_VARINT), max_size=8),
    st.just([]),
    # Past what the context leaves after any prompt: rejected before any compute.
    st.tuples(st.integers(0, 49151), st.integers(8192, 9000)).map(lambda t: [t[0]] * t[1]))


def ids_field(draw, number: int, ids: list[int]) -> list[bytes]:
    return [f_packed(number, ids)] if draw(st.booleans()) else [f_varint(number, t) for t in ids]


@st.composite
def decode_requests(draw) -> Spec:
    sane = draw(st.integers(0, 2)) == 0
    with_kv = draw(st.booleans())  # push the KV first, so that a valid request really decodes
    # Without KV, also lengths the context takes but the KV pool (1,152 tokens) cannot.
    too_big_for_pool = st.tuples(st.integers(0, 49151), st.integers(1100, 8000)).map(lambda t: [t[0]] * t[1])
    # Colocated (prefill_here): prefilled on the decode worker itself, a short prompt and few tokens.
    here = draw(st.integers(0, 7)) == 0
    small = with_kv or here
    ids = draw(SANE_IDS) if with_kv else pick(draw, sane, SANE_IDS, WILD_IDS if here else
                                              st.one_of(WILD_IDS, too_big_for_pool))
    output = ([] if here and draw(st.booleans()) else
              pick(draw, sane, SANE_OUTPUT, WILD_OUTPUT if small else st.one_of(WILD_OUTPUT, too_big_for_pool)))
    parts: list[Part] = [id_part(1, None)]
    epoch = pick(draw, sane, st.just("real"), wire_text(max_size=8))
    parts.append((lambda c: f_len(2, c.decode_epoch.encode())) if epoch == "real" else f_len(2, epoch))
    parts += ids_field(draw, 3, ids)
    if sane or draw(st.integers(0, 5)):
        # With KV or prefilled here, max_tokens stays small (or 0 once truncated to uint32): a valid request then decodes
        # a few tokens, never thousands.
        mt, wild_mt = ((st.integers(1, 8), st.sampled_from([None, 0, 2**32, 2**64 - 2**32])) if small else
                       (st.integers(1, 10**6), st.one_of(ANY_VARINT, st.none())))
        parts.append(f_len(5, draw(internal_sampling(sane or draw(st.booleans()), max_tokens=mt,
                                                     wild_max_tokens=wild_mt))))
    parts += ids_field(draw, 8, output)
    parts += attempt_part(9, pick(draw, sane, SANE_ATTEMPT, WILD_ATTEMPT))
    if here:
        parts.append(f_varint(10, 1))
    wait = pick(draw, sane, st.floats(0.01, 0.2), st.one_of(
        st.floats(allow_nan=True, allow_infinity=True),
        st.sampled_from([0.0, -0.0, -1.0, 1e-300, 5e-324, 1e300, math.inf, -math.inf, math.nan, 3.0])))
    parts.append(f_double(7, wait))
    if not sane:
        parts += draw(extra_fields(max_size=2))
        parts = draw(st.permutations(parts))
    garbage = None if sane or draw(st.integers(0, 9)) else draw(GARBAGE)
    kv_tokens = len(ids) if draw(st.integers(0, 5)) else draw(st.integers(1, 30))
    return Spec(parts, garbage, {
        "with_kv": with_kv and bool(ids), "kv_tokens": kv_tokens, "content": draw(KV_CONTENTS),
        "seed": draw(st.integers(0, 2**31)), "lease": "full" if sane else draw(LEASES),
        # Now and then the KV is pushed for another attempt of the same request: this Decode must not see it.
        "other_attempt": not sane and draw(st.integers(0, 7)) == 0})


def max_seq_tokens(r, cfg) -> int:
    """The most tokens the sequence can come to hold (what the router reserves for it)."""
    prompt_len, output_len = len(r.prompt_ids), len(r.output_ids)
    return max(prompt_len + output_len, min(prompt_len + r.sampling.max_tokens, cfg.max_position))


def held_tokens(r) -> int:
    """The tokens the Decode holds KV for at once when it starts (what the worker checks the lease against):
    the prompt and the completion so far, or its first token when it is prefilled here."""
    return len(r.prompt_ids) + max(len(r.output_ids), 1)


def lease_blocks(spec: Spec, r, cluster) -> int:
    """Blocks to reserve for the Decode: enough (what the router would), none, or one block too few."""
    d = cluster.decode[0]
    pool = d.engine.pool
    need = pool.blocks_for(held_tokens(r))  # what the worker checks
    full = max(need, pool.blocks_for(max_seq_tokens(r, d.model.config)), 1)
    # Never more than the pool: a request that needs more is refused before its lease is looked at.
    return min({"full": full, "none": 0, "small": max(0, need - 1)}[spec.extra["lease"]], pool.num_blocks)


def decode_verdict(raw: bytes, spec: Spec, cluster, num_blocks: int, push_attempt: int | None
                   ) -> tuple[Verdict, float, bool]:
    """The verdict, the client timeout to use, and whether the call takes the pushed KV off the worker."""
    r = parse(internal_pb2.DecodeRequest, raw)
    if r is None:
        return Verdict({"INVALID_ARGUMENT"}, why="not a parseable DecodeRequest"), CALL_TIMEOUT_S, False
    d = cluster.decode[0]
    cfg = d.model.config
    bad = [] if r.request_id else ["request_id"]  # a repeated field 1 can leave it empty: the last one wins
    bad += sampling_violations(r.sampling, cfg.vocab_size)
    if r.sampling.max_tokens < 1:
        bad.append("max_tokens")
    bad += id_violations(r.prompt_ids, cfg.vocab_size, cfg.max_position - 1, "prompt_ids")
    if r.output_ids or not r.prefill_here:  # colocated, a new request has no completion yet
        bad += id_violations(r.output_ids, cfg.vocab_size, cfg.max_position - len(r.prompt_ids), "output_ids")
    if not (math.isfinite(r.kv_wait_s) and r.kv_wait_s >= 0):
        bad.append("kv_wait_s")  # "> 0"; 0 (unset) is taken as the worker's default
    if r.epoch != d.epoch:
        return Verdict({"FAILED_PRECONDITION"} | ({"INVALID_ARGUMENT"} if bad else set()), ("epoch",),
                       "another epoch", r, hint_code="FAILED_PRECONDITION"), CALL_TIMEOUT_S, False
    if bad:
        return Verdict({"INVALID_ARGUMENT"}, tuple(bad), "violates " + ", ".join(bad), r), CALL_TIMEOUT_S, False
    pool = d.engine.pool
    if pool.blocks_for(max_seq_tokens(r, cfg)) > pool.num_blocks:
        return Verdict({"RESOURCE_EXHAUSTED"}, why="can outgrow the whole KV pool", request=r), CALL_TIMEOUT_S, False
    # "Refused with FAILED_PRECONDITION unless Redis holds a live reservation ... for the request".
    if num_blocks < pool.blocks_for(held_tokens(r)):
        hint = "no live reservation" if num_blocks == 0 else f"reserved {num_blocks} KV blocks"
        return Verdict({"FAILED_PRECONDITION"}, (hint,), f"a lease of {num_blocks} blocks", r,
                       hint_code="FAILED_PRECONDITION"), CALL_TIMEOUT_S, False
    pushed = spec.extra["with_kv"] and push_attempt == r.attempt
    if r.prefill_here:
        # An attempt is pushed or prefilled here, never both: its pushed K/V is dropped.
        return ((Verdict({"INVALID_ARGUMENT"}, ("prefill_here",), "pushed and prefill_here", r), CALL_TIMEOUT_S, True)
                if pushed else (Verdict({"OK"}, why="valid, prefilled here", request=r), CALL_TIMEOUT_S, False))
    if pushed:
        if spec.extra["kv_tokens"] != len(r.prompt_ids):
            return Verdict({"INVALID_ARGUMENT"}, ("tokens",), "KV of another length", r), CALL_TIMEOUT_S, True
        return Verdict({"OK"}, why="valid, with its KV", request=r), CALL_TIMEOUT_S, True
    wait_s = r.kv_wait_s or d.config.kv_wait_s
    if wait_s > 1.0:  # the worker waits for the KV up to the deadline: give it a short one
        return Verdict({"DEADLINE_EXCEEDED", "UNAVAILABLE"}, why="waits for KV that never comes",
                       request=r), 0.5, False
    return Verdict({"UNAVAILABLE"}, why="valid, but no KV for its attempt arrives", request=r), CALL_TIMEOUT_S, False


@settings(FUZZ, max_examples=240)
@given(spec=decode_requests())
def test_fuzz_decode(cluster, channels, baseline, spec):
    d = cluster.decode[0]
    rid = unique_id("dc")
    raw = spec.encode(ctx_for(cluster, rid))
    r = parse(internal_pb2.DecodeRequest, raw)
    push_attempt = None
    if spec.extra["with_kv"]:
        attempt = r.attempt if r is not None else 0
        push_attempt = (attempt + 1) % 2**32 if spec.extra["other_attempt"] else attempt
    try:
        if push_attempt is not None:
            # The KV comes first (under a lease of its own size), the Decode then finds it parked.
            kv = kv_tensor(d.fingerprint(), spec.extra["kv_tokens"], spec.extra["content"], spec.extra["seed"])
            reserve(cluster, rid, spec.extra["kv_tokens"])
            pushed = push_kv(channels, cluster, rid, kv, push_attempt)
            assert pushed.code == "OK", pushed
        num_blocks = lease_blocks(spec, r, cluster) if r is not None else 0
        if num_blocks > 0:
            reserve(cluster, rid, num_blocks=num_blocks)
        else:
            release(cluster, rid)
        verdict, timeout, takes_kv = decode_verdict(raw, spec, cluster, num_blocks, push_attempt)
        INPUTS["decode"] += 1
        out = call_stream(raw_method(channels["decode"], "/handoff.v1.DecodeWorker/Decode",
                                     internal_pb2.DecodeEvent), raw, timeout)
        release(cluster, rid)
        judge(out, verdict, WORKER_CODES | {"DEADLINE_EXCEEDED"} if timeout < CALL_TIMEOUT_S else WORKER_CODES,
              raw, timeout, rpc="decode")
        assert out.blame is None, f"Decode charged its failure to another worker: {out.blame}"
        if push_attempt is not None and not takes_kv:
            # Refused before it looked for KV, or it waited for another attempt's: that KV is still parked.
            claim_kv(channels, cluster, rid, [1] * spec.extra["kv_tokens"], [2], push_attempt)
    except BaseException:
        # A failed example must leave nothing behind, or every later one fails too (and shrinking with it).
        release(cluster, rid)
        if push_attempt is not None:
            d.inbox.cancel(seq_key(rid, push_attempt))
        raise
    assert_nothing_parked(cluster)
    if out.code != "OK":
        return
    r = verdict.request
    events = out.responses
    assert events and events[-1].HasField("finish_reason")
    assert all(not e.HasField("finish_reason") for e in events[:-1])
    ids = [t for e in events for t in e.token_ids]
    assert all(0 <= t < d.model.config.vocab_size for t in ids)
    # output_ids are completion tokens 0 .. n-1; what follows is token n onwards, up to max_tokens.
    max_output = min(r.sampling.max_tokens, d.model.config.max_position - len(r.prompt_ids))
    num_left = max(0, max_output - len(r.output_ids))
    if completion_ends(cluster, r.sampling, len(r.prompt_ids), r.output_ids):
        assert ids == [] and len(events) == 1, ("the completion had already ended", events)
    elif r.sampling.ignore_eos and not r.sampling.stop and not r.sampling.stop_token_ids:
        assert len(ids) == num_left and events[-1].finish_reason == handoff_pb2.FINISH_REASON_LENGTH, (ids, r)
    else:
        assert 1 <= len(ids) <= num_left, (len(ids), r)
