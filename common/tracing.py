"""OpenTelemetry tracing: one trace per request across the router, the prefill worker, the KV push and the
decode worker (span names and attributes: docs/operations.md, "Tracing").

Off unless the standard OTEL_* variables ask for it (`configure`): then no tracer provider is installed,
`start()` hands back OpenTelemetry's shared non-recording span at once, and every helper here returns an
empty answer, so a request does no span work. Spans are per request or per phase of one (a prefill chunk,
a KV segment), never per token.

The W3C trace context travels as `traceparent` (and `tracestate`) gRPC metadata on the Prefill and PushKV
calls and as HTTP headers into the router; on a decode session, which carries many requests over one
stream, it travels in `DecodeRequest.traceparent`. Contexts are passed explicitly, never through
the current one: the router's requests share one event loop, the workers' share threads.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Iterable, Mapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import INVALID_SPAN, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

SERVER, INTERNAL, CLIENT = SpanKind.SERVER, SpanKind.INTERNAL, SpanKind.CLIENT
# The exporters OTEL_TRACES_EXPORTER may name here; "none" (or nothing asked for) is off.
EXPORTERS = ("otlp", "console", "none")
KEYS = ("traceparent", "tracestate")  # W3C trace context: the metadata keys and HTTP headers carried

_propagator = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # None: off
_provider = None  # the SDK provider configure() made, shut down by close()


class TracingConfigError(ValueError):
    """The OTEL_* variables ask for something this service cannot do; the message names the variable."""


def wanted_exporters(environ: Mapping[str, str] = os.environ) -> list[str]:
    """Which exporters the OTEL_* variables ask for, [] for none (tracing off).

    On when OTEL_TRACES_EXPORTER names otlp or console, or when it is unset and an OTLP endpoint is
    (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). The specification's default
    exporter is otlp to localhost; handoff's is none, so that a pod without a collector sends nothing.
    OTEL_SDK_DISABLED=true turns it off whatever else is set."""
    def get(name: str) -> str:
        return environ.get(name, "").strip()

    if get("OTEL_SDK_DISABLED").lower() == "true":
        return []
    names = [n.strip().lower() for n in get("OTEL_TRACES_EXPORTER").split(",") if n.strip()]
    if not names and (get("OTEL_EXPORTER_OTLP_ENDPOINT") or get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        names = ["otlp"]
    unknown = [n for n in names if n not in EXPORTERS]
    if unknown:
        raise TracingConfigError(f"OTEL_TRACES_EXPORTER={get('OTEL_TRACES_EXPORTER')!r}: handoff exports traces "
                                 f"with {', '.join(EXPORTERS)}, not {', '.join(unknown)}")
    if "otlp" in names:
        protocol = get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        if protocol != "grpc":
            raise TracingConfigError(f"OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL={protocol!r}: handoff's OTLP exporter "
                                     f"speaks grpc (a collector's port 4317), not {protocol}")
    return [n for n in names if n != "none"]


def configure(service: str) -> bool:
    """A service's tracing from the environment (its main calls this once, before serving): an SDK tracer
    provider with a batching exporter when the OTEL_* variables ask for one (wanted_exporters), nothing
    at all otherwise. The service name is OTEL_SERVICE_NAME's, else `service` (handoff-router, ...).
    Whether tracing is on; a TracingConfigError names a variable that asks for what cannot be done."""
    exporters = wanted_exporters()
    if not exporters:
        use(None)
        log.info("tracing off (no OTEL_TRACES_EXPORTER or OTEL_EXPORTER_OTLP_ENDPOINT)")
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service}))
    # close() flushes within a bound: the SDK's own exit hook may wait 30 s for an unreachable collector.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    for name in exporters:
        if name == "otlp":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter = OTLPSpanExporter()
        else:
            exporter = ConsoleSpanExporter(service_name=service)
        provider.add_span_processor(BatchSpanProcessor(exporter))
    global _provider
    _provider = provider
    use(provider)
    endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or "localhost:4317")
    log.info("tracing on: service %s, exporting to %s", resource.attributes[SERVICE_NAME],
             ", ".join(f"OTLP/gRPC {endpoint}" if n == "otlp" else n for n in exporters))
    return True


def use(provider) -> None:
    """Trace with `provider` (a TracerProvider; tests use one with an in-memory exporter), or not at all
    (None). Only this module's tracer changes: the OpenTelemetry global provider is never set."""
    global _tracer
    _tracer = None if provider is None else provider.get_tracer("handoff")


