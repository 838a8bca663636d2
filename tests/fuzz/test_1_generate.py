"""Fuzzing Router.Generate: raw GenerateRequest bytes against the proto contract's oracle."""
from __future__ import annotations

import pytest
from hypothesis import given, settings

from protos import handoff_pb2
from tests.fuzz.protowire import (
    ACCEPTED_RIDS,
    CALL_TIMEOUT_S,
    FUZZ,
    INPUTS,
    POOL_TOO_SMALL,
    ROUTER_CODES,
    call_stream,
    ctx_for,
    generate_requests,
    generate_verdict,
    judge,
    raw_method,
)

pytestmark = pytest.mark.timeout(600)  # a hang is one of the failures looked for: end it


GENERATE_USED_RIDS: set[str] = set()


@settings(FUZZ, max_examples=450)
@given(spec=generate_requests())
def test_fuzz_generate(cluster, channels, baseline, spec):
    raw = spec.encode(ctx_for(cluster, ""))
    verdict = generate_verdict(raw, cluster, GENERATE_USED_RIDS)
    INPUTS["generate"] += 1
    out = call_stream(raw_method(channels["router"], "/handoff.v1.Router/Generate", handoff_pb2.GenerateResponse),
                      raw, CALL_TIMEOUT_S)
    judge(out, verdict, ROUTER_CODES, raw, rpc="generate")
    r = verdict.request
    if r is not None and r.request_id and (out.code in ("OK", "RESOURCE_EXHAUSTED", "UNAVAILABLE") or
                                           verdict.why == POOL_TOO_SMALL):
        GENERATE_USED_RIDS.add(r.request_id)
        ACCEPTED_RIDS.append(r.request_id)
    if out.code != "OK":
        return
    msgs = out.responses
    assert msgs, "a successful stream with no message"
    last = msgs[-1]
    assert last.finish_reason in (handoff_pb2.FINISH_REASON_STOP, handoff_pb2.FINISH_REASON_LENGTH), last
    assert all(m.finish_reason == handoff_pb2.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])
    ids = [t for m in msgs for t in m.token_ids]
    assert len(ids) <= verdict.max_tokens and last.completion_tokens <= verdict.max_tokens
    assert all(0 <= t < cluster.decode[0].model.config.vocab_size for t in ids)
    assert last.prompt_tokens == verdict.prompt_len
    assert len({m.request_id for m in msgs}) == 1 and msgs[0].request_id
    if r.request_id:
        assert last.request_id == r.request_id
    else:
        ACCEPTED_RIDS.append(last.request_id)
    if r.HasField("seed"):
        assert last.seed == r.seed
