"""Tracing (common/tracing.py) in an in-process cluster, every span caught by the SDK's in-memory exporter:
one trace per request across router, prefill worker, KV push and decode worker, with the parent of each
span as docs/operations.md ("Tracing") draws it; a caller's traceparent (gRPC metadata, HTTP header)
continues; a failover is an attempt span with its cause; the trace id is in the Redis record, the log and
the error a client gets; and with tracing off there is none of it. The same across real processes, over
the real OTLP exporter: tests/deploy/test_tracing_processes.py."""
from __future__ import annotations

import json
import logging
import time
import urllib.request
from dataclasses import replace

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from common import grpc_common, tracing
from common.grpc_common import ServiceError
from decode_svc.inbox import seq_key
from protos import handoff_pb2, handoff_pb2_grpc
from router.cluster import Cluster
from router.server import RouterServer
from tests.support.cluster import wait_idle

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
CALLER = f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"
# Three prefill chunks (256 tokens each): the K/V streams to the decode worker in three segments.
LONG_PROMPT = "The story of a cat who walked on through the long grass while the sun went down. " * 40


@pytest.fixture(scope="module")
def exporter():
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    tracing.use(provider)  # before the workers start: the decode workers keep batch sizes only when on
    yield spans
    tracing.use(None)
    provider.shutdown()


@pytest.fixture(scope="module")
def cluster(exporter):
    c = Cluster(num_prefill=1, num_decode=2, kv_memory_gib=0.1, threads=1).start()
    yield c
    c.stop()


@pytest.fixture(scope="module")
def stub(cluster):
    ch = grpc.insecure_channel(cluster.address)
    yield handoff_pb2_grpc.RouterStub(ch)
    ch.close()


def hex_id(span_id: int) -> str:
    return trace.format_span_id(span_id)


def spans_of(exporter: InMemorySpanExporter, trace_id: str, want: set[str], timeout_s: float = 10) -> dict:
    """The finished spans of one trace, by name (lists), once every name in `want` is among them: a worker
    ends its spans just after the client has its last token."""
    deadline = time.monotonic() + timeout_s
    while True:
        found: dict[str, list] = {}
        for s in exporter.get_finished_spans():
            if trace.format_trace_id(s.context.trace_id) == trace_id:
                found.setdefault(s.name, []).append(s)
        if want <= set(found) or time.monotonic() > deadline:
            assert want <= set(found), f"spans missing from trace {trace_id}: {want - set(found)} (have {set(found)})"
            return found


def parent_of(span) -> str:
    return hex_id(span.parent.span_id) if span.parent is not None else ""


def generate(stub, metadata=None, **fields) -> list[handoff_pb2.GenerateResponse]:
    return list(stub.Generate(handoff_pb2.GenerateRequest(**fields), timeout=120, metadata=metadata))