def enabled() -> bool:
    return _tracer is not None


def close(timeout_s: float = 2.0) -> None:
    """Export what is still queued, for at most timeout_s (the service is stopping: an unreachable collector
    must not hold up its exit), then stop tracing."""
    global _provider
    provider, _provider = _provider, None
    use(None)
    if provider is not None:
        done = threading.Thread(target=provider.shutdown, name="tracing-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)


# ---- spans

def start(name: str, parent: Context | Span | None = None, *, kind: SpanKind = INTERNAL,
          attributes: dict | None = None) -> Span:
    """A started span, a child of `parent` (a span, or a context extracted from a caller) or a root; with
    tracing off, the shared non-recording span (every method a no-op). End it with span.end()."""
    if _tracer is None:
        return INVALID_SPAN
    if isinstance(parent, Span):
        parent = trace.set_span_in_context(parent, Context())
    return _tracer.start_span(name, parent if parent is not None else Context(), kind=kind, attributes=attributes)


def fail(span: Span, exc: BaseException | str) -> None:
    """Mark `span` failed by `exc` (an exception, or what went wrong in words). An exception also carries
    the span's trace id from here (`exc.trace_id`), for the log line the error interceptor writes."""
    if not span.is_recording():
        return
    if isinstance(exc, BaseException):
        span.record_exception(exc)
        description = f"{type(exc).__name__}: {exc}"
        tid = trace_id(span)
        try:
            exc.trace_id = tid
        except AttributeError:  # an exception type that takes no attributes
            pass
    else:
        description = exc
    span.set_status(Status(StatusCode.ERROR, description[:500]))


class ending:
    """`with tracing.ending(span):` ends the span on leaving, failed if an exception leaves (a cancelled task, or
    a generator closed early as its call was cancelled, is an event, not a failure)."""

    def __init__(self, span: Span):
        self.span = span

    def __enter__(self) -> Span:
        return self.span

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None and exc_type in (GeneratorExit, asyncio.CancelledError):
            self.span.add_event("cancelled")
        elif exc is not None:
            fail(self.span, exc)
        self.span.end()


# ---- propagation

def extract(carrier: Iterable[tuple[str, str]] | Mapping[str, str] | None) -> Context | None:
    """The caller's trace context from gRPC metadata ((key, value) pairs) or HTTP headers (a mapping with
    lower-case keys); None when tracing is off or the caller sent none (a new trace begins)."""
    if _tracer is None or not carrier:
        return None
    if isinstance(carrier, Mapping):
        found = {k: carrier[k] for k in KEYS if carrier.get(k)}
    else:
        found = {k: v for k, v in carrier if k in KEYS}
    if "traceparent" not in found:
        return None
    ctx = _propagator.extract(found, Context())
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def metadata(span: Span) -> tuple[tuple[str, str], ...]:
    """gRPC metadata that makes the callee's spans children of `span`; () when it is not traced."""
    if not span.get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, trace.set_span_in_context(span, Context()))
    return tuple(carrier.items())


def traceparent(span: Span) -> str:
    """`span`'s W3C traceparent (a proto field's value), "" when it is not traced."""
    return dict(metadata(span)).get("traceparent", "")


def from_traceparent(value: str) -> Context | None:
    """The context a traceparent names (DecodeRequest.traceparent), None if empty, malformed or off."""
    return extract({"traceparent": value}) if value else None


def trace_id(span: Span) -> str:
    """The span's trace id in hex (as Jaeger and Tempo show it), "" when it is not traced."""
    ctx = span.get_span_context()
    return trace.format_trace_id(ctx.trace_id) if ctx.is_valid else ""
