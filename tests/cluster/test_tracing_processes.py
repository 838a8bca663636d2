"""Tracing across real processes (`python -m router`, `prefill_svc`, `decode_svc`), exported by their real
OTLP/gRPC exporters, as OTEL_EXPORTER_OTLP_ENDPOINT alone turns them on, to a receiver in the test
(tests/support/otlp.py): one trace from the caller through the three services, each span's parent in
another process where the request crossed one; a decode worker killed mid-stream leaves a failed attempt
span that names it, and the retry's spans; OTEL_TRACES_EXPORTER=none sends nothing. The in-process
counterpart, with the SDK's in-memory exporter: tests/cluster/test_tracing.py."""
from __future__ import annotations

import threading
import time

import grpc
import pytest

from protos import handoff_pb2, handoff_pb2_grpc
from tests.support.otlp import Receiver
from tests.support.proc_cluster import ProcCluster

pytestmark = [pytest.mark.faults, pytest.mark.timeout(600)]

CALLER_TRACE = "5bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "10f067aa0ba902b7"
# Three prefill chunks: the K/V streams in three segments.
LONG_PROMPT = "The story of a cat who walked on through the long grass while the sun went down. " * 40


@pytest.fixture(scope="module")
def receiver():
    with Receiver() as r:
        yield r


@pytest.fixture(scope="module")
def procs(tmp_path_factory, receiver):
    # Only the endpoint: the services' default (no OTEL_TRACES_EXPORTER) is otlp once it is set. A short
    # batch delay so that spans arrive while the test waits.
    c = ProcCluster(tmp_path_factory.mktemp("traced"), num_prefill=1, num_decode=2,
                    env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50"}).start()
    yield c
    c.stop()


def traceparent(trace_id: str, span_id: str = CALLER_SPAN) -> list[tuple[str, str]]:
    return [("traceparent", f"00-{trace_id}-{span_id}-01")]


def by_name(spans) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def test_one_trace_across_router_prefill_and_decode_processes(procs, receiver):
    with grpc.insecure_channel(procs.router_address) as ch:
        msgs = list(handoff_pb2_grpc.RouterStub(ch).Generate(handoff_pb2.GenerateRequest(
            prompt=LONG_PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, request_id="proc-traced"),
            timeout=120, metadata=traceparent(CALLER_TRACE)))
    assert sum(len(m.token_ids) for m in msgs) == 6
    spans = by_name(receiver.wait_for(CALLER_TRACE, {n: 1 for n in (
        "generate", "attempt", "reserve", "prefill", "kv.push", "kv.receive", "claim", "decode")}))
    one = {name: found[0] for name, found in spans.items()}
    services = {name: s.service for name, s in one.items()}
    assert services == {"generate": "handoff-router", "attempt": "handoff-router", "reserve": "handoff-router",
                        "prefill": "handoff-prefill", "kv.push": "handoff-prefill", "kv.receive": "handoff-decode",
                        "claim": "handoff-decode", "decode": "handoff-decode"}, services
    assert one["generate"].parent_id == CALLER_SPAN, "the caller's trace continues"
    for child, parent in {"attempt": "generate", "reserve": "attempt", "prefill": "attempt", "kv.push": "prefill",
                          "kv.receive": "kv.push", "claim": "attempt", "decode": "attempt"}.items():
        assert one[child].parent_id == one[parent].span_id, f"{child}'s parent is not {parent}"
    assert not [s for found in spans.values() for s in found if s.error], "nothing failed"
    assert len([e for e, _ in one["prefill"].events if e == "prefill.chunk"]) == 3
    assert len([e for e, _ in one["kv.push"].events if e == "kv.segment"]) == 3
    assert one["decode"].attributes["handoff.completion_tokens"] == 5
    assert one["decode"].attributes["handoff.batch_max"] >= 1
    assert procs.state.get_request("proc-traced")["trace_id"] == CALLER_TRACE


def test_a_decode_worker_killed_mid_stream_leaves_a_failed_attempt_that_names_it(procs, receiver):
    trace_id = "6" * 32
    received: list[int] = []
    errors: list[grpc.RpcError] = []

    def stream() -> None:
        with grpc.insecure_channel(procs.router_address) as ch:
            try:
                for msg in handoff_pb2_grpc.RouterStub(ch).Generate(handoff_pb2.GenerateRequest(
                        prompt="Once upon a time", max_tokens=120, temperature=0.0, ignore_eos=True,
                        request_id="proc-failover"), timeout=180, metadata=traceparent(trace_id)):
                    received.extend(msg.token_ids)
            except grpc.RpcError as exc:
                errors.append(exc)

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 90
    while len(received) < 4:
        assert time.monotonic() < deadline and client.is_alive(), "the stream did not get going"
        time.sleep(0.01)
    victim = procs.state.get_request("proc-failover")["decode_worker"]
    procs.kill(victim)
    client.join(180)
    assert not errors and len(received) == 120, (errors, len(received))
    spans = by_name(receiver.wait_for(trace_id, {"generate": 1, "attempt": 2, "decode": 1}))
    attempts = sorted(spans["attempt"], key=lambda s: s.attributes["handoff.attempt"])
    first, second = attempts
    assert first.error and victim in first.error, first.error
    assert first.attributes["handoff.failed.role"] == "decode"
    assert first.attributes["handoff.failed.worker_id"] == victim
    assert second.error is None and second.attributes["handoff.decode_worker"] != victim
    assert second.attributes["handoff.resumed_tokens"] >= 4, "the retry resumed after what the client had"
    # The killed worker exported nothing more; the survivor's decode span is the retry's.
    decode = spans["decode"][-1]
    assert decode.parent_id == second.span_id and decode.attributes["handoff.worker_id"] != victim
    assert spans["generate"][0].attributes["handoff.completion_tokens"] == 120
    procs.restart(victim)


def test_otel_traces_exporter_none_sends_nothing(procs, receiver):
    """The same services, the endpoint still set, with OTEL_TRACES_EXPORTER=none: no span leaves them."""
    for p in procs.procs.values():
        p.extra_env["OTEL_TRACES_EXPORTER"] = "none"
        p.popen.kill()
        p.popen.wait()
    for p in procs.procs.values():
        procs.spawn(p)
    for p in procs.procs.values():
        procs.wait_serving(p)
    trace_id = "7" * 32
    before = len(receiver.spans)
    with grpc.insecure_channel(procs.router_address) as ch:
        stub = handoff_pb2_grpc.RouterStub(ch)
        for attempt in range(40):  # the router may not have read the registry yet
            try:
                list(stub.Generate(handoff_pb2.GenerateRequest(prompt=LONG_PROMPT, max_tokens=4,
                                                               request_id="proc-untraced"),
                                   timeout=120, metadata=traceparent(trace_id)))
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == 39:
                    raise
                time.sleep(0.25)
    time.sleep(1.0)  # twenty batch delays
    assert receiver.of_trace(trace_id) == [] and len(receiver.spans) == before
    assert "trace_id" not in procs.state.get_request("proc-untraced")