def test_one_trace_from_the_caller_through_prefill_push_and_decode(cluster, stub, exporter):
    msgs = generate(stub, [("traceparent", CALLER)], prompt=LONG_PROMPT, max_tokens=6, temperature=0.0,
                    ignore_eos=True, request_id="traced-long")
    assert sum(len(m.token_ids) for m in msgs) == 6
    found = spans_of(exporter, CALLER_TRACE, {"generate", "attempt", "reserve", "prefill", "kv.push", "kv.receive",
                                              "claim", "decode"})
    one = {name: spans[0] for name, spans in found.items()}
    for name in ("generate", "attempt", "reserve", "prefill", "kv.push", "claim", "decode"):
        assert len(found[name]) == 1, f"{name}: {len(found[name])} spans"
    ids = {name: hex_id(s.context.span_id) for name, s in one.items()}
    # The caller's span is the root's parent; every other span's parent is as docs/operations.md draws it.
    assert parent_of(one["generate"]) == CALLER_SPAN
    expected = {"attempt": "generate", "reserve": "attempt", "prefill": "attempt", "kv.push": "prefill",
                "kv.receive": "kv.push", "claim": "attempt", "decode": "attempt"}
    for child, parent in expected.items():
        assert parent_of(one[child]) == ids[parent], f"{child}'s parent is not {parent}"
    assert all(s.status.status_code != StatusCode.ERROR for spans in found.values() for s in spans)
    # What each says.
    gen, prefill, push, decode = one["generate"], one["prefill"], one["kv.push"], one["decode"]
    assert gen.kind == trace.SpanKind.SERVER and gen.attributes["handoff.request_id"] == "traced-long"
    assert gen.attributes["handoff.completion_tokens"] == 6 and gen.attributes["handoff.finish_reason"] == "length"
    assert one["attempt"].attributes["handoff.attempt"] == 1
    assert one["attempt"].attributes["handoff.prefill_placement"] == "remote"
    chunks = [e for e in prefill.events if e.name == "prefill.chunk"]
    num_prompt = prefill.attributes["handoff.prompt_tokens"]
    assert num_prompt > 512 and len(chunks) == -(-num_prompt // 256), [e.attributes for e in chunks]
    assert [e.name for e in prefill.events][-1] == "first_token"
    segments = [e for e in push.events if e.name == "kv.segment"]
    assert len(segments) == push.attributes["handoff.kv_segments"] == len(chunks)
    assert push.attributes["handoff.kv_bytes"] == one["kv.receive"].attributes["handoff.kv_bytes"] > 0
    assert one["kv.receive"].attributes["handoff.request_id"] == "traced-long"
    # The decode worker streamed the 5 tokens after the prefill's first, in a batch of at least itself.
    assert decode.attributes["handoff.completion_tokens"] == 5, decode.attributes
    assert decode.attributes["handoff.batch_max"] >= 1 and decode.attributes["handoff.batch_at_start"] >= 0
    assert decode.attributes["handoff.worker_id"] == one["claim"].attributes["handoff.worker_id"] \
        == one["attempt"].attributes["handoff.decode_worker"]
    # In time: the decode starts once its K/V is claimed.
    assert one["claim"].end_time <= decode.start_time
    record = cluster.state.get_request("traced-long")
    assert record["trace_id"] == CALLER_TRACE
    wait_idle(cluster)


def test_a_request_without_a_caller_trace_starts_its_own(cluster, stub, exporter):
    generate(stub, prompt="Hello there", max_tokens=3, temperature=0.0, request_id="untraced-caller")
    trace_id = cluster.state.get_request("untraced-caller")["trace_id"]
    assert len(trace_id) == 32 and trace_id != CALLER_TRACE
    found = spans_of(exporter, trace_id, {"generate", "prefill", "decode"})
    assert found["generate"][0].parent is None, "the router's span is the root"
    wait_idle(cluster)


def test_the_http_traceparent_header_continues_the_callers_trace(cluster, exporter):
    trace_id, span_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    req = urllib.request.Request(
        f"{cluster.http_url}/completions", data=json.dumps({"prompt": "Hello", "max_tokens": 3,
                                                            "temperature": 0}).encode(),
        headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{span_id}-01",
                 "X-Request-Id": "traced-http"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert json.loads(resp.read())["choices"][0]["text"]
    found = spans_of(exporter, trace_id, {"generate", "attempt", "prefill", "decode"})
    assert parent_of(found["generate"][0]) == span_id
    assert cluster.state.get_request("traced-http")["trace_id"] == trace_id
    wait_idle(cluster)


def test_a_failover_is_an_attempt_span_with_its_cause(cluster, stub, exporter, caplog, monkeypatch):
    """The first decode worker that sees the request refuses it (as one that just lost its engine would):
    attempt 1 fails, charged to it, attempt 2 serves the request on the other worker; the log line says
    which trace."""
    refused = []

    def refusing(worker):
        check = worker.check_decode

        def check_decode(request):
            if not refused:
                refused.append(worker.config.worker_id)
                raise ServiceError(grpc.StatusCode.UNAVAILABLE, "injected: this worker refuses")
            return check(request)
        return check_decode

    for w in cluster.decode:
        monkeypatch.setattr(w, "check_decode", refusing(w))
    with caplog.at_level(logging.WARNING, logger="router.generate"):
        msgs = generate(stub, [("traceparent", CALLER.replace(CALLER_TRACE, "1" * 32))], prompt="Hello there",
                        max_tokens=4, temperature=0.0, ignore_eos=True, request_id="traced-failover")
    assert sum(len(m.token_ids) for m in msgs) == 4 and refused
    found = spans_of(exporter, "1" * 32, {"generate", "attempt", "decode"})
    attempts = sorted(found["attempt"], key=lambda s: s.attributes["handoff.attempt"])
    assert [a.attributes["handoff.attempt"] for a in attempts] == [1, 2]
    first, second = attempts
    assert first.status.status_code == StatusCode.ERROR and "injected" in first.status.description
    assert first.attributes["handoff.failed.role"] == "decode"
    assert first.attributes["handoff.failed.worker_id"] == refused[0] == first.attributes["handoff.decode_worker"]
    assert first.attributes["handoff.retrying"] is True
    assert second.status.status_code != StatusCode.ERROR and second.attributes["handoff.decode_worker"] != refused[0]
    generate_id = hex_id(found["generate"][0].context.span_id)
    assert parent_of(first) == parent_of(second) == generate_id
    # The refusing worker's claim span failed with the refusal; the decode ran under attempt 2.
    claims = {c.attributes["handoff.worker_id"]: c for c in found["claim"]}
    assert claims[refused[0]].status.status_code == StatusCode.ERROR
    assert parent_of(claims[refused[0]]) == hex_id(first.context.span_id)
    assert [parent_of(d) for d in found["decode"]] == [hex_id(second.context.span_id)]
    logged = [r.getMessage() for r in caplog.records if "attempt 1 failed" in r.getMessage()]
    assert logged and f"traced-failover (trace {'1' * 32})" in logged[0], logged
    # A start refused after its push landed leaves that K/V to the inbox's expiry (the KV wait, 30 s): drop it.
    for w in cluster.decode:
        w.inbox.cancel(seq_key("traced-failover", 1))
    wait_idle(cluster)


def test_a_colocated_request_is_one_decode_span_that_prefilled(cluster, exporter):
    """Prefilled on the decode worker: no prefill worker, no push, no claim; the decode span says so."""
    router = RouterServer(replace(cluster.router_config, prefill_mode="colocated", port=0, http_port=-1),
                          cluster.state).start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{router.port}") as ch:
            generate(handoff_pb2_grpc.RouterStub(ch), [("traceparent", CALLER.replace(CALLER_TRACE, "2" * 32))],
                     prompt="Hello there", max_tokens=3, temperature=0.0, ignore_eos=True)
    finally:
        router.stop(grace_s=2)
    found = spans_of(exporter, "2" * 32, {"generate", "attempt", "reserve", "decode"})
    assert not {"prefill", "kv.push", "kv.receive", "claim"} & set(found), set(found)
    attempt, decode = found["attempt"][0], found["decode"][0]
    assert attempt.attributes["handoff.prefill_placement"] == "local"
    assert decode.attributes["handoff.prefill_here"] is True and decode.attributes["handoff.completion_tokens"] == 3
    assert parent_of(decode) == hex_id(attempt.context.span_id)
    wait_idle(cluster)


def test_a_failed_call_logs_its_trace(exporter, caplog):
    """A worker's failed call (the error interceptor's log line) names the trace of the span it failed."""
    span = tracing.start("prefill", tracing.extract([("traceparent", CALLER)]))
    with pytest.raises(ServiceError) as info, tracing.ending(span):
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "the decode worker is gone")
    with caplog.at_level(logging.INFO, logger="common.grpc_common"):
        grpc_common.reported("/handoff.v1.PrefillWorker/Prefill", info.value)
    assert caplog.records[-1].getMessage() == ("/handoff.v1.PrefillWorker/Prefill: UNAVAILABLE: the decode worker "
                                               f"is gone (trace {CALLER_TRACE})")


def test_an_error_names_its_trace(cluster, stub):
    generate(stub, prompt="Hi", max_tokens=1, request_id="traced-twice")
    trace_id = cluster.state.get_request("traced-twice")["trace_id"]
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, prompt="Hi", max_tokens=1, request_id="traced-twice")
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # The second request's own trace: a new one, named at the end of the message.
    details = info.value.details()
    assert details.endswith(")") and "(trace " in details and trace_id not in details, details
    wait_idle(cluster)


