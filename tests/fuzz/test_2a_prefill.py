"""Fuzzing PrefillWorker.Prefill with raw requests, and the leases its KV push needs."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decode_svc.worker import seq_key
from protos import internal_pb2
from tests.fuzz.protowire import (
    ANY_VARINT,
    CALL_TIMEOUT_S,
    FUZZ,
    GARBAGE,
    INPUTS,
    LEASES,
    SANE_ATTEMPT,
    SANE_IDS,
    WILD_ATTEMPT,
    WILD_IDS,
    WORKER_CODES,
    Ctx,
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
    f_len,
    f_packed,
    f_varint,
    id_part,
    id_violations,
    internal_sampling,
    judge,
    parse,
    pick,
    raw_method,
    release,
    reserve,
    sampling_violations,
    unique_id,
    wire_text,
)

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


SANE_RESUME = st.one_of(st.just([]), st.just([]), st.just([]), st.lists(st.integers(0, 49151), min_size=1, max_size=4))


WILD_RESUME = st.one_of(
    st.lists(st.one_of(st.integers(0, 49151), ANY_VARINT), max_size=6),
    st.tuples(st.integers(0, 49151), st.integers(8192, 9000)).map(lambda t: [t[0]] * t[1]))


@st.composite
def prefill_requests(draw) -> Spec:
    sane = draw(st.integers(0, 3)) == 0
    rid = pick(draw, sane, st.none(), st.one_of(wire_text(), st.just(b"")))
    ids = pick(draw, sane, SANE_IDS, WILD_IDS)
    parts: list[Part] = [id_part(1, rid)]
    parts += [f_packed(2, ids)] if draw(st.booleans()) else [f_varint(2, t) for t in ids]
    if sane or draw(st.integers(0, 5)):
        parts.append(f_len(3, draw(internal_sampling(sane or draw(st.booleans()), max_tokens=st.integers(1, 8)))))
    resume = pick(draw, sane, SANE_RESUME, WILD_RESUME)
    parts += [f_packed(5, resume)] if draw(st.booleans()) else [f_varint(5, t) for t in resume]
    # The target: the real decode worker, or any field wrong.
    worker = pick(draw, sane, st.just("real"), st.one_of(st.just(b""), wire_text(max_size=8)))
    address = pick(draw, sane, st.just("real"), st.one_of(
        st.sampled_from(["decode-main", "prefill", "refused"]),
        st.sampled_from([b"", b"nonsense", b":::", b"unix:/nonexistent", b"127.0.0.1:99999", b"dns:///", b"[::1"]),
        # Any port on this host: mostly refused, now and then another service of the cluster.
        st.integers(1, 65535).map(lambda port: f"127.0.0.1:{port}".encode())), odds=2)
    epoch = pick(draw, sane, st.just("real"), st.one_of(st.just(b""), wire_text(max_size=8)))
    reservation = draw(wire_text(max_size=8))
    attempt = attempt_part(5, pick(draw, sane, SANE_ATTEMPT, WILD_ATTEMPT))

    def target(c: Ctx) -> bytes:
        addresses = {"real": c.kv_address, "decode-main": c.decode_address, "prefill": c.prefill_address,
                     "refused": "127.0.0.1:1"}
        a = addresses[address].encode() if isinstance(address, str) else address
        w = c.decode_id.encode() if worker == "real" else worker
        e = c.decode_epoch.encode() if epoch == "real" else epoch
        return f_len(4, f_len(1, w) + f_len(2, a) + f_len(3, e) + f_len(4, reservation) + b"".join(attempt))

    if sane or draw(st.integers(0, 5)):
        parts.append(target)
    if not sane:
        parts += draw(extra_fields(max_size=2))
    garbage = None if sane or draw(st.integers(0, 7)) else draw(GARBAGE)
    return Spec(parts, garbage, {"lease": "full" if sane else draw(LEASES)})


# (request_id, attempt) of every Prefill that got as far as pushing: the decode worker refuses a key
# whose Decode call already ended (the claim below ends one) for its KV wait.
PREFILL_USED_KEYS: set[tuple[str, int]] = set()


def lease_blocks(spec: Spec, r, cluster) -> int:
    """Blocks reserved for the push: room for the prompt and what follows it, none, or one too few."""
    pool = cluster.decode[0].engine.pool
    need = pool.blocks_for(len(r.prompt_ids))  # what the push checks
    full = pool.blocks_for(len(r.prompt_ids) + len(r.output_ids) + 1)
    return min({"full": full, "none": 0, "small": max(0, need - 1)}[spec.extra["lease"]], pool.num_blocks)


def real_target(r, cluster) -> bool:
    d = cluster.decode[0]
    return (r.target.worker_id, r.target.kv_address, r.target.epoch) == (d.config.worker_id, d.kv_address, d.epoch)


def prefill_verdict(raw: bytes, cluster, num_blocks: int) -> Verdict:
    r = parse(internal_pb2.PrefillRequest, raw)
    if r is None:
        return Verdict({"INVALID_ARGUMENT"}, why="not a parseable PrefillRequest")
    cfg = cluster.prefill[0].model.config
    bad = [] if r.request_id else ["request_id"]
    bad += sampling_violations(r.sampling, cfg.vocab_size)
    if r.sampling.max_tokens < 1:
        bad.append("max_tokens")
    bad += id_violations(r.prompt_ids, cfg.vocab_size, cfg.max_position - 1, "prompt_ids")
    if r.output_ids:
        bad += id_violations(r.output_ids, cfg.vocab_size, cfg.max_position - len(r.prompt_ids), "output_ids")
    t = r.target
    if not (t.worker_id and t.kv_address and t.epoch):
        bad.append("target")
    if bad:
        return Verdict({"INVALID_ARGUMENT"}, tuple(bad), "violates " + ", ".join(bad), r)
    if r.output_ids and completion_ends(cluster, r.sampling, len(r.prompt_ids), r.output_ids):
        return Verdict({"INVALID_ARGUMENT"}, ("output_ids",), "resumes a completion that already ended", r)
    # A first token that surely ends the request is never pushed: the target does not matter then.
    if not r.output_ids and min(r.sampling.max_tokens, cfg.max_position - len(r.prompt_ids)) == 1:
        return Verdict({"OK"}, why="valid, and its first token ends it", request=r)
    if not real_target(r, cluster):
        # The push goes wrong downstream; prefill must say how, with a clean status.
        return Verdict(WORKER_CODES | {"UNIMPLEMENTED"}, why="valid but a bad target", request=r)
    if num_blocks < cluster.decode[0].engine.pool.blocks_for(len(r.prompt_ids)):
        # Refused at the push's header, unless the first token ends the request and nothing is pushed.
        hint = "no live reservation" if num_blocks == 0 else f"reserved {num_blocks} KV blocks"
        return Verdict({"FAILED_PRECONDITION", "OK"}, (hint,), f"a lease of {num_blocks} blocks", r,
                       hint_code="FAILED_PRECONDITION")
    if (r.request_id, t.attempt) in PREFILL_USED_KEYS:
        return Verdict({"OK", "CANCELLED"}, why="valid, but its request id and attempt were used before", request=r)
    return Verdict({"OK"}, why="valid, pushed to the real decode worker under a lease", request=r)


@settings(FUZZ, max_examples=230)
@given(spec=prefill_requests())
def test_fuzz_prefill(cluster, channels, baseline, spec):
    rid = unique_id("pf")
    raw = spec.encode(ctx_for(cluster, rid))
    r = parse(internal_pb2.PrefillRequest, raw)
    leased = r is not None and bool(r.request_id)  # a lease needs an id; without one the request is refused
    try:
        num_blocks = lease_blocks(spec, r, cluster) if leased else 0
        if num_blocks:
            reserve(cluster, r.request_id, num_blocks=num_blocks)
        verdict = prefill_verdict(raw, cluster, num_blocks)
        INPUTS["prefill"] += 1
        out = call_stream(raw_method(channels["prefill"], "/handoff.v1.PrefillWorker/Prefill",
                                     internal_pb2.PrefillEvent), raw, CALL_TIMEOUT_S)
        if leased:
            release(cluster, r.request_id)
        # UNIMPLEMENTED: the target was a server without KVTransfer (the prefill worker itself).
        judge(out, verdict, WORKER_CODES | {"UNIMPLEMENTED"}, raw, rpc="prefill")
        if verdict.request is not None:
            PREFILL_USED_KEYS.add((r.request_id, r.target.attempt))
        check_stream(out, verdict, cluster, channels)
    except BaseException:
        # A failed example must leave nothing behind, or every later one fails too (and shrinking with it).
        if leased:
            release(cluster, r.request_id)
            cluster.decode[0].inbox.cancel(seq_key(r.request_id, r.target.attempt))
        raise
    assert_nothing_parked(cluster)


def check_stream(out, verdict: Verdict, cluster, channels) -> None:
    """The events the contract promises: first_token then transfer_done (a resume: transfer_done only;
    a first token that ends the request: first_token only); a failed push charged to its target."""
    r = verdict.request
    served = r is not None and verdict.codes != {"INVALID_ARGUMENT"}  # it got past validation
    if out.code != "OK":
        if not served or out.code == "INVALID_ARGUMENT":
            assert out.blame is None, f"prefill charged its own refusal to {out.blame}"
            return
        # Every failure of a valid request here is its KV push's: charged to the target it named.
        role = "link" if out.code == "DATA_LOSS" else "decode"
        assert out.blame == (role, r.target.worker_id, r.target.epoch), (out, r.target)
        first = [e for e in out.responses if e.HasField("first_token")]
        assert len(out.responses) == len(first) == (0 if r.output_ids else 1), out.responses
        assert not any(e.first_token.finished for e in first), "a finished first token, then a push"
        return
    events = out.responses
    cfg = cluster.prefill[0].model.config
    if r.output_ids:
        assert [e.WhichOneof("event") for e in events] == ["transfer_done"], events
    else:
        assert events and events[0].HasField("first_token"), events
        first = events[0].first_token
        assert 0 <= first.token_id < cfg.vocab_size
        # "finished": exactly when this token ends the request, as the router's OutputProcessor sees it.
        assert first.finished == completion_ends(cluster, r.sampling, len(r.prompt_ids), [first.token_id]), first
        if first.finished:
            assert len(events) == 1, ("KV pushed after a finished first token", events)
            return
        assert [e.WhichOneof("event") for e in events] == ["first_token", "transfer_done"], events
    assert real_target(r, cluster), f"a push to {r.target} was accepted"
    done = events[-1].transfer_done
    assert done.kv_bytes == cluster.decode[0].fingerprint().kv_bytes(len(r.prompt_ids))
    output_ids = list(r.output_ids) or [events[0].first_token.token_id]
    claim_kv(channels, cluster, r.request_id, list(r.prompt_ids), output_ids, r.target.attempt)
