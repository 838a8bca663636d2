"""Fuzzing PrefillWorker.Prefill with raw requests."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protos import internal_pb2
from tests.fuzz.protowire import (
    CALL_TIMEOUT_S,
    FUZZ,
    GARBAGE,
    INPUTS,
    SANE_IDS,
    WILD_IDS,
    WORKER_CODES,
    Ctx,
    Part,
    Spec,
    Verdict,
    call_stream,
    claim_kv,
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
    sampling_violations,
    unique_id,
    wire_text,
)

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


@st.composite
def prefill_requests(draw) -> Spec:
    sane = draw(st.integers(0, 3)) == 0
    rid = pick(draw, sane, st.none(), st.one_of(wire_text(), st.just(b"")))
    ids = pick(draw, sane, SANE_IDS, WILD_IDS)
    parts: list[Part] = [id_part(1, rid)]
    parts += [f_packed(2, ids)] if draw(st.booleans()) else [f_varint(2, t) for t in ids]
    if sane or draw(st.integers(0, 5)):
        parts.append(f_len(3, draw(internal_sampling(sane or draw(st.booleans()), max_tokens=st.integers(1, 8)))))
    # The target: the real decode worker, or any field wrong.
    worker = pick(draw, sane, st.just("real"), st.one_of(st.just(b""), wire_text(max_size=8)))
    address = pick(draw, sane, st.just("real"), st.one_of(
        st.sampled_from(["decode-main", "prefill", "refused"]),
        st.sampled_from([b"", b"nonsense", b":::", b"unix:/nonexistent", b"127.0.0.1:99999", b"dns:///", b"[::1"]),
        # Any port on this host: mostly refused, now and then another service of the cluster.
        st.integers(1, 65535).map(lambda port: f"127.0.0.1:{port}".encode())), odds=2)
    epoch = pick(draw, sane, st.just("real"), st.one_of(st.just(b""), wire_text(max_size=8)))
    reservation = draw(wire_text(max_size=8))

    def target(c: Ctx) -> bytes:
        addresses = {"real": c.kv_address, "decode-main": c.decode_address, "prefill": c.prefill_address,
                     "refused": "127.0.0.1:1"}
        a = addresses[address].encode() if isinstance(address, str) else address
        w = c.decode_id.encode() if worker == "real" else worker
        e = c.decode_epoch.encode() if epoch == "real" else epoch
        return f_len(4, f_len(1, w) + f_len(2, a) + f_len(3, e) + f_len(4, reservation))

    if sane or draw(st.integers(0, 5)):
        parts.append(target)
    if not sane:
        parts += draw(extra_fields(max_size=2))
    garbage = None if sane or draw(st.integers(0, 7)) else draw(GARBAGE)
    return Spec(parts, garbage, {"target": (worker, address, epoch)})


PREFILL_USED_RIDS: set[str] = set()


def prefill_verdict(raw: bytes, spec: Spec, cluster) -> Verdict:
    r = parse(internal_pb2.PrefillRequest, raw)
    if r is None:
        return Verdict({"INVALID_ARGUMENT"}, why="not a parseable PrefillRequest")
    cfg = cluster.prefill[0].model.config
    bad = sampling_violations(r.sampling, cfg.vocab_size)
    if r.sampling.max_tokens < 1:
        bad.append("max_tokens")
    bad += id_violations(r.prompt_ids, cfg.vocab_size, cfg.max_position - 1, "prompt_ids")
    t = r.target
    if not (t.worker_id and t.kv_address and t.epoch):
        bad.append("target")
    if bad:
        return Verdict({"INVALID_ARGUMENT"}, tuple(bad), "violates " + ", ".join(bad), r)
    d = cluster.decode[0]
    if (t.worker_id, t.kv_address, t.epoch) == (d.config.worker_id, d.kv_address, d.epoch) and r.request_id:
        if r.request_id in PREFILL_USED_RIDS:
            # The decode worker remembers a finished request id for a while and refuses its KV again.
            return Verdict({"OK", "CANCELLED"}, why="valid, but its request id was used before", request=r)
        return Verdict({"OK"}, why="valid, pushed to the real decode worker", request=r)
    # The push goes wrong downstream; prefill must say how, with a clean status.
    return Verdict(WORKER_CODES - {"OK"} | {"UNIMPLEMENTED", "OK"}, why="valid but a bad target", request=r)


@settings(FUZZ, max_examples=230)
@given(spec=prefill_requests())
def test_fuzz_prefill(cluster, channels, baseline, spec):
    rid = unique_id("pf")
    raw = spec.encode(ctx_for(cluster, rid))
    verdict = prefill_verdict(raw, spec, cluster)
    INPUTS["prefill"] += 1
    out = call_stream(raw_method(channels["prefill"], "/handoff.v1.PrefillWorker/Prefill",
                                 internal_pb2.PrefillEvent), raw, CALL_TIMEOUT_S)
    # UNIMPLEMENTED: the target was a server without KVTransfer (the prefill worker itself).
    judge(out, verdict, WORKER_CODES | {"UNIMPLEMENTED"}, raw, rpc="prefill")
    if verdict.request is not None:
        PREFILL_USED_RIDS.add(verdict.request.request_id)
    if out.code != "OK":
        return
    r = verdict.request
    first, done = out.responses
    assert first.HasField("first_token") and done.HasField("transfer_done")
    assert 0 <= first.first_token.token_id < cluster.prefill[0].model.config.vocab_size
    fp = cluster.decode[0].fingerprint()
    assert done.transfer_done.kv_bytes == fp.kv_bytes(len(r.prompt_ids))
    if r.target.kv_address == cluster.decode[0].kv_address:
        claim_kv(channels, cluster, r.request_id, list(r.prompt_ids), first.first_token.token_id)
