"""An OTLP/gRPC trace receiver in the test process: what a collector would get from the services' real exporters.

It serves opentelemetry.proto's TraceService on a free port (point OTEL_EXPORTER_OTLP_ENDPOINT at
`endpoint`) and keeps every span it is sent, decoded into `Span`s with the service.name of the process that
sent them.
"""
from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from common.ports import free_port


@dataclass
class Span:
    service: str
    name: str
    trace_id: str  # hex, as traceparent writes it
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict
    events: list[tuple[str, dict]] = field(default_factory=list)
    error: str | None = None  # the status description when the span failed


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _attributes(kvs) -> dict:
    return {kv.key: _value(kv.value) for kv in kvs}


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    STATUS_ERROR = 2  # opentelemetry.proto.trace.v1.Status.STATUS_CODE_ERROR

    def __init__(self):
        self.spans: list[Span] = []
        self._lock = threading.Lock()
        self.port = free_port()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"127.0.0.1:{self.port}")

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "Receiver":
        self._server.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.stop(grace=None)

    def Export(self, request: trace_service_pb2.ExportTraceServiceRequest, context):
        got = []
        for rs in request.resource_spans:
            service = _attributes(rs.resource.attributes).get("service.name", "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Span(service, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                    _attributes(s.attributes), [(e.name, _attributes(e.attributes)) for e in s.events],
                                    s.status.message if s.status.code == self.STATUS_ERROR else None))
        with self._lock:
            self.spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[Span]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, names: dict[str, int], timeout_s: float = 30) -> list[Span]:
        """The trace's spans once it has at least names[name] spans of each name (exporters batch, and a
        worker ends its spans just after the client has its last token)."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.of_trace(trace_id)
            counts = {n: sum(s.name == n for s in spans) for n in names}
            if all(counts[n] >= k for n, k in names.items()):
                return spans
            assert time.monotonic() < deadline, f"trace {trace_id}: got {counts}, want {names}"
            time.sleep(0.05)