def test_with_tracing_off_nothing_is_traced(cluster, stub, exporter):
    tracing.use(None)
    try:
        exporter.clear()
        generate(stub, [("traceparent", CALLER)], prompt=LONG_PROMPT, max_tokens=3, request_id="off-1")
        with pytest.raises(grpc.RpcError) as info:
            generate(stub, prompt="Hi", max_tokens=1, request_id="off-1")
        assert "trace" not in info.value.details()
        assert "trace_id" not in cluster.state.get_request("off-1")
        time.sleep(0.5)
        assert exporter.get_finished_spans() == ()
        # Every helper answers at once with nothing.
        assert tracing.start("x") is tracing.INVALID_SPAN and not tracing.enabled()
        assert tracing.extract([("traceparent", CALLER)]) is None and tracing.metadata(tracing.INVALID_SPAN) == ()
        assert tracing.traceparent(tracing.INVALID_SPAN) == "" == tracing.trace_id(tracing.INVALID_SPAN)
    finally:
        tracing.use(exporter_provider(exporter))
    wait_idle(cluster)


def exporter_provider(exporter: InMemorySpanExporter) -> TracerProvider:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


# ---- what the OTEL_* variables turn on (no cluster)

@pytest.mark.parametrize("env, exporters", [
    ({}, []),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4317"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, ["otlp"]),
    ({"OTEL_TRACES_EXPORTER": "otlp,console"}, ["otlp", "console"]),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, []),
    ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, []),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ["otlp"]),
])
def test_which_exporters_the_environment_asks_for(env, exporters):
    assert tracing.wanted_exporters(env) == exporters


@pytest.mark.parametrize("env, named", [
    ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}, "PROTOCOL"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "x:4318", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"}, "PROTOCOL"),
])
def test_what_cannot_be_done_is_refused_naming_the_variable(env, named):
    with pytest.raises(tracing.TracingConfigError, match=named):
        tracing.wanted_exporters(env)


def test_configure_installs_nothing_when_not_asked(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    was = tracing._tracer
    try:
        assert tracing.configure("handoff-test") is False
        assert not tracing.enabled()
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider), "no global provider either"
    finally:
        tracing._tracer = was
